"""The workbench: the synthetic task agrees with the rewards, pretraining writes a loadable base, the method stages
reproduce one iteration and certify the three updates, and a smoke `dvc repro` of the whole pipeline (tiny params, in
a temporary copy of the repository) logs its runs to an `mlflow server` checked through the REST API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from helpers import free_port, venv_path

from lean.config import DEFAULT_PROMPTS, ConfigError
from lean.configure import load_config
from lean.models.options import ModelConfig
from lean.rewards import compute_rewards
from lean.workbench import data
from lean.workbench.method import compare_updates, run_advantage, run_rollout, run_update
from lean.workbench.stage import stage_config

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
ALGORITHM_RUNS = tuple(PARAMS["rl"]["algorithms"])  # the train stage's algorithm runs (the smoke keeps the list)
STAGES = (
    "prepare",
    "rollout",
    "advantage",
    "update@recompute",
    "update@retain",
    "update@reweight",
    "equivalence",
    "equivalence_bf16",
    "train",
    "bench_schedules",
    "overlap",
    "report",
)


# ---------------------------------------------------------------- the synthetic task


def test_scenes_and_captions():
    scenes = data.all_scenes()
    assert len(scenes) == 840 and len({s.caption for s in scenes}) == 840
    assert data.Scene("red", "circle", "left", "blue").caption == "a red circle on the left on a blue background"
    assert set(DEFAULT_PROMPTS) <= {s.caption for s in scenes}  # GRPO's default prompts are in the data set


def test_rendered_scenes_score_high_on_the_rewards():
    scenes = [data.Scene(c, s, "center", b) for c, b in (("red", "white"), ("blue", "yellow")) for s in data.SHAPES]
    images = torch.stack([data.render(s, 32) for s in scenes])
    total, _ = compute_rewards({"color_match": 1.0}, images, [s.caption for s in scenes])
    assert (total > 0.7).all()  # a triangle fills half of the central box the reward looks at
    assert total[1] == total[4] == 1.0  # squares fill it exactly
    left = data.Scene("green", "square", "left", "black")
    right = data.Scene("green", "square", "right", "black")
    images = torch.stack([data.render(left, 32), data.render(right, 32)])
    total, _ = compute_rewards({"position_match": 1.0}, images, [left.caption, left.caption])
    assert total[0] > 0.2 and total[1] == -total[0]  # the mirrored image is penalised for a prompt saying "left"


def test_dataset_is_seeded_and_shaped():
    a, captions = data.make_dataset(6, 32, seed=3)
    b, _ = data.make_dataset(6, 32, seed=3)
    assert torch.equal(a, b) and a.shape == (6, 3, 32, 32) and len(captions) == 6
    video, _ = data.make_dataset(2, 32, seed=0, frames=5)
    assert video.shape == (2, 3, 5, 32, 32) and torch.equal(video[:, :, 0], video[:, :, 4])


@pytest.mark.timeout(120)
def test_pretrain_writes_a_loadable_calibrated_base(tmp_path):
    from lean.models import build_policy
    from lean.workbench.pretrain import PretrainConfig, encode_latents, normalise_latents, pretrain

    cfg = PretrainConfig(images=32, vae_steps=3, steps=4, batch_size=8)
    result = pretrain(ModelConfig(), cfg, tmp_path / "base", eval_prompts=DEFAULT_PROMPTS[:2])
    assert len(result["vae_mse"]) == 3 and len(result["flow_loss"]) == 4
    assert 0 <= result["summary"]["reward_pretrained"] <= 1
    policy = build_policy(ModelConfig(pretrained=str(tmp_path / "base")), DEFAULT_PROMPTS)  # LoRA on top of it
    images, _ = data.make_dataset(32, 32, seed=cfg.seed)
    x = normalise_latents(policy, encode_latents(policy.vae, images * 2 - 1))
    assert abs(x.mean().item()) < 1e-3 and x.std().item() == pytest.approx(1.0, abs=1e-3)  # calibrated on these
    ids = policy.tokenizers["tokenizer_2"](data.vocabulary()[-1]).input_ids
    assert policy.tokenizers["tokenizer_2"].unk_token_id not in ids  # the tokenizer reads the task's words


# ---------------------------------------------------------------- stage configuration


def test_stage_config_layers(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(
        yaml.safe_dump(
            {
                "train": {"iterations": 3},
                "optimizer": {"lr": 1e-4},
                "reward": {"weights": {"color_match": 1.0}},
                "rl": {
                    "run": {
                        "train": {"iterations": 7, "prompts": ["a red circle on a white background"]},
                        "reward": {"weights": {"position_match": 1.0}},
                    }
                },
                "other_stage": {"anything": 1},
            }
        )
    )
    cfg = stage_config(params, "rl", schedule="reweight")
    assert cfg.train.iterations == 7 and cfg.optimizer.lr == 1e-4 and cfg.train.schedule == "reweight"
    assert cfg.train.prompts == ["a red circle on a white background"]
    assert cfg.reward.weights == {"position_match": 1.0}  # a mapping value replaces, never merges
    assert stage_config(params).train.iterations == 3
    params.write_text(yaml.safe_dump({"rl": {"run": {"bench": {"repeats": 1}}}}))
    with pytest.raises(ConfigError, match="rl.run.bench.*unknown section"):
        stage_config(params, "rl")


# ---------------------------------------------------------------- one iteration taken apart


@pytest.mark.timeout(180)
def test_method_stages_reproduce_and_certify():
    cfg = load_config(None, ["train.prompts_per_iteration=2", "train.group_size=2", "sample.num_steps=4"])
    trajectory, summary, steps = run_rollout(cfg, perturb_std=0.02)
    assert [row["trained"] for row in steps] == [1, 1, 1, 0]  # the last step is never trained
    assert all(row["activation_mb"] > 0 for row in steps[:3]) and steps[3]["activation_mb"] == 0
    assert {f"x.{i}" for i in range(3)} <= set(trajectory) and "x.3" not in trajectory
    advantages, stats, rows = run_advantage(cfg, trajectory)
    assert len(rows) == 4 and abs(stats["advantage_mean"]) < 1e-9

    updates = {}
    for schedule in ("recompute", "retain", "reweight"):
        updates[schedule], info = run_update(cfg, schedule, trajectory, advantages["advantages"], 0.02)
        if schedule != "recompute":
            assert info["reproduces_trajectory"] and info["log_prob_max_abs_diff"] <= 1e-6
    report = compare_updates(updates, cfg.model.torch_dtype)
    assert report["passes"] and report["max_rel_grad_diff_retain"] <= 1e-5

    bad = dict(updates["retain"])
    name = next(k for k in bad if k.startswith("grad."))
    bad[name] = bad[name] * 1.01  # a wrong gradient must fail the certificate
    assert not compare_updates({**updates, "retain": bad}, cfg.model.torch_dtype)["passes"]


# ---------------------------------------------------------------- the pipeline, end to end

TINY = {
    "prepare": {"images": 64, "vae_steps": 4, "steps": 4, "batch_size": 8},
    "method": {
        "run": {
            "sample": {"num_steps": 4},
            "train": {"prompts_per_iteration": 2, "group_size": 2, "rollout_batch_size": 4, "train_batch_size": 4},
        }
    },
    "rl": {
        "run": {
            "sample": {"num_steps": 4},
            "train": {
                "iterations": 2,
                "prompts_per_iteration": 2,
                "group_size": 2,
                "rollout_batch_size": 4,
                "train_batch_size": 4,
            },
            # evaluated (the training notebook's base-vs-trained images and eval-reward curves are drawn): 2 prompts x
            # 2 samples, 2 Euler steps, after every iteration; the base model also under a second eval seed
            "eval": {"every": 1, "samples_per_prompt": 2, "num_steps": 2, "noise_seeds": 2},
        },
        # the recipe of the time to reward: its one iteration of 2 updates holds the samples of the 2 above
        "recipe": {
            "run": {"train": {"prompts_per_iteration": 4, "optimizer_steps_per_iteration": 2, "iterations": 1}},
            "schedules": ["recompute", "retain"],
        },
        # the runs that set their own length and batch: a tree of 4 leaves on 4 steps, the recipe's shape
        "branch_grpo": {
            "run": {
                "algorithm": {"name": "branch_grpo"},
                "sample": {"tree": {"branch_points": [0, 1]}},
                "train": {"schedule": "retain", "group_size": 4, "rollout_batch_size": 8, "train_batch_size": 8},
            }
        },
        "tree_grpo": {
            "run": {
                "algorithm": {"name": "tree_grpo"},
                "sample": {"tree": {"branch_points": [0, 1]}},
                "train": {"schedule": "retain", "group_size": 4, "rollout_batch_size": 8, "train_batch_size": 8},
            }
        },
        "flow_dppo": {
            "run": {
                "algorithm": {"name": "flow_dppo"},
                "train": {"schedule": "retain", "prompts_per_iteration": 4, "optimizer_steps_per_iteration": 2},
            }
        },
        # the runs whose workbench length is their own (40 iterations): the smoke's 2
        "nft": {
            "run": {
                "algorithm": {"name": "nft"},
                "sample": {"tail_solver": "dpmsolver++"},
                "train": {"schedule": "recompute"},
            }
        },
        "awm": {"run": {"algorithm": {"name": "awm"}, "train": {"schedule": "recompute"}}},
        # the source's steps [1, 2, 3] need 5 steps: the smoke's 4 train steps 1 and 2
        "e_grpo": {
            "run": {
                "algorithm": {"name": "e_grpo", "e_grpo": {"steps": [1, 2]}},
                "sample": {"init_same_noise": True},
                "train": {"schedule": "retain"},
            }
        },
        "time_to_reward_gain": -1.0,  # a target every run reaches: the notebook's time-to-reward cell runs through
    },
    "bench": {
        "repeats": 1,
        "warmup": 0,
        "run": {
            "sample": {"num_steps": 4},
            "train": {"prompts_per_iteration": 1, "group_size": 2, "rollout_batch_size": 2, "train_batch_size": 2},
        },
    },
    "overlap": {
        "nproc": 2,
        "args": ["--quick", "--ops", "mlp.fc1", "--methods", "collective,flash", "--repeats", "2"],
        "sequence_parallel": {  # tiny Wan: 32 video tokens, 2 samples, 2 steps; one round
            "repeats": 1,
            "warmup": 0,
            "set": ["model.family=wan", "train.prompts_per_iteration=1", "train.group_size=2", "sample.num_steps=2"],
        },
    },
}
_SMOKE: dict[str, Path] = {}


def copy_repository(dst: Path) -> None:
    """The working tree as a fresh clone would have it (tracked and not-ignored files), committed in a new repo."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    git = ["git", "-c", "user.email=smoke@lean", "-c", "user.name=smoke"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "smoke"]):
        subprocess.run(git + cmd, cwd=dst, check=True, capture_output=True)
    # byte-compiled once, as `make install` does for the checkout: the copy has no __pycache__ (git and DVC ignore
    # it), and under PYTHONDONTWRITEBYTECODE each of the pipeline's ~30 processes would compile lean/ again
    compile_sources = [sys.executable, "-m", "compileall", "-q", "-j", "0", "lean", "pipelines"]
    subprocess.run(compile_sources, cwd=dst, check=True, capture_output=True)


def rest(url: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def start_mlflow_server(folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(folder / "server.log", "w")
    server = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{folder / 'server.db'}",
            "--artifacts-destination",
            str(folder / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mlflow server exited: {(folder / 'server.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return server, url
        except OSError:
            time.sleep(1)
    stop(server)
    raise RuntimeError("mlflow server did not come up within 90 s")


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def dvc(repo: Path, *args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    out = subprocess.run([str(BIN / "dvc"), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"dvc {' '.join(args)}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


def smoke_repo(tmp_root: Path) -> dict:
    """A temporary copy of the repository with tiny params, run once with `dvc repro` against an `mlflow server`
    (cached for the session: the notebook tests read its outputs). Returns the paths, the server URL and logs."""
    if "repo" in _SMOKE:
        return _SMOKE
    if "error" in _SMOKE:  # built once: a failed build fails its other tests at once instead of running again
        raise RuntimeError(f"the smoke pipeline failed earlier in this session: {_SMOKE['error']}")
    repo, work = tmp_root / "repo", tmp_root / "mlflow"
    repo.mkdir()
    work.mkdir()
    copy_repository(repo)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for section, values in TINY.items():
        params[section] = {**params.get(section, {}), **values}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        return _build_smoke(repo, work)
    except BaseException as err:
        _SMOKE["error"] = f"{type(err).__name__}: {str(err)[:2000]}"
        raise


def _build_smoke(repo: Path, work: Path) -> dict:
    server, url = start_mlflow_server(work)
    try:
        env = {
            **os.environ,
            "PATH": venv_path(),
            "MLFLOW_TRACKING_URI": url,
            "LEAN_TRACKING": "1",
        }
        env.pop("DVC_ROOT", None)
        start = time.perf_counter()
        first = dvc(repo, "repro", env=env, timeout=900)
        seconds = time.perf_counter() - start
        second = dvc(repo, "repro", env=env, timeout=120)
        experiment = rest(url, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=lean-workbench")["experiment"]
        runs = rest(
            url, "/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment["experiment_id"]], "max_results": 500}
        )["runs"]
        metrics_show = dvc(repo, "metrics", "show", "--json", env=env, timeout=120).stdout
        from mlflow.tracking import MlflowClient

        notebook_runs = {}  # the report stage's notebook runs: metrics and artifact paths, read while the server is up
        for r in runs:
            tags = {t["key"]: t["value"] for t in r["data"].get("tags", [])}
            if "lean.notebook" in tags:
                run_id = r["info"]["run_id"]
                client = MlflowClient(url)
                artifacts = [
                    a.path for folder in ("figures", "notebook") for a in client.list_artifacts(run_id, folder)
                ]
                metrics = {m["key"]: m["value"] for m in r["data"].get("metrics", [])}
                notebook_runs[tags["lean.notebook"]] = {"run_id": run_id, "metrics": metrics, "artifacts": artifacts}
    finally:
        stop(server)
    _SMOKE.update(
        repo=repo,
        outputs=repo / "outputs",
        first=first.stdout,
        second=second.stdout,
        runs=runs,
        seconds=seconds,
        metrics_show=metrics_show,
        notebook_runs=notebook_runs,
    )
    return _SMOKE


@pytest.fixture
def smoke(tmp_path_factory):
    return smoke_repo(tmp_path_factory.mktemp("smoke"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.xdist_group("smoke")  # the session's smoke pipeline, built once on this worker
def test_dvc_repro_end_to_end(smoke):
    print(f"smoke dvc repro: {smoke['seconds']:.0f} s")
    for stage in STAGES:
        assert f"Running stage '{stage}'" in smoke["first"], stage
    assert "Running stage" not in smoke["second"]  # a second repro reruns nothing
    outputs = smoke["outputs"]
    assert (outputs / "prepare" / "base" / "model_index.json").exists()
    assert json.loads((outputs / "equivalence" / "equivalence.json").read_text())["passes"]
    for schedule in ("retain", "reweight"):
        assert json.loads((outputs / "update" / schedule / "metrics.json").read_text())["reproduces_trajectory"]
    report = json.loads((outputs / "report" / "metrics.json").read_text())
    for key in (
        "speedup_retain",
        "speedup_reweight",
        "speedup_bound_retain",
        "mfu_recompute",
        "max_rel_grad_diff_retain",
        "max_rel_grad_diff_reweight",
        "overlap_exposed_ms_flash",
        "sp_exposed_ms_retain_flash",
        "reward_final_retain",
        "eval_reward_gain_retain",
        "eval_reward_noise_std",
        "eval_learning_passes",
    ):
        assert key in report, key
    for schedule in ("recompute", "retain", "reweight"):  # evaluated at 0, 1 and 2: the images of each
        assert sorted(os.listdir(outputs / "train" / schedule / "eval")) == ["0", "1", "2"]
    for algorithm in ALGORITHM_RUNS:  # the same stage's pool ran each algorithm, with its own log
        assert sorted(os.listdir(outputs / "algorithms" / algorithm / "eval")) == ["0", "1", "2"]
        assert f"train[{algorithm}]: reward" in (outputs / "algorithms" / algorithm / "train.log").read_text()
    assert "max_rel_grad_diff_retain" in smoke["metrics_show"]  # `dvc metrics show` reads the stages' metrics


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.xdist_group("smoke")  # the session's smoke pipeline, built once on this worker
def test_pipeline_runs_arrive_in_the_mlflow_server(smoke):
    runs = smoke["runs"]
    tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
    metrics = [{m["key"]: m["value"] for m in r["data"].get("metrics", [])} for r in runs]
    stages = {t.get("lean.stage") for t in tags}
    assert {"prepare", "rollout", "train", "bench_schedules", "equivalence", "report"} <= stages
    assert all(t.get("lean.git_commit") for t in tags)
    by_name = {t["mlflow.runName"]: (t, m) for t, m in zip(tags, metrics)}
    assert "speedup_retain" in by_name["bench_schedules"][1] and "mfu_reweight" in by_name["bench_schedules"][1]
    assert by_name["bench[retain]"][0]["mlflow.parentRunId"]  # nested: one child per schedule
    assert by_name["train[reweight]"][0]["lean.schedule"] == "reweight"
    assert "reward_mean" in by_name["train[reweight]"][1]
    nft = by_name["train[nft:recompute]"][0]  # an algorithm's run: the train stage's too
    assert nft["lean.stage"] == "train" and nft["lean.algorithm"] == "nft"
    assert "max_rel_grad_diff_reweight" in by_name["notebook[equivalence]"][1]
    assert "overlap_exposed_ms_flash" in by_name["notebook[overlap]"][1]


def declared_outputs() -> dict[str, bool]:
    """Every output path dvc.yaml declares (matrix stages expanded) -> whether DVC caches it."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    declared = {}
    for stage in stages.values():
        items = [{}]
        for key, values in (stage.get("matrix") or {}).items():
            items = [{**item, key: v} for item in items for v in values]
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind, []):
                path, options = next(iter(entry.items())) if isinstance(entry, dict) else (entry, {})
                for item in items:
                    expanded = path
                    for key, value in item.items():
                        expanded = expanded.replace(f"${{item.{key}}}", str(value))
                    declared[expanded] = options.get("cache", True)
    return declared


def test_git_keeps_exactly_the_uncached_outputs():
    """DVC experiments compare what git holds: every `cache: false` metric, plot and report of dvc.yaml is tracked
    (.gitignore lets it through), every cached output and anything undeclared under outputs/ is ignored."""
    declared = declared_outputs()
    undeclared = ["outputs/train/retain/checkpoints/iter_000001/state.pt", "outputs/bench/measured.jsonl"]
    paths = [*declared, *undeclared]
    out = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True, check=False
    )
    ignored = set(out.stdout.split())
    assert [p for p, cached in declared.items() if not cached and p in ignored] == []
    assert [p for p, cached in declared.items() if cached and p not in ignored] == []
    assert all(p in ignored for p in undeclared)


def test_the_train_stage_declares_every_run_it_starts():
    """dvc.yaml lists the train stage's outputs by hand (a stage's outs cannot loop over a param): every run that
    pipelines/train.py starts from params.yaml (schedules, recipe, algorithms) is declared, and no other."""
    from pipelines.train import runs

    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]
    declared = {
        next(iter(e)) if isinstance(e, dict) else e for kind in ("outs", "metrics", "plots") for e in stage[kind]
    }
    started = {str(run.out) for run in runs(PARAMS, Path("outputs/train"), Path("outputs/algorithms")).values()}
    assert {str(Path(path).parent) for path in declared} == started
    for folder in started:
        assert {f"{folder}/{name}" for name in ("metrics.json", "metrics.csv", "eval.csv", "eval")} <= declared
    assert "--out outputs/train" in stage["cmd"] and "--algorithms-out outputs/algorithms" in stage["cmd"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.xdist_group("smoke")  # the session's smoke pipeline, built once on this worker
def test_dvc_experiments_compare_with_the_committed_baseline(smoke):
    """After a repro is committed (as main is, with dvc.lock and the uncached figures), a `dvc exp run --temp`
    experiment appears in `dvc exp show` beside the baseline with its metrics, and `dvc metrics diff` / `dvc plots diff`
    compare the baseline with it. The experiment changes a param of a cheap stage (the advantage stage's: rollout, which
    lists the same section, reruns before it): what is compared is DVC's, not the stage's."""
    repo = smoke["repo"]
    env = {**os.environ, "PATH": venv_path(), "LEAN_TRACKING": "0"}
    env.pop("DVC_ROOT", None)
    git = ["git", "-c", "user.email=smoke@lean", "-c", "user.name=smoke"]
    for cmd in (["add", "-A"], ["commit", "-qm", "baseline figures"]):
        subprocess.run(git + cmd, cwd=repo, check=True, capture_output=True)
    tracked = subprocess.run(["git", "ls-files", "outputs"], cwd=repo, capture_output=True, text=True).stdout
    assert "outputs/train/retain/metrics.json" in tracked and "lora.safetensors" not in tracked
    name = "global-std"  # the advantages over the whole batch's reward std instead of each group's
    run = ["exp", "run", "--temp", "-n", name, "-S", "algorithm.global_std=true", "advantage"]
    out = dvc(repo, *run, env=env, timeout=300).stdout
    assert "Running stage 'advantage'" in out and "Running stage 'train'" not in out
    shown = json.loads(dvc(repo, "exp", "show", "--json", env=env, timeout=120).stdout)
    baseline = shown[0]
    assert baseline["rev"] == "workspace" or baseline.get("experiments") is not None
    experiments = {
        e["name"]: e["revs"][0]["data"] for row in shown for e in (row.get("experiments") or []) if e.get("name")
    }
    assert name in experiments
    params, metrics = experiments[name]["params"]["params.yaml"]["data"], experiments[name]["metrics"]
    assert params["algorithm"]["global_std"] is True
    assert "advantage_std" in metrics["outputs/advantage/metrics.json"]["data"]
    assert "final_reward_mean" in metrics["outputs/train/retain/metrics.json"]["data"]  # the baseline's, carried
    assert "passes" in json.dumps(metrics["outputs/equivalence/metrics.json"]["data"])
    diff = json.loads(dvc(repo, "metrics", "diff", "HEAD", name, "--json", env=env, timeout=120).stdout)
    assert "advantage_abs_max" in diff["outputs/advantage/metrics.json"]  # another std: other advantages
    assert "outputs/train/retain/metrics.json" not in diff  # unchanged: not rerun
    plots = dvc(repo, "plots", "diff", "HEAD", name, "--json", "--split", env=env, timeout=120).stdout
    assert "outputs/advantage/samples.csv" in plots
