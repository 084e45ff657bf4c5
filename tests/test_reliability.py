"""Crash-safe resume, numerical guards, dead ranks, memory refusal."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import cold_env, python, tiny
from safetensors.torch import load_file

from lean import checkpoint
from lean.config import ConfigError
from lean.rewards import REWARDS, register
from lean.run.iteration import NonFiniteError
from lean.train import Trainer, resolve_schedule, train

RUN = [
    "--set",
    "train.prompts_per_iteration=2",
    "--set",
    "train.group_size=2",
    "--set",
    "sample.num_steps=6",
    "--set",
    "train.iterations=12",  # a tiny iteration takes ~0.1 s: enough of them that a stop lands mid-run
    "--set",
    "checkpoint.every=1",
    "--set",
    "train.rollout_batch_size=1",
]


TRAIN = ["-m", "lean.cli", "train", *RUN]  # after python(): the session sets the warm one up after collection


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The LoRA weights of the RUN config trained without a stop (what every resumed run must end with)."""
    out = tmp_path_factory.mktemp("uninterrupted")  # run there, as the tests run in theirs: no params.yaml
    subprocess.run([python(), *TRAIN, "--out", str(out)], check=True, capture_output=True, timeout=300, cwd=out)
    return load_file(out / "lora.safetensors")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigkill_mid_iteration_then_resume_is_bit_identical(tmp_path, uninterrupted, capsys):
    """SIGKILL inside an iteration: no final weights; --resume from the last complete checkpoint ends with the
    weights of a run that was never stopped; a changed objective is refused on resume."""
    killed = tmp_path / "killed"
    cmd = [python(), *TRAIN]

    proc = subprocess.Popen([*cmd, "--out", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = killed / "checkpoints"
    deadline = time.time() + 200
    while not (ckpts / "iter-000001.sha256").exists():  # iterations 0 and 1 are saved: kill inside iteration 2
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (killed / "lora.safetensors").exists()

    subprocess.run([*cmd, "--out", str(killed), "--resume"], check=True, capture_output=True, timeout=300)
    a, b = uninterrupted, load_file(killed / "lora.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # A changed objective is refused before anything is built, naming the key (in this process: a process of its
    # own would spend seconds importing what the refusal never reaches)
    from lean.cli import main

    capsys.readouterr()
    changed = ["--set", "optimizer.lr=2e-4", "--set", "train.iterations=13"]
    assert main(["train", *RUN, "--out", str(killed), "--resume", *changed]) == 2
    refused = capsys.readouterr().err
    assert "optimizer.lr: " in refused and "-> 0.0002" in refused
    assert "train.iterations" not in refused and len(refused.strip().splitlines()) == 1


@pytest.mark.timeout(400)
def test_sigterm_stops_at_the_next_safe_point_with_a_checkpoint_then_resume_is_bit_identical(tmp_path, uninterrupted):
    """What a scheduler's preemption does: SIGTERM mid-run, a checkpoint after the current iteration, exit 143 with
    one line; --resume ends with the weights of a run that was never stopped."""
    stopped = tmp_path / "stopped"
    cmd = [
        python(),
        *TRAIN,
        "--set",
        "checkpoint.every=0",
    ]  # only the stop writes a checkpoint (checkpoint.every changes no result)
    proc = subprocess.Popen([*cmd, "--out", str(stopped)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # set up; the loop starts: the signal lands before or during the first iteration (on any machine: a fixed sleep
    # let a fast one finish all 12 first), so the stop comes after iteration 1 at the latest safe point
    assert proc.stdout.readline().startswith("lean train:")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    lines = err.strip().splitlines()
    assert "SIGTERM: stopped after iteration" in lines[-1] and "--resume" in lines[-1], lines[-1]
    saved = checkpoint.latest(stopped / "checkpoints")
    assert saved is not None and not (stopped / "lora.safetensors").exists()
    done = len(saved["history"])
    assert 1 <= done < 12, done

    subprocess.run([*cmd, "--out", str(stopped), "--resume"], check=True, capture_output=True, timeout=300)
    a, b = uninterrupted, load_file(stopped / "lora.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_corrupted_checkpoint_is_skipped(tmp_path):
    folder = tmp_path / "ckpt"
    checkpoint.save(folder, 0, {"w": torch.ones(3)}, keep=3)
    checkpoint.save(folder, 1, {"w": torch.full((3,), 2.0)}, keep=3)
    data = bytearray((folder / "iter-000001.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "iter-000001.pt").write_bytes(bytes(data))
    (folder / "iter-000002.pt").write_bytes(b"partial")  # no digest: an interrupted write
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        state = checkpoint.latest(folder)
    assert state["iteration"] == 0 and torch.equal(state["w"], torch.ones(3))


def test_checkpoints_keep_the_last_k_and_refuse_nan(tmp_path):
    for i in range(4):
        checkpoint.save(tmp_path, i, {"w": torch.ones(1)}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["iter-000002.pt", "iter-000003.pt"]
    with pytest.raises(FloatingPointError, match="state.w"):
        checkpoint.save(tmp_path, 9, {"w": torch.tensor([float("nan")])}, keep=2)


@pytest.fixture
def nan_reward():
    @register("test_nan")
    def _nan(images, prompts):
        r = torch.zeros(images.shape[0], dtype=torch.float64)
        r[0] = float("nan")
        return r

    yield "test_nan"
    REWARDS.pop("test_nan")


@pytest.mark.timeout(120)
def test_nonfinite_reward_aborts_naming_tensor_and_iteration(nan_reward, tmp_path):
    with pytest.raises(NonFiniteError, match=r"reward .* iteration 0"):
        train(tiny(f"reward.weights={{{nan_reward}: 1.0}}"), out=str(tmp_path))


@pytest.mark.timeout(120)
def test_nonfinite_skip_leaves_the_weights_untouched(nan_reward, tmp_path):
    cfg = tiny(f"reward.weights={{{nan_reward}: 1.0}}", "train.on_nonfinite=skip", "train.iterations=2")
    with pytest.warns(UserWarning, match="skipping iteration"):
        history = train(cfg, out=str(tmp_path))
    assert all(row.get("skipped") == 1 for row in history)
    fresh = Trainer(cfg).policy.lora_state_dict()
    saved = load_file(tmp_path / "lora.safetensors")
    assert all(torch.equal(fresh[k], saved[k]) for k in fresh)


@pytest.mark.timeout(120)
def test_retain_over_budget_is_refused_with_the_figure():
    trainer = Trainer(tiny("train.schedule=retain", "train.memory_budget_mb=1"))
    with pytest.raises(ConfigError, match=r"train.memory_budget_mb.*predicted to peak at \d+ MiB"):
        resolve_schedule(trainer)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [k for kid in kids for k in _children(kid)]


def _rank_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dead_rank_stops_the_job_with_a_clear_message(tmp_path):
    cmd = [
        sys.executable,  # with cold_env(): the ranks are the launcher's descendants, found by `ps --ppid`
        "-m",
        "lean.cli",
        "launch",
        "-n",
        "2",
        "--",
        "train",
        "--set",
        "train.iterations=50",
        "--set",
        "train.dist_timeout_s=20",
        "--set",
        "train.prompts_per_iteration=2",
        "--set",
        "train.group_size=2",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=cold_env()
    )
    seen = ""
    while "rollout" not in seen:  # rank 0's rollout progress bar: the job is mid-rollout
        line = proc.stdout.readline()
        assert line, seen[-2000:]
        seen += line
    assert "lean launch: 2 CPU processes, gloo" in seen  # ACCELERATE_USE_CPU=1 + --multi_gpu: two ranks, not one
    ranks = {_rank_of(p): p for p in _children(proc.pid)}
    assert "1" in ranks, ranks
    os.kill(ranks["1"], signal.SIGKILL)
    start = time.time()
    rest, _ = proc.communicate(timeout=60)
    assert time.time() - start < 60 and proc.returncode != 0
    assert "rank" in (seen + rest) and ("1" in rest)
    leftover = [
        p
        for p in ranks.values()
        if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
    ]
    assert not leftover


def test_resume_guard_names_what_changed_and_ignores_the_run_length():
    from lean.configure import load_config
    from lean.train import config_changes

    saved = load_config(None, ["optimizer.lr=1e-4"]).to_dict()
    longer = load_config(None, ["optimizer.lr=1e-4", "train.iterations=50", "train.out=elsewhere", "train.threads=2"])
    assert config_changes(saved, longer) == []
    changed = load_config(None, ["optimizer.lr=3e-4", "train.group_size=8"])
    assert config_changes(saved, changed) == ["optimizer.lr: 0.0001 -> 0.0003", "train.group_size: 4 -> 8"]


def test_a_broken_pretrained_folder_is_one_config_error(tmp_path):
    import json

    from lean.config import ConfigError
    from lean.configure import load_config

    def problem(folder):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.pretrained={folder}", "model.family=sd3"])
        assert len(str(err.value).splitlines()) == 1 and "model.pretrained" in str(err.value)
        return str(err.value)

    assert "no model_index.json" in problem(tmp_path)
    (tmp_path / "model_index.json").write_text("{not json")
    assert "not readable JSON" in problem(tmp_path)
    index = {"transformer": ["diffusers", "FluxTransformer2DModel"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    assert "vae" in problem(tmp_path)  # components missing from the index
    names = ["vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3"]
    index.update({n: ["diffusers", "X"] for n in names})
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    assert "FluxTransformer2DModel, not model.family=sd3's SD3Transformer2DModel" in problem(tmp_path)
    index["transformer"] = ["diffusers", "SD3Transformer2DModel"]
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    assert "no transformer/config.json" in problem(tmp_path)
