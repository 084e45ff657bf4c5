"""Every preset resolves to the configuration it resolved to before the restructuring of issue #45 (and params.yaml
too): ``tests/data/resolved_configs.json`` holds each one's ``RunConfig.to_dict()`` as written before the move. A key
that moved since (``lean.config.MOVED``) is compared at its new place; nothing else changes but the deliberate
changes listed below, each with its reason."""

import json
from pathlib import Path

import pytest

from lean.config import MOVED
from lean.config.presets import PRESETS
from lean.config.sections import OPTIONS
from lean.configure import load_config

ROOT = Path(__file__).resolve().parents[1]
RESOLVED = json.loads((ROOT / "tests" / "data" / "resolved_configs.json").read_text())

# Deliberate changes since the record, each with its reason (issue #41: every preset made its source's run). ADDED_*:
# a key a section gained, "section.key" -> its default (every config has it, at that value unless CHANGED_* says
# otherwise). CHANGED_*: (config name, "section.key") -> (value before, value now). One pair of tables per area.
# FLUX.2 editing: reference images. model.edit (None: as the family and the prompts say, today's behaviour) and
# model.reference_resolution (None: the family's own side, today's); Flow-Factory's klein example edits
# (default.yaml:10, every row of sharegpt4o_image_mini has an "image"; condition_image_size 384, default.yaml:52), so
# its preset edits, without a prompt file lean's bundled recolouring set (as the Kontext presets)
ADDED_EDITING: dict[str, object] = {"model.edit": None, "model.reference_resolution": None}
_KLEIN = "flowfactory-grpo-flux2-klein"
_BUNDLED_EDITS = [
    {"prompt": p, "image": f"lean/data/edits/images/{k}.png"}
    for k, p in enumerate(
        [
            "a red circle on a white background",
            "a green square on a black background",
            "a blue triangle on a magenta background",
            "a yellow circle on a cyan background",
            "a white square on a red background",
            "a black triangle on a green background",
            "a magenta circle on a blue background",
            "a cyan square on a yellow background",
        ]
    )
]
CHANGED_EDITING: dict[tuple[str, str], tuple[object, object]] = {
    (_KLEIN, "model.edit"): (None, True),
    (_KLEIN, "model.reference_resolution"): (None, 384),
    (_KLEIN, "train.prompts_file"): (None, "lean/data/edits/train_metadata.jsonl"),
    (_KLEIN, "train.prompts"): (RESOLVED["params.yaml"]["train"]["prompts"], _BUNDLED_EDITS),
}

ADDED_ADVANTAGES: dict[str, object] = {  # how rewards become advantages; the SDE window's start; filters
    "algorithm.reward_combination": "sum",  # the weighted sum normalised, as before; per_reward / gdpo for presets
    "sample.sde_window_start": None,  # drawn at every iteration, as before; fixed for Qwen-Image's re-seeded draw
    "sample.sde_window_min_start": 0,  # drawn from step 0, as before; 1 for Flow-Factory's sde_steps lists
}
CHANGED_ADVANTAGES: dict[tuple[str, str], tuple[object, object]] = {
    # MixGRPO: multi_reward_mix="advantage_aggr" (finetune_flux_grpo_MixGRPO{,_Flash}.sh:62, train_grpo_flux.py:429-456)
    ("mixgrpo-flux", "algorithm.reward_combination"): ("sum", "per_reward"),
    ("mixgrpo-flash-flux", "algorithm.reward_combination"): ("sum", "per_reward"),
    # Flow-Factory: advantage_aggregation 'gdpo' in each example (advantage_processor.py:451-470 at a0b2bc5)
    ("flowfactory-grpo-flux2", "algorithm.reward_combination"): ("sum", "gdpo"),
    ("flowfactory-grpo-flux2-klein", "algorithm.reward_combination"): ("sum", "gdpo"),
    ("flowfactory-grpo-wan22", "algorithm.reward_combination"): ("sum", "gdpo"),
    # qwenimage_pipeline_with_logprob.py:138-141 re-seeds with process_index 0: randint(0, 3) = 3 at every rollout
    ("flowgrpo-qwen-image", "sample.sde_window_start"): (None, 3),
    # train_flux_kontext.py:765-786 drops the zero-advantage samples, as train_sd3.py:801-822
    ("flowgrpo-kontext", "algorithm.skip_zero_advantage"): (False, True),
    # train_qwenimage.py:466-467 casts the text encoder to fp32: prompt_embeds and so x_0..x_N are float32
    ("flowgrpo-qwen-image", "sample.latent_dtype"): ("model", "float32"),
    # train_qwenimage_edit.py:472-473 likewise: the fp32 text encoder's embeddings set x_0's dtype (logprob.py:96-106)
    ("flowgrpo-qwen-image-edit", "sample.latent_dtype"): ("model", "float32"),
    # Flow-Factory's sde_steps start at 1 (t2i.yaml:91, default.yaml:92, t2v.yaml:98 at a0b2bc5): never step 0
    ("flowfactory-grpo-flux2", "sample.sde_window_min_start"): (0, 1),
    ("flowfactory-grpo-flux2-klein", "sample.sde_window_min_start"): (0, 1),
    ("flowfactory-grpo-wan22", "sample.sde_window_min_start"): (0, 1),
}

ADDED_FLOWFACTORY: dict[str, object] = {  # Flow-Factory's EMA schedule, LoRA init, trajectory dtype; documentation
    "ema.unit": "optimizer_step",  # what ema.every counts: optimizer steps as before, or iterations (Flow-Factory)
}
# Flow-Factory at a0b2bc5: every LoRA gaussian (models/abc.py:899-904, :929-935); trajectories stored in fp16
# (hparams/training_args.py:245-252, now expressible under bf16); the EMA's warm-up decay min(0.9, (1 + t) / (10 + t))
# with t the epoch, every 4 epochs (ema/ema_utils.py:38-52, trainers/grpo.py:87-91): one epoch is one iteration.
_FLOWFACTORY_FLUX2 = {
    "model.lora_init": ("kaiming", "gaussian"),
    "sample.latent_dtype": ("model", "float16"),
    "ema.unit": ("optimizer_step", "iteration"),
    "ema.warmup": (False, True),
}
CHANGED_FLOWFACTORY: dict[tuple[str, str], tuple[object, object]] = {
    **{("flowfactory-grpo-flux2", key): values for key, values in _FLOWFACTORY_FLUX2.items()},
    **{("flowfactory-grpo-flux2-klein", key): values for key, values in _FLOWFACTORY_FLUX2.items()},
    ("flowfactory-grpo-wan22", "sample.latent_dtype"): ("float32", "float16"),  # was float16 widened to float32
    ("flowfactory-grpo-wan22", "ema.every"): (8, 4),  # 4 iterations, was its 8 optimizer steps
    ("flowfactory-grpo-wan22", "ema.unit"): ("optimizer_step", "iteration"),
}

ADDED_RETAIN: dict[str, object] = {  # issue #42: what Retain keeps and where (lean/schedules/retain.py)
    "train.retain.steps": "all",
    "train.retain.offload": "device",
    "train.retain.host_memory_budget_mb": None,
    "train.retain.host_link_gb_s": None,
    "train.retain.backward": "unit",  # issue #57: one backward per kept graph in Recompute's order (App. E)
}
# issue #43: tree rollouts (lean/sampling/tree.py); no branch point is the flat rollout
ADDED_TREE: dict[str, object] = {
    "sample.tree.branch_points": [],
    "sample.tree.branching": 2,
    "sample.tree.branch_noise_scale": 1.0,
}
# Flow-DPPO (issue #43, lean/algorithms/flow_dppo.py): its trust-region threshold, read only under
# algorithm.name=flow_dppo (UniRL flowdppo.py:32 at 1a7b501: 1e-5). Issue #58: the precision of the means in its KL
# (compute: the step's own, as before; the preset's bfloat16 is UniRL's, diffusion.py:496), and k SDE steps drawn
# from the window (0: the whole window, as before; the preset's 3 of 0..4 is UniRL's, scheduler_utils.py:118-124)
ADDED_DPPO: dict[str, object] = {
    "algorithm.flow_dppo.kl_threshold": 1e-5,
    "algorithm.flow_dppo.trust_region_means_dtype": "compute",
    "sample.sde_steps_drawn": 0,
}
CHANGED_DPPO: dict[tuple[str, str], tuple[object, object]] = {}
# AWM (issue #43, lean/algorithms/awm.py): its keys, read only under algorithm.name=awm; defaults are the PickScore
# config's (scxue/advantage_weighted_matching at 12b1397, config/dgx_awm.py:333-346, :367)
ADDED_AWM: dict[str, object] = {
    "algorithm.awm.draws": 6,
    "algorithm.awm.time_draw": "discrete",
    "algorithm.awm.weighting": "ghuber",
    "algorithm.awm.ghuber_power": 0.25,
    "algorithm.awm.advantage_max": 1.0,
    "algorithm.awm.beta": 1e-4,
    "algorithm.awm.ema_beta": 1.0,
    "algorithm.awm.ema_decay": 0.3,
    "algorithm.awm.ema_decay_kind": "linear",
}
CHANGED_AWM: dict[tuple[str, str], tuple[object, object]] = {}
# BranchGRPO's pruning of the gradient (issue #43): the tree's depth pruning (lean/sampling/tree.py) and its width
# pruning (lean/algorithms/branch_grpo.py), all off as before (the tree script's defaults, train_branchgrpo_flux.py
# :2101-2109 at 19fbb9f: no depth, mode 0, ratio 0.5, pruning_step_ratio 1.0); issue #58: a tree's updates as chunks
# of its edges (lean/schedules/edge_updates.py), off (one update per tree rollout) but in branchgrpo-flux
ADDED_BRANCH: dict[str, object] = {
    "train.edges_per_update": None,
    "sample.tree.depth_pruning": [],
    "sample.tree.depth_pruning_slide_interval": None,
    "sample.tree.depth_pruning_stop_depth": None,
    "algorithm.branch_grpo.width_pruning": "none",
    "algorithm.branch_grpo.width_pruning_ratio": 0.5,
    "algorithm.branch_grpo.pruning_until": 1.0,
}
CHANGED_BRANCH: dict[tuple[str, str], tuple[object, object]] = {}
# Flash-GRPO (issue #43, lean/algorithms/flash_grpo.py): the steps its one SDE step is drawn from, read only under
# algorithm.name=flash_grpo (Shredded-Pork/Flash-GRPO at 8cfc973, train_wanx2_1_flash.py:697: the first 10)
ADDED_FLASH: dict[str, object] = {"algorithm.flash_grpo.steps": 10}
CHANGED_FLASH: dict[tuple[str, str], tuple[object, object]] = {}
# FlowGRPO's pickle reward servers (issue #44, lean/rewards/pickle_servers.py): none configured, as before
ADDED_RSERV: dict[str, object] = {"reward.pickle_servers": {}}
CHANGED_RSERV: dict[tuple[str, str], tuple[object, object]] = {}
# VLM judges over the OpenAI chat API (issue #44, lean/rewards/vlm_judge.py): none named, as before
ADDED_VLM: dict[str, object] = {"reward.judges": {}}
CHANGED_VLM: dict[tuple[str, str], tuple[object, object]] = {}
# Group-wise rewards (issue #44, lean/rewards/groupwise.py): Pref-GRPO's win rate's judge and credit, read only when
# reward.weights names win_rate (no preset does): the Bradley-Terry judge, no reward named, Pref-GRPO's count of wins
ADDED_GROUPWISE: dict[str, object] = {
    "reward.win_rate.judge": "bradley_terry",
    "reward.win_rate.judge_reward": None,
    "reward.win_rate.temperature": 1.0,
    "reward.win_rate.credit": "verdict",
    # issue #58: the reward.judges entry a chat judge asks (Pref-GRPO's unifiedreward_think; None: no chat judge)
    "reward.win_rate.judge_endpoint": None,
}
CHANGED_GROUPWISE: dict[tuple[str, str], tuple[object, object]] = {}
# GARDO (issue #43, lean/algorithms/gardo.py): its keys, read only under algorithm.name=gardo; defaults are the source's
# (yifan123/flow_grpo at 94e23ee: config/grpo_gardo.py:22, :29, :79; scripts/train_sd3_gardo.py:219-237, :826); and the
# diversity reward's feature space (lean/rewards/diversity.py), read only when reward.weights names diversity
ADDED_GARDO: dict[str, object] = {
    "algorithm.gardo.main_reward": "ocr",
    "algorithm.gardo.gate_rewards": ["aesthetic", "imagereward"],
    "algorithm.gardo.diversity_reward": "diversity",
    "algorithm.gardo.kl_threshold": 3e-4,
    "algorithm.gardo.reset_every": 15,
    "algorithm.gardo.gate_fraction": 0.1,
    "algorithm.gardo.gate_step": 0.1,
    "algorithm.gardo.gate_min": 0.02,
    "algorithm.gardo.gate_max": 0.2,
    "algorithm.gardo.gate_window": 20,
    "reward.diversity.features": "pixels",
}
CHANGED_GARDO: dict[tuple[str, str], tuple[object, object]] = {}
# issue #55: evaluation's pictures apart from its curve, and the peak-memory measurement when due; both as before by
# default (every evaluation writes its pictures, every iteration measures)
ADDED_WORKBENCH: dict[str, object] = {"eval.images_every": None, "train.memory_every": 1}
# issue #56: when the gradients cross processes (lean/parallel/grad_sync.py; auto is what ran before the key) and
# hsdp's replicas (None: the launch's nodes)
ADDED_SYNC: dict[str, object] = {"parallel.grad_sync": "auto", "parallel.replicas": None}
# issue #59: the evaluation's own geometry (lean/evaluation.py: eval_runtime); None: the training's, as before
ADDED_EVAL_GEOMETRY: dict[str, object] = {"eval.resolution": None, "eval.num_frames": None}
# E-GRPO (issue #58, lean/algorithms/e_grpo.py): its SDE steps, read only under algorithm.name=e_grpo
# (shengjun-zhang/VisualGRPO at ae619bf, scripts/finetune/train_grpo_merge.sh:25: eta_step_list=[1,2,3])
ADDED_E_GRPO: dict[str, object] = {"algorithm.e_grpo.steps": [1, 2, 3]}
# Presets added since the record, which has no "before" for them (their values: tests/test_presets.py's)
ADDED_PRESETS = {
    "unirl-flow-dppo-sd3",  # UniRL's Flow-DPPO recipe (sd3_flowdppo.yaml at 1a7b501)
    "awm-sd3",  # AWM's PickScore recipe (dgx_awm.py pickscore_sd3_no_cfg_1node at 12b1397)
    "flowfactory-grpo-ltx2",  # issue #59: Flow-Factory's LTX-2.3 LoRA recipe (PR #145, tests/test_ltx2.py)
    "branchgrpo-flux",  # BranchGRPO's recipe (finetune_flux_branchgrpo_8gpus.sh at 19fbb9f)
    "flashgrpo-wan",  # Flash-GRPO's recipe (config/dgx.py:wan2_1_flash at 8cfc973)
    "tempflowgrpo-sd3",  # TempFlow-GRPO's PickScore recipe (config/dgx.py:pickscore_sd3_pr at 63e4def)
    "flowgrpo-ocr-sd3",  # issue #44: FlowGRPO's OCR task (config/grpo.py:general_ocr_sd3 at ac4c86e), reward ocr
    "gardo-sd3",  # GARDO's OCR recipe (config/grpo_gardo.py:general_ocr_sd3 at 94e23ee; tests/test_gardo.py)
    "flowfactory-grpo-z-image",  # issue #59: Flow-Factory's Z-Image-Turbo LoRA recipe (tests/test_z_image.py)
    "egrpo-flux",  # issue #58: E-GRPO's recipe (train_grpo_merge.sh at ae619bf; tests/test_e_grpo.py)
    "prefgrpo-flux",  # issue #58: Pref-GRPO's recipe (ur_think_prefgrpo_flux.sh at 3e787f6; tests/test_prefgrpo.py)
    "flowfactory-grpo-wan21-i2v",  # issue #59: Flow-Factory's Wan2.1-I2V LoRA recipe (tests/test_wan_i2v.py)
    "flowfactory-grpo-wan22-i2v",  # issue #59: Flow-Factory's Wan2.2-I2V-A14B LoRA recipe (tests/test_wan_i2v.py)
    "treegrpo-sd3",  # issue #58: TreeGRPO's README run (zh-ding/TreeGRPO; tests/test_tree_grpo.py)
}

ADDED = {
    **ADDED_EDITING,
    **ADDED_ADVANTAGES,
    **ADDED_FLOWFACTORY,
    **ADDED_RETAIN,
    **ADDED_TREE,
    **ADDED_DPPO,
    **ADDED_AWM,
    **ADDED_BRANCH,
    **ADDED_FLASH,
    **ADDED_RSERV,
    **ADDED_VLM,
    **ADDED_GROUPWISE,
    **ADDED_GARDO,
    **ADDED_WORKBENCH,
    **ADDED_SYNC,
    **ADDED_EVAL_GEOMETRY,
    **ADDED_E_GRPO,
}
CHANGED = {
    **CHANGED_EDITING,
    **CHANGED_ADVANTAGES,
    **CHANGED_FLOWFACTORY,
    **CHANGED_DPPO,
    **CHANGED_AWM,
    **CHANGED_BRANCH,
    **CHANGED_FLASH,
    **CHANGED_RSERV,
    **CHANGED_VLM,
    **CHANGED_GROUPWISE,
    **CHANGED_GARDO,
}
RECORDED = [name for name in PRESETS if name not in ADDED_PRESETS]


def resolved(name: str) -> dict:
    """The resolved config of a preset (or of params.yaml alone) as JSON: an edit prompt keeps its image, as a path
    from the repository's root (the record compares across clones)."""
    preset = None if name == "params.yaml" else name

    def plain(value):
        if isinstance(value, dict):
            return {key: plain(v) for key, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        if getattr(value, "image", None) is not None:
            return {"prompt": str(value), "image": str(Path(value.image).resolve().relative_to(ROOT))}
        if isinstance(value, str) and value.startswith(f"{ROOT}/"):  # a path inside the checkout
            return str(Path(value).relative_to(ROOT))
        return value

    return plain(load_config(ROOT / "params.yaml", preset=preset).to_dict())


def flatten(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}} -> {"a.b": 1}``, down to the keys of the sections' dataclasses (mappings such as
    ``reward.weights`` stay whole below their own key)."""
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted.count(".") < 1:
            flat.update(flatten(value, f"{dotted}."))
        elif isinstance(value, dict) and dotted in OPTIONS:  # a registered group (algorithm.mixgrpo, ...)
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def moved(flat: dict) -> dict:
    """The keys of a config written before a move, at their new places (each its own: none lost to another's)."""
    at_new_places = {MOVED.get(key, key): value for key, value in flat.items()}
    assert len(at_new_places) == len(flat), "two keys moved to one place"
    return at_new_places


def test_every_preset_is_in_the_record():
    assert set(RESOLVED) == {"params.yaml", *RECORDED}


@pytest.mark.parametrize("name", ["params.yaml", *RECORDED])
def test_the_resolved_config_is_unchanged(name):
    now = flatten(resolved(name))
    before = {**moved(flatten(RESOLVED[name])), **ADDED}
    assert now.keys() == before.keys(), (sorted(now.keys() - before.keys()), sorted(before.keys() - now.keys()))
    changed = {k: (before[k], now[k]) for k in now if now[k] != before[k]}
    intended = {key: values for (config, key), values in CHANGED.items() if config == name}
    assert changed == intended
