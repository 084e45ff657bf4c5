"""Bad input gets one line naming the key; good input becomes a typed config."""

import subprocess

import pytest
from helpers import python

from lean.config import ConfigError, RunConfig
from lean.configure import load_config, validate

BAD = [
    ("sample.sde_kind=euler", "sample.sde_kind"),
    ("sample.noise_level=0", "sample.noise_level"),
    ("sample.noise_level=-0.5", "sample.noise_level"),
    ("train.group_size=1", "train.group_size"),
    ("sample.num_steps=0", "sample.num_steps"),
    ("sample.timestep_fraction=1.5", "sample.timestep_fraction"),
    ("sample.timestep_fraction=0", "sample.timestep_fraction"),
    ("sample.sde_window=20", "sample.sde_window"),
    ("algorithm.clip_range=0", "algorithm.clip_range"),
    ("optimizer.lr=fast", "optimizer.lr"),
    ("optimizer.adam_beta2=1", "optimizer.adam_beta2"),
    ("ema.decay=1.5", "ema.decay"),
    ("ema.every=0", "ema.every"),
    ("ema.unit=epoch", "ema.unit"),
    ("checkpoint.every=-1", "checkpoint.every"),
    ("checkpoint.keep=0", "checkpoint.keep"),
    ("model.family=sdxl", "model.family"),
    ("model.dtype=float8", "model.dtype"),
    ("model.resolution=30", "model.resolution"),
    ("model.family=wan ; model.num_frames=4", "model.num_frames"),
    ("train.schedle=retain", "train.schedle"),
    ("train.schedule=retain2", "train.schedule"),
    ("reward.weights={aesthetics: 1.0}", "reward.weights.aesthetics"),
    ("model.pretrained=/nonexistent", "model.pretrained"),
    ("trian.lr=1", "trian"),
    ("train.iterations=2.5", "train.iterations"),
    ("sample.cfg=maybe", "sample.cfg"),
    ("sample.guidance_embed=3.5", "sample.guidance_embed"),
    ("sample.sde_window_start=2", "sample.sde_window_start"),  # no window
    ("sample.sde_window=2 ; sample.sde_window_start=8", "sample.sde_window_start"),  # past num_steps - 1 - window
    ("sample.sde_window=2 ; sample.sde_window_min_start=9", "sample.sde_window_min_start"),  # past the max start
    ("algorithm.reward_combination=mean", "algorithm.reward_combination"),
    ("algorithm.reward_combination=gdpo ; algorithm.global_std=true", "algorithm.global_std"),
    ("algorithm.name=dpo ; algorithm.reward_combination=per_reward", "algorithm.reward_combination"),
]


@pytest.mark.parametrize("override,key", BAD)
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, override.split(" ; "))
    msg = str(err.value)
    assert key in msg and "\n" not in msg


def test_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'schedule'"):
        load_config(None, ["train.schedle=retain"])


def test_several_updates_per_rollout_run_as_hybrids_unless_the_first_is_known_late():
    """A Lean schedule with several updates per rollout is a hybrid (lean.schedules.hybrid): it needs the first
    update's samples before the rewards. With the zero-advantage filter it splits first (``auto``); FlowGRPO's order,
    asked for explicitly, decides them after the rewards and is refused in one line naming the key."""
    skip = "algorithm.skip_zero_advantage=true"
    for steps in (["train.optimizer_steps_per_iteration=2"], ["train.num_inner_epochs=2"]):
        for schedule in ("retain", "reweight"):
            load_config(None, [f"train.schedule={schedule}", *steps])
            load_config(None, [f"train.schedule={schedule}", *steps, skip, "algorithm.beta=0.04"])
            filter_first = "algorithm.zero_advantage_order=filter_then_split"
            with pytest.raises(ConfigError, match="algorithm.zero_advantage_order") as err:
                load_config(None, [f"train.schedule={schedule}", *steps, skip, filter_first])
            assert steps[0] in str(err.value) and "\n" not in str(err.value)
            # the one-step form needs one pass over the rollout: offered only then
            assert ("train.on_policy=true" in str(err.value)) == ("num_inner_epochs" not in steps[0])
    load_config(None, ["train.schedule=recompute", "train.num_inner_epochs=2", "train.optimizer_steps_per_iteration=2"])
    with pytest.raises(ConfigError, match="algorithm.zero_advantage_order=.first") as err:
        load_config(None, ["algorithm.zero_advantage_order=first"])
    assert "split_then_filter" in str(err.value) and "\n" not in str(err.value)


def test_world_size_must_divide_the_batch():
    cfg = load_config(None, ["train.prompts_per_iteration=3", "train.group_size=3"])
    with pytest.raises(ConfigError, match="train.prompts_per_iteration"):
        validate(cfg, world_size=2)
    validate(cfg, world_size=3)


def test_typed_sections_and_overrides():
    cfg = load_config(None, ["model.family=wan", "optimizer.lr=3e-4", "sample.cfg=false"])
    assert isinstance(cfg, RunConfig)
    assert cfg.model.family == "wan" and cfg.optimizer.lr == 3e-4 and cfg.sample.cfg is False


def test_params_file_and_unknown_section(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("model:\n  family: wan\nprepare:\n  anything: 1\n")  # other (DVC) sections are ignored
    assert load_config(p).model.family == "wan"
    p.write_text("model:\n  famly: wan\n")
    with pytest.raises(ConfigError, match="model.famly"):
        load_config(p)


def test_cli_prints_one_line_and_exits_2():
    proc = subprocess.run(
        [python(), "-m", "lean.cli", "train", "--set", "sample.sde_kind=euler"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "sample.sde_kind" in lines[0] and "Traceback" not in proc.stderr


def test_a_run_that_cannot_fit_is_refused_before_anything_is_built(capsys):
    """One trajectory's tracked step keeps at least [tokens, width] per block (``tracked_step_floor``): at 1M pixels
    a side that is terabytes, refused in one line before a model is built (it used to die in the time shift)."""
    from lean.cli import main

    assert main(["train", "--set", "model.resolution=1048576"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lean: config error: model.resolution=1048576: one trajectory's")
    assert "GiB of activations (17,179,869,184 tokens x width 32 x 2 blocks x 4 bytes)" in err[0]
    # the budget counts as the device: a small model at 256 px does not fit in 0.01 MiB either
    assert main(["plan", "--set", "model.resolution=256", "--set", "train.memory_budget_mb=0.01"]) == 2


@pytest.mark.parametrize(
    "override,new",
    [
        ("train.beta=0.1", "algorithm.beta"),
        ("train.clip_range=0.2", "algorithm.clip_range"),
        ("train.skip_zero_advantage=true", "algorithm.skip_zero_advantage"),
        ("train.layout=group", "parallel.layout"),
        ("model.sequence_parallel=2", "parallel.sequence_parallel"),
        ("model.overlap=flash", "parallel.overlap"),
        ("train.lr=3e-4", "optimizer.lr"),
        ("train.max_grad_norm=2.0", "optimizer.max_grad_norm"),
        ("train.ema=true", "ema.enabled"),
        ("train.ema_decay=0.5", "ema.decay"),
        ("train.save_every=2", "checkpoint.every"),
        ("train.keep_checkpoints=3", "checkpoint.keep"),
    ],
)
def test_a_moved_key_names_its_new_place(override, new):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    old, value = override.split("=")
    assert str(err.value).startswith(f"config error: {old}=") and str(err.value).endswith(f": moved to {new}")
    if new != "parallel.sequence_parallel":  # (2 needs two processes)
        load_config(overrides=[f"{new}={value}"])  # the new place takes it


def test_a_moved_key_in_a_params_file_names_its_new_place(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train:\n  shard: fsdp\n")
    with pytest.raises(ConfigError, match=r"^config error: train.shard='fsdp': moved to parallel.shard$"):
        load_config(path)


def test_a_config_written_before_keys_moved_reads_at_their_new_places():
    """A run's config.json or a checkpoint's config from before a move (``lean export --run``, ``--resume``)."""
    from lean.config.moved import relocated
    from lean.train import config_changes

    before = {"train": {"iterations": 5, "lr": 3e-4, "ema": True, "save_every": 2}, "model": {"overlap": "sliced"}}
    now = {"train": {"iterations": 5}, "optimizer": {"lr": 3e-4}, "ema": {"enabled": True}, "checkpoint": {"every": 2}}
    assert relocated(before) == {**now, "model": {}, "parallel": {"overlap": "sliced"}}
    assert before["train"]["lr"] == 3e-4  # a copy
    cfg = load_config(tree=relocated(before))
    assert (cfg.optimizer.lr, cfg.ema.enabled, cfg.checkpoint.every, cfg.parallel.overlap) == (3e-4, True, 2, "sliced")
    assert relocated(cfg.to_dict()) == cfg.to_dict()  # nothing moved: the same tree
    saved = cfg.to_dict()  # as a checkpoint before the move held it: no optimizer, ema and checkpoint sections
    saved["train"] |= {"lr": saved.pop("optimizer")["lr"], "ema": saved.pop("ema")["enabled"], "save_every": 2}
    del saved["checkpoint"]
    assert config_changes(saved, cfg) == []
    assert config_changes(saved | {"train": saved["train"] | {"lr": 1e-4}}, cfg) == ["optimizer.lr: 0.0001 -> 0.0003"]


def test_a_schedule_that_cannot_run_the_algorithm_exactly_is_refused(monkeypatch):
    """Retain needs an on-policy ratio of 1, Reweight also a loss linear in the target: an algorithm without those
    facts is refused in one line naming both; Recompute runs any."""
    from lean.algorithms import ALGORITHMS, Algorithm
    from lean.algorithms.base import RATIO_ONE_ON_POLICY

    class Unfolded(Algorithm):  # ratio 1 on-policy, but not linear in its target
        facts = frozenset({RATIO_ONE_ON_POLICY})

    monkeypatch.setitem(ALGORITHMS, "unfolded", Unfolded)
    assert load_config(overrides=["algorithm.name=unfolded", "train.schedule=retain"]).train.schedule == "retain"
    assert load_config(overrides=["algorithm.name=unfolded", "train.schedule=recompute"])
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["algorithm.name=unfolded", "train.schedule=reweight"])
    assert str(err.value).startswith(
        "config error: train.schedule='reweight': cannot run algorithm.name=unfolded exactly: it needs a loss "
        "linear in the target"
    )
    with pytest.raises(ConfigError, match="algorithm.name='grpoo'.*did you mean 'grpo'"):
        load_config(overrides=["algorithm.name=grpoo"])
