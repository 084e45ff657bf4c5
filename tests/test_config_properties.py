"""Property: any config tree is either a valid RunConfig or a one-line ConfigError naming a key, never a deep error."""

import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lean.config import ConfigError, RunConfig
from lean.configure import load_config

KEYS = {
    "model": [
        "family",
        "size",
        "resolution",
        "num_frames",
        "dtype",
        "lora_rank",
        "lora_alpha",
        "lora_ffn",
        "full_finetune",
        "text_max_length",
        "pretrained",
        "famliy",
    ],
    "sample": [
        "num_steps",
        "shift",
        "sde_kind",
        "noise_level",
        "cfg",
        "guidance_scale",
        "guidance_embed",
        "uncond_grad",
        "timestep_fraction",
        "timestep_selection",
        "sde_window",
        "sde_window_max_start",
    ],
    "train": [
        "schedule",
        "iterations",
        "prompts_per_iteration",
        "group_size",
        "rollout_batch_size",
        "lr",
        "beta",
        "clip_range",
        "adv_clip_max",
        "optimizer_steps_per_iteration",
        "num_inner_epochs",
        "ema_decay",
        "memory_budget_mb",
        "on_nonfinite",
        "save_every",
        "prompts",
        "prompts_file",
        "dist_timeout_s",
    ],
    "optimizer": ["lr", "weight_decay", "adam_beta1", "adam_eps", "max_grad_norm"],
    "ema": ["enabled", "decay", "every", "unit", "warmup", "repeats"],
    "checkpoint": ["every", "keep"],
    "reward": ["weights"],
    "eval": ["every", "prompts", "prompts_file", "samples_per_prompt", "num_steps", "guidance_scale", "batch_size"],
    "rewrad": ["x"],
}

values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 40),
    st.floats(-2, 50),
    st.sampled_from([float("nan"), float("inf")]),
    st.sampled_from(
        [
            "flux",
            "wan",
            "sd3",
            "tiny",
            "small",
            "full",
            "float64",
            "bfloat16",
            "flow_grpo",
            "cps",
            "dance",
            "first",
            "random",
            "retain",
            "reweight",
            "auto",
            "skip",
            "abort",
            "recompute",
        ]
    ),
    st.text(string.ascii_letters, max_size=6),
    st.lists(st.text(string.ascii_lowercase + " ", max_size=12), max_size=3),
    st.dictionaries(st.sampled_from(["color_match", "jpeg_compressibility", "nope"]), st.floats(-1, 2), max_size=2),
)

trees = st.dictionaries(
    st.sampled_from(list(KEYS)),
    st.one_of(st.integers(), st.dictionaries(st.sampled_from(sum(KEYS.values(), [])), values, max_size=4)),
    max_size=4,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_any_tree_is_a_config_or_a_one_line_error(tree):
    try:
        cfg = load_config(tree=tree)
    except ConfigError as err:
        msg = str(err)
        assert "\n" not in msg and msg.startswith("config error: ") and err.key
        return
    assert isinstance(cfg, RunConfig)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["model", "sample", "train", "trian"]),
            st.sampled_from(sum(KEYS.values(), [])),
            st.text(string.ascii_letters + string.digits + ".-[]{}:, ", max_size=10),
        ),
        max_size=4,
    )
)
def test_any_override_string_is_a_config_or_a_one_line_error(items):
    try:
        load_config(None, [f"{sec}.{key}={val}" for sec, key, val in items])
    except ConfigError as err:
        assert "\n" not in str(err)
