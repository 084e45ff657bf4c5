"""The published-recipe presets: cited values, the off-policy recipes under Recompute, the lean schedules exact on
their on-policy variants, the CLI and `lean plan` at the published sizes. Every run is at ``model.size=tiny`` with a
CPU-sized batch, keeping each preset's step count, SDE, guidance, LoRA and optimizer settings."""

import functools
import json
import math

import pytest
import torch
from helpers import QUICK, preset_value_lines, tiny_preset, tiny_preset_sets, uncited

from lean.config import ConfigError
from lean.config.presets import PRESETS as KNOWN_PRESETS
from lean.configure import load_config

# the recipes whose update trains on the rollout's steps (GRPO and its kin: Lean schedules run them as hybrids), and
# the ones that train on re-noised clean samples (their own update: lean/algorithms/clean_samples.py)
STEP_PRESETS = [
    "flowgrpo-sd3",
    "flowgrpo-flux",
    "flowgrpo-fast",
    "dancegrpo-flux",
    "flowgrpo-wan",
    "grpo-guard-sd3",
    "mixgrpo-flux",
    "mixgrpo-flash-flux",
    "unirl-flow-dppo-sd3",
]
CLEAN_SAMPLE_PRESETS = ["nft-sd3", "dpo-sd3"]
PRESETS = STEP_PRESETS + CLEAN_SAMPLE_PRESETS
# the recipes on a tree rollout (one update per rollout: the step presets' hybrid tests do not apply)
TREE_PRESETS = ["branchgrpo-flux"]
# the newer image models' recipes (issue #29): cited, published values, exact hybrids, the plan at published size
IMAGE_MODEL_PRESETS = [
    "flowgrpo-kontext",
    "flowgrpo-qwen-image",
    "flowgrpo-qwen-image-edit",
    "flowfactory-grpo-flux2",
    "flowfactory-grpo-flux2-klein",
]
# the recipes that are another preset's training with their own reward and prompts (their training is that preset's
# tests'): cited and published values
REWARD_TASK_PRESETS = ["flowgrpo-ocr-sd3"]  # flowgrpo-sd3 on FlowGRPO's OCR task (grpo.py:general_ocr_sd3)


def on_policy(name: str, *overrides: str):
    return tiny_preset(name, "train.optimizer_steps_per_iteration=1", *overrides)


def assert_preset_sigma_grid(trainer, name: str) -> None:
    """The Trainer samples on the preset's sigma grid (``sample.sigma_grid``) at its shift (resolved: 3, or FLUX's
    dynamic e^mu at 32 px = 16 tokens). Checked on the Trainers the recipe tests below build for every preset."""
    from lean.sampling.sde import sigma_schedule

    s = trainer.cfg.sample  # sample.shift resolved
    assert s.shift == pytest.approx(3.0 if name != "flowgrpo-flux" else math.exp(0.5 + 0.65 * (16 - 256) / 3840))
    expected = sigma_schedule(s.num_steps, s.shift, s.sigma_grid)
    assert torch.equal(trainer.pipeline.sigmas.cpu(), expected), f"Trainer ignores sample.sigma_grid={s.sigma_grid}"


def test_presets_ship_with_a_source_for_every_value():
    assert set(PRESETS + IMAGE_MODEL_PRESETS + TREE_PRESETS + REWARD_TASK_PRESETS) <= set(KNOWN_PRESETS)
    for name in PRESETS + IMAGE_MODEL_PRESETS + TREE_PRESETS + REWARD_TASK_PRESETS:
        values = preset_value_lines(name)
        assert len(values) >= 40, name
        bare = uncited(values, "sde_window_max_start: null")
        assert not bare, (name, bare)


PUBLISHED = {  # the recipes as the issue and the cited scripts state them
    "flowfactory-grpo-flux2": {  # Flow-Factory examples/grpo/lora/flux2/t2i.yaml
        "model.family": "flux2",
        "sample.num_steps": 8,
        "sample.noise_level": 1.0,
        "sample.guidance_embed": 4.0,
        "sample.cfg": False,
        "model.lora_rank": 64,
        "model.lora_alpha": 128,
        "model.lora_ffn": True,
        "train.group_size": 16,
        "optimizer.lr": 3e-4,
    },
    "flowfactory-grpo-flux2-klein": {  # Flow-Factory examples/grpo/lora/flux2_klein/default.yaml
        "model.family": "flux2_klein",
        "sample.num_steps": 4,
        "sample.noise_level": 0.5,
        "sample.cfg": False,
        "model.resolution": 384,
    },
    "flowgrpo-kontext": {  # config/grpo.py:counting_flux_kontext at 9745241
        "model.family": "kontext",
        "model.resolution": 512,
        "model.lora_rank": 64,
        "model.text_max_length": 128,
        "sample.num_steps": 6,
        "sample.noise_level": 0.9,
        "sample.cfg": False,
        "sample.guidance_embed": 2.5,
        "sample.timestep_fraction": 0.99,
        "train.group_size": 21,
        "train.prompts_per_iteration": 48,
        "ema.enabled": True,
        "optimizer.lr": 3e-4,
    },
    "flowgrpo-qwen-image": {  # config/grpo.py:pickscore_qwenimage at 9745241
        "model.family": "qwen_image",
        "model.resolution": 512,
        "model.lora_rank": 64,
        "sample.num_steps": 10,
        "sample.noise_level": 1.2,
        "sample.cfg": True,
        "sample.guidance_scale": 4.0,
        "sample.negative_prompt": " ",
        "sample.shift_terminal": None,  # resolved from Qwen-Image's scheduler config: 0.02
        "train.group_size": 16,
        "optimizer.lr": 3e-4,
    },
    "flowgrpo-qwen-image-edit": {  # config/grpo.py:counting_qwenimage_edit at 9745241
        "model.family": "qwen_image_edit",
        "model.resolution": 512,
        "model.lora_rank": 64,
        "sample.num_steps": 10,
        "sample.noise_level": 1.0,
        "sample.cfg": True,
        "sample.guidance_scale": 4.0,
        "sample.sde_window": 9,
        "train.group_size": 16,
        "optimizer.lr": 3e-4,
    },
    "flowgrpo-sd3": {
        "model.family": "sd3",
        "sample.num_steps": 10,
        "sample.sde_kind": "flow_grpo",
        "sample.noise_level": 0.7,
        "sample.timestep_fraction": 0.99,
        "sample.guidance_scale": 4.5,
        "sample.cfg": True,
        "model.lora_rank": 32,
        "model.lora_alpha": 64,
        "model.lora_ffn": False,
        "optimizer.lr": 3e-4,
        "algorithm.clip_range": 1e-4,
        "algorithm.adv_clip_max": 5.0,
        "algorithm.beta": 0.04,
        "algorithm.kl_form": "flow_grpo",
        "algorithm.skip_zero_advantage": True,
        "ema.decay": 0.9,
        "ema.every": 8,
        "ema.warmup": True,
        "optimizer.max_grad_norm": 1.0,
        "model.resolution": 512,
        "train.group_size": 24,
    },
    "flowgrpo-ocr-sd3": {  # config/grpo.py:general_ocr_sd3 at ac4c86e (lines 29-67)
        "model.family": "sd3",
        "model.resolution": 512,
        "sample.num_steps": 10,
        "sample.guidance_scale": 4.5,
        "sample.timestep_fraction": 0.99,
        "train.group_size": 24,
        "train.prompts_per_iteration": 48,
        "train.rollout_batch_size": 9,
        "train.optimizer_steps_per_iteration": 2,
        "algorithm.beta": 0.04,
        "algorithm.global_std": True,
        "ema.enabled": True,
        "reward.weights": {"ocr": 1.0},
    },
    "flowgrpo-flux": {
        "model.family": "flux",
        "sample.num_steps": 6,
        "sample.noise_level": 0.9,
        "sample.guidance_embed": 3.5,
        "sample.cfg": False,
        "model.lora_rank": 64,
        "model.lora_alpha": 128,
        "model.lora_init": "gaussian",
        "algorithm.beta": 0.0,
        "ema.repeats": 6,
        "model.dtype": "bfloat16",
    },
    "flowgrpo-fast": {
        "sample.sde_kind": "cps",
        "sample.noise_level": 0.8,
        "sample.sde_window": 3,
        "sample.sde_window_max_start": 2,
        "sample.num_steps": 10,
    },
    "dancegrpo-flux": {  # the LoRA run: finetune_flux_grpo_8gpus_lora.sh
        "sample.num_steps": 12,
        "train.prompts_per_iteration": 16,
        "train.optimizer_steps_per_iteration": 2,
        "model.lora_targets": ["to_q", "to_k", "to_v", "to_out.0"],
        "reward.decode": "x0_prediction",
        "sample.init_same_noise": True,
        "algorithm.adv_std": "unbiased",
        "sample.shift": 3.0,
        "sample.sde_kind": "dance",
        "sample.noise_level": 0.3,
        "sample.timestep_fraction": 0.6,
        "sample.timestep_selection": "random",
        "algorithm.beta": 0.0,
        "sample.cfg": False,
        "sample.guidance_embed": 3.5,
        "model.lora_rank": 128,
        "model.lora_alpha": 256,
        "model.lora_ffn": False,
        "optimizer.lr": 3e-4,
        "algorithm.clip_range": 1e-4,
        "train.group_size": 12,
        "model.gradient_checkpointing": True,
        "parallel.shard": "fsdp",  # fsdp_util.py:88 FULL_SHARD, the default of --fsdp_sharding_startegy
    },
    "branchgrpo-flux": {  # finetune_flux_branchgrpo_8gpus.sh at 19fbb9f
        "algorithm.name": "branch_grpo",
        "sample.num_steps": 20,
        "sample.tree": {
            "branch_points": [0, 3, 6, 9],
            "branching": 2,
            "branch_noise_scale": 4.0,
            "depth_pruning": [],
            "depth_pruning_slide_interval": 30,
            "depth_pruning_stop_depth": 9,
        },
        "train.group_size": 16,
        "train.prompts_per_iteration": 16,
        "train.iterations": 300,
        "sample.noise_level": 0.3,
        "sample.shift": 3.0,
        "sample.sde_kind": "dance",
        "sample.init_same_noise": True,
        "reward.decode": "x0_prediction",
        "algorithm.clip_range": 1e-3,
        "algorithm.adv_clip_max": 5.0,
        "optimizer.lr": 1e-5,
        "optimizer.weight_decay": 1e-4,
        "model.full_finetune": True,
        "model.resolution": 720,
    },
    "flowgrpo-wan": {
        "model.family": "wan",
        "sample.num_steps": 20,
        "sample.sde_kind": "flow_grpo_linear",
        "sample.guidance_scale": 4.5,
        "model.lora_rank": 32,
        "optimizer.lr": 1e-4,
        "algorithm.clip_range": 1e-3,
        "algorithm.beta": 0.004,
        "train.group_size": 4,
    },
    "grpo-guard-sd3": {  # config/grpo_guard.py general_ocr_sd3_rationorm at 2e2f712
        "algorithm.name": "grpo_guard",
        "model.family": "sd3",
        "sample.num_steps": 10,
        "sample.noise_level": 0.7,
        "sample.timestep_fraction": 0.99,
        "sample.cfg": True,
        "model.lora_rank": 32,
        "optimizer.lr": 1e-4,
        "algorithm.clip_range": 2e-6,
        "algorithm.beta": 0.0,
        "algorithm.global_std": False,
        "algorithm.skip_zero_advantage": True,
        "train.prompts_per_iteration": 48,
        "train.group_size": 24,
        "train.optimizer_steps_per_iteration": 2,
        "ema.repeats": 4,
    },
    "unirl-flow-dppo-sd3": {  # Tencent-Hunyuan/UniRL at 1a7b501: examples/diffusion/sd3_flowdppo.yaml
        "algorithm.name": "flow_dppo",
        "model.family": "sd3",
        "sample.num_steps": 10,
        "sample.shift": 3.0,
        "sample.noise_level": 0.7,
        "sample.cfg": False,
        "sample.sde_window": 5,  # the pool 0..4 (timestep_fraction [0.0, 0.5])
        "sample.sde_window_start": 0,
        "sample.sde_steps_drawn": 3,  # num_sde_steps
        "algorithm.flow_dppo.trust_region_means_dtype": "bfloat16",  # trajectory_precision bf16
        "model.lora_rank": 32,
        "model.lora_alpha": 64,
        "optimizer.lr": 3e-4,
        "optimizer.weight_decay": 0.0,
        "algorithm.beta": 0.0,
        "algorithm.global_std": True,
        "train.prompts_per_iteration": 48,
        "train.group_size": 16,
        "train.train_batch_size": 8,
        "train.optimizer_steps_per_iteration": 2,
        "ema.enabled": False,
    },
    "mixgrpo-flux": {  # Tencent-Hunyuan/MixGRPO at e5cdd6a: finetune_flux_grpo_MixGRPO.sh
        "algorithm.name": "mixgrpo",
        "model.family": "flux",
        "model.full_finetune": True,
        "sample.num_steps": 25,
        "sample.noise_level": 0.7,
        "sample.shift": 3.0,
        "sample.tail_solver": "euler",
        "optimizer.lr": 1e-5,
        "train.prompts_per_iteration": 32,
        "train.group_size": 12,
        "train.optimizer_steps_per_iteration": 4,
        "train.seed": 714,
        "algorithm.clip_range": 1e-4,
        "algorithm.adv_eps": 1e-8,
    },
    "mixgrpo-flash-flux": {  # finetune_flux_grpo_MixGRPO_Flash.sh
        "algorithm.name": "mixgrpo",
        "sample.num_steps": 25,
        "sample.tail_solver": "dpmsolver++",
        "sample.tail_compress": 0.4,
        "train.optimizer_steps_per_iteration": 4,
    },
    "nft-sd3": {  # NVlabs/DiffusionNFT at 24af555: config/nft.py sd3_geneval
        "algorithm.name": "nft",
        "model.family": "sd3",
        "sample.num_steps": 10,
        "sample.cfg": False,
        "sample.tail_solver": "dpmsolver++",
        "model.lora_rank": 32,
        "optimizer.lr": 3e-4,
        "algorithm.global_std": True,
        "train.prompts_per_iteration": 48,
        "train.group_size": 24,
        "train.optimizer_steps_per_iteration": 1,
    },
    "dpo-sd3": {  # yifan123/flow_grpo at ac4c86e: config/dpo.py geneval_sd3
        "algorithm.name": "dpo",
        "model.family": "sd3",
        "sample.num_steps": 40,
        "sample.guidance_scale": 4.5,
        "sample.timestep_fraction": 0.99,
        "model.lora_rank": 32,
        "optimizer.lr": 3e-4,
        "train.group_size": 24,
        "train.optimizer_steps_per_iteration": 1,
    },
}


@pytest.mark.parametrize("name", PRESETS + IMAGE_MODEL_PRESETS + TREE_PRESETS + REWARD_TASK_PRESETS)
def test_published_values(name):
    cfg = load_config(None, [], preset=name).to_dict()
    for key, value in PUBLISHED[name].items():
        *groups, field = key.split(".")  # a section, and a group in it (algorithm.flow_dppo)
        assert functools.reduce(dict.__getitem__, groups, cfg)[field] == value, key


def test_the_ocr_preset_trains_as_flowgrpo_sd3():
    """flowgrpo-ocr-sd3 is flowgrpo-sd3 (grpo.py: general_ocr_sd3 is one of its three recipes) with FlowGRPO's OCR
    reward and prompts: every other key resolves alike, so the sd3 recipe's training tests cover it."""
    sd3, ocr = (load_config(None, [], preset=p).to_dict() for p in ("flowgrpo-sd3", "flowgrpo-ocr-sd3"))
    differ = {f"{s}.{k}" for s in sd3 for k in sd3[s] if sd3[s][k] != ocr[s][k]}
    assert differ == {"reward.weights", "train.prompts"}
    assert ocr["reward"]["weights"] == {"ocr": 1.0} and len(ocr["train"]["prompts"]) == 8


@pytest.mark.timeout(180)
def test_branchgrpo_recipe_trains_its_tree_and_retain_gives_recomputes_gradient():
    """BranchGRPO's recipe shrunk to a tiny tree (b = 2 at steps 0 and 3, on 6 steps: 4 leaves a tree, 2 trees): one
    iteration under Recompute moves the weights on the preset's grid; in float64 Retain's one graph per node gives
    Recompute's gradient, and so does Reweight's buffer per edge."""
    from lean.tools.equivalence import passes, run_equivalence
    from lean.train import Trainer

    tree = ["sample.tree.branch_points=[0, 3]", "train.group_size=4", "sample.num_steps=6"]
    trainer = Trainer(tiny_preset("branchgrpo-flux", *tree))
    assert_preset_sigma_grid(trainer, "branchgrpo-flux")
    start = [p.detach().clone() for p in trainer.params]
    row = trainer.iteration(0, "recompute").metrics
    assert math.isfinite(row["reward_mean"]) and math.isfinite(row["policy_loss"])
    assert any(not torch.equal(p, s) for p, s in zip(trainer.params, start))
    cfg = tiny_preset("branchgrpo-flux", *tree, "model.dtype=float64")
    report = run_equivalence(cfg, reference=False)
    assert passes(report, cfg.model.torch_dtype) and not report.get("not_run")
    assert report["retain"]["max_rel_grad_diff"] < 1e-10 and report["reweight"]["max_rel_grad_diff"] < 1e-10


def test_flux_shift_is_the_pipelines_mu_at_512px():
    """FluxPipeline shifts by e^mu, mu linear in the image token count between FLUX.1-dev's scheduler settings
    (256 tokens -> 0.5, 4096 -> 1.15): 512 px = 32 x 32 patches = 1024 tokens -> mu = 0.5 + 0.65 x 768/3840 = 0.63.
    The preset leaves the shift to the pipeline folder (or FLUX's published scheduler config)."""
    from types import SimpleNamespace

    from lean.models import family_spec, time_shift
    from lean.models.flux import Flux

    cfg = load_config(None, [], preset="flowgrpo-flux")
    assert cfg.sample.shift is None
    full = family_spec("flux").sizes["full"]
    arch = Flux(SimpleNamespace(**full.transformer), SimpleNamespace(**full.vae), cfg.model.resolution)
    assert arch.image_seq_len == 1024
    shift, source = time_shift("flux", cfg.model.pretrained, cfg.sample.shift, arch.image_seq_len)
    assert shift == pytest.approx(math.exp(0.63), rel=1e-12) and "dynamic" in source


@pytest.mark.parametrize("name", STEP_PRESETS)
@pytest.mark.parametrize("schedule", ["retain", "reweight"])
def test_lean_schedules_run_every_recipe_as_hybrids(name, schedule):
    """Every published recipe takes several optimizer steps per rollout: a Lean schedule runs it as a hybrid
    (lean.schedules.hybrid). Under FlowGRPO's zero-advantage filter (SD3, Fast, Wan) the hybrid splits before it
    filters; FlowGRPO's own order, asked for explicitly, decides the first update after the rewards: refused, naming
    the key and the on-policy form."""
    recipe = load_config(None, [], preset=name)
    assert recipe.train.optimizer_steps_per_iteration > 1
    if schedule == "reweight" and recipe.model.full_finetune:  # MixGRPO: a whole-model gradient per trajectory
        with pytest.raises(ConfigError, match=r"parallel\.shard='fsdp'.*parallel\.grad_sync=per_update"):
            load_config(None, [f"train.schedule={schedule}"], preset=name)
        return
    assert load_config(None, [f"train.schedule={schedule}"], preset=name).train.optimizer_steps_per_iteration > 1
    if not recipe.algorithm.skip_zero_advantage:
        return
    filter_first = "algorithm.zero_advantage_order=filter_then_split"
    with pytest.raises(ConfigError, match="algorithm.zero_advantage_order") as err:
        load_config(None, [f"train.schedule={schedule}", filter_first], preset=name)
    assert "train.optimizer_steps_per_iteration=2" in str(err.value) and "train.on_policy=true" in str(err.value)


@pytest.mark.parametrize("name", STEP_PRESETS)
def test_the_on_policy_form_keeps_the_samples_and_steps_of_the_recipe(name):
    """``train.on_policy``: S optimizer steps per rollout become S rollouts of one step each, with the recipe's
    samples per step; the Lean schedules then run it, and ``auto`` chooses among the schedules that run a config
    exactly."""
    from lean.configure import validate
    from lean.schedules import BASELINE, runnable

    recipe = load_config(None, [], preset=name)
    t, steps = recipe.train, recipe.train.optimizer_steps_per_iteration
    # a sharded full fine-tune (MixGRPO) cannot hold Reweight's per-trajectory gradients
    every = ["recompute", "retain"] + ([] if recipe.model.full_finetune else ["reweight"])
    assert runnable(recipe) == every  # hybrids at S > 1
    filter_first = load_config(None, ["algorithm.zero_advantage_order=filter_then_split"], preset=name)
    assert runnable(filter_first) == ([BASELINE] if recipe.algorithm.skip_zero_advantage else every)
    form = load_config(None, ["train.on_policy=true", "train.schedule=auto"], preset=name)
    assert (
        form.train.optimizer_steps_per_iteration == 1
        and form.train.prompts_per_iteration * steps == t.prompts_per_iteration
    )
    assert form.train.iterations == t.iterations * steps
    per_step = t.prompts_per_iteration * t.group_size // steps
    assert form.train.prompts_per_iteration * form.train.group_size == per_step  # the samples of one optimizer step
    validate(form)  # validating again changes nothing
    assert form.train.prompts_per_iteration * steps == t.prompts_per_iteration
    assert runnable(form) == every  # Reweight keeps the KL gradients per trajectory where samples may be dropped


@pytest.mark.parametrize(
    "sets,words",
    [
        (["train.num_inner_epochs=2"], "train.num_inner_epochs=2 reuses its samples"),
        (["train.prompts_per_iteration=3"], "train.prompts_per_iteration=3 into train.optimizer_steps_per_iteration=2"),
        (["train.on_policy=maybe"], "must be true or false"),
    ],
)
def test_what_the_on_policy_form_cannot_run_is_one_config_line(sets, words):
    with pytest.raises(ConfigError, match="train.on_policy") as err:
        load_config(None, ["train.on_policy=true", *sets], preset="flowgrpo-flux")
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", STEP_PRESETS)
def test_recompute_runs_the_off_policy_recipe(name):
    """Two iterations as published: S optimizer steps per rollout, all but the first off-policy. In float64 an
    on-policy ratio is 1 to rounding (< 1e-15); here the later chunks are scored by a policy that has already moved.
    On 6 sampling steps, the fewest that FlowGRPO-Fast's window (3 steps from 0 to 2) allows: the recipes' 6 to 25
    change nothing of this and cost up to 4x the time. The Trainer samples on the preset's sigma grid."""
    from lean.train import Trainer

    cfg = tiny_preset(name, "model.dtype=float64", "sample.num_steps=6")
    trainer = Trainer(cfg)
    assert_preset_sigma_grid(trainer, name)
    start = [p.detach().clone() for p in trainer.params]
    rows = [trainer.iteration(it, "recompute").metrics for it in range(2)]
    assert trainer.state.steps == 2 * cfg.train.optimizer_steps_per_iteration
    assert all(math.isfinite(r["reward_mean"]) and math.isfinite(r["policy_loss"]) for r in rows)
    assert all(r["ratio_max_dev"] > 1e-8 for r in rows)
    assert any(not torch.equal(p, s) for p, s in zip(trainer.params, start))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", CLEAN_SAMPLE_PRESETS)
def test_clean_sample_recipes_train_and_refuse_the_lean_schedules_in_one_line(name):
    """Two iterations of the recipe under Recompute on the preset's sigma grid move the adapter; a Lean schedule is
    refused in one line."""
    from lean.train import Trainer

    trainer = Trainer(tiny_preset(name, "model.dtype=float64"))
    assert_preset_sigma_grid(trainer, name)
    start = [p.detach().clone() for p in trainer.params]
    rows = [trainer.iteration(it, "recompute").metrics for it in range(2)]
    assert all(math.isfinite(r["reward_mean"]) and math.isfinite(r["policy_loss"]) for r in rows)
    assert any(not torch.equal(p, s) for p, s in zip(trainer.params, start))
    with pytest.raises(ConfigError, match=r"train\.schedule='retain'.*re-noised") as err:
        load_config(None, ["train.schedule=retain"], preset=name)
    assert "\n" not in str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", STEP_PRESETS + IMAGE_MODEL_PRESETS)
def test_retain_and_reweight_are_exact_on_the_on_policy_variant(name):
    """float64: Retain's and Reweight's gradients equal Recompute's on the preset's own SDE, grid, guidance, CFG
    gradient path and step selection."""
    from lean.tools.equivalence import passes, run_equivalence

    cfg = on_policy(name, "model.dtype=float64")
    report = run_equivalence(cfg, reference=False)
    assert passes(report, cfg.model.torch_dtype), {s: report[s]["max_rel_grad_diff"] for s in ("retain", "reweight")}


@pytest.mark.timeout(180)
def test_cli_trains_the_preset_and_its_on_policy_variant(tmp_path, capsys):
    """`lean train --preset` runs the recipe under Recompute, refuses FlowGRPO's filter order under a Lean schedule in
    one message that names the on-policy form, and runs that form (1 prompt x 2 samples per rollout, 2 iterations).
    The README's quick run at 32 px, 2 samples per prompt and 4 steps: what the CLI does does not depend on them."""
    from lean.cli import main

    quick = [*QUICK, "model.resolution=32", "train.group_size=2", "sample.num_steps=4"]
    args = ["train", "--preset", "flowgrpo-sd3", *(a for kv in quick for a in ("--set", kv))]
    assert main([*args, "--out", str(tmp_path / "recompute")]) == 0
    refused = ["--set", "train.schedule=retain", "--set", "algorithm.zero_advantage_order=filter_then_split"]
    assert main([*args, *refused, "--out", str(tmp_path / "refused")]) == 2
    assert "algorithm.zero_advantage_order" in (err := capsys.readouterr().err) and "train.on_policy=true" in err
    on_policy = ["--set", "train.schedule=retain", "--set", "train.on_policy=true"]
    assert main([*args, *on_policy, "--out", str(tmp_path / "retain")]) == 0
    for run in ("recompute", "retain"):
        metrics = json.loads((tmp_path / run / "metrics.json").read_text())
        assert metrics["schedule"] == run and math.isfinite(metrics["final_reward_mean"])
        assert json.loads((tmp_path / run / "config.json").read_text())["model"]["family"] == "sd3"
    config = json.loads((tmp_path / "retain" / "config.json").read_text())["train"]  # quick: 2 prompts, 1 iteration
    assert (config["prompts_per_iteration"], config["iterations"], config["optimizer_steps_per_iteration"]) == (1, 2, 1)
    assert len(json.loads((tmp_path / "retain" / "metrics.json").read_text())["reward_mean"]) == 2


@pytest.mark.parametrize(
    "name,published",
    [
        ("flowgrpo-sd3", 2.243e9),
        ("flowgrpo-flux", 11.9e9),
        ("flowgrpo-wan", 1.42e9),
        ("flowgrpo-wan:model.size=full-14b", 14.29e9),  # Wan2.1-T2V-14B (LeanGRPO Fig. 3(f)): 14.3B as published
        ("flowgrpo-kontext", 11.9e9),
        ("flowgrpo-qwen-image", 20.43e9),
        ("flowgrpo-qwen-image-edit", 20.43e9),
        ("flowfactory-grpo-flux2", 32.22e9),
        ("flowfactory-grpo-flux2-klein", 9.08e9),
    ],
)
def test_plan_reports_the_published_size_without_building_it(name, published, tmp_path):
    from lean.plan.cost import main

    preset, _, size = name.partition(":")
    cfg = load_config(None, [size] if size else [], preset=preset)
    report = main(cfg, out=str(tmp_path))["published_size"]
    assert report["transformer_parameters"] == pytest.approx(published, rel=0.01)
    itemsize = 4 if cfg.model.dtype == "float32" else 2
    assert report["weight_mb"] == pytest.approx(report["transformer_parameters"] * itemsize / 2**20)
    assert 0 < report["trainable_parameters"] < 0.03 * report["transformer_parameters"]  # LoRA
    assert report["trainable_state_mb"] == pytest.approx(4 * report["trainable_parameters"] * 4 / 2**20)  # float32
    assert json.loads((tmp_path / "plan.json").read_text())["published_size"] == report


@pytest.mark.timeout(120)
def test_dancegrpo_first_update_ratio_is_exactly_one_in_bfloat16():
    """DanceGRPO rolls out and recomputes one sample per forward (the preset's micro-batches 1 and 1): the first
    update recomputes the rollout's own forward bit for bit in bfloat16, so its ratio is exactly 1; the second runs
    under moved weights."""
    from lean.train import Trainer

    recipe = load_config(None, [], preset="dancegrpo-flux")
    assert (recipe.train.rollout_batch_size, recipe.train.train_batch_size) == (1, 1)
    sets = [s for s in tiny_preset_sets("dancegrpo-flux") if "batch_size" not in s and "dtype" not in s]
    cfg = load_config(None, [*sets, "model.dtype=bfloat16"], preset="dancegrpo-flux")
    metrics = Trainer(cfg).iteration(0, "recompute").metrics
    assert metrics["ratio_max_dev_first_update"] == 0.0 and metrics["ratio_max_dev"] > 0.0
