"""Pref-GRPO (CodeGoat24/Pref-GRPO at 3e787f6): UnifiedReward-Think's pairwise verdicts read as
fastvideo/rewards/unifiedreward_think.py:16-62 reads them, its GDPO advantages (fastvideo/rewards/dispatcher.py:614-703)
written here in float64, the prefgrpo-flux preset cited and planned. One iteration trained against a tiny local
pairwise judge (the random Qwen2-VL folder tests/test_vlm_judge.py serves): that file's
test_lean_train_trains_against_a_tiny_local_pairwise_judge."""

from __future__ import annotations

import itertools
import re
from collections import defaultdict

import pytest
import torch
from helpers import preset_value_lines, tiny, uncited

from lean.algorithms import build_algorithm
from lean.config import ConfigError
from lean.configure import load_config
from lean.rewards.groupwise import group_pairs, win_rates
from lean.rewards.judge_templates import PAIRWISE_TEMPLATES, parse_verdict


def source_win_rate(num_items: int, outputs: dict[tuple[int, int], str]) -> list[float]:
    """unifiedreward_think.py:16-62 (_extract_answer, _pairwise_win_rate) in float64, without :56's rounding."""
    wins, count = defaultdict(float), defaultdict(int)
    for (i, j), output in outputs.items():
        count[i] += 1
        count[j] += 1
        match = re.search(r"<answer>(.*?)</answer>", output, re.DOTALL)
        final = match.group(1).strip() if match else None
        if final and "Image 1 is better" in final:
            wins[i] += 1
        elif final and "Image 2 is better" in final:
            wins[j] += 1
        else:
            wins[i] += 0.5
            wins[j] += 0.5
    return [wins[k] / count[k] if count[k] else 0.0 for k in range(num_items)]


def test_verdicts_and_win_rates_are_the_sources():
    answers = [
        "<think>...</think>\n<answer>Image 1 is better</answer>",
        "<think>1 vs 2</think><answer> Image 2 is better </answer>",
        "<answer>both are good</answer>",  # neither: a tie
        "Image 1 is better",  # no answer tag: a tie
        "<answer>\nImage 2 is better\n</answer>",  # the tag across lines (re.DOTALL)
        "<think>Image 1 is better</think><answer>Image 2 is better</answer>",
    ]
    template = PAIRWISE_TEMPLATES["unifiedreward_think"]
    assert [parse_verdict(a, template) for a in answers] == [1.0, 0.0, 0.5, 0.5, 0.0, 0.0]
    assert "{prompt}" in template.text and template.text.count("{") == 1  # str.format's one field, as dispatcher:420
    pairs = group_pairs(4)
    assert [tuple(p) for p in pairs.tolist()] == list(itertools.combinations(range(4), 2))  # think:84
    outputs = dict(zip(map(tuple, pairs.tolist()), answers))
    preferred = torch.tensor([parse_verdict(a, template) for a in answers], dtype=torch.float64)
    got = win_rates(preferred, pairs, 4, "verdict")
    torch.testing.assert_close(got, torch.tensor(source_win_rate(4, outputs), dtype=torch.float64))


def test_pref_gdpo_is_the_dispatchers_advantage():
    """dispatcher.py:628-702: per reward (r - mean_g) / (std_g + 1e-8), weighted 0.4 / 0.6 and summed, then
    (c - mean) / (std + 1e-8) over the batch; torch's unbiased std throughout; clamped at 5 in the loss."""
    cfg = tiny("algorithm.reward_combination=pref_gdpo", "reward.weights={color_match: 0.4, position_match: 0.6}")
    g = torch.Generator().manual_seed(0)
    components = torch.rand(12, 2, generator=g, dtype=torch.float64)
    groups = torch.arange(12) // 4
    got = build_algorithm(cfg, None).targets(
        components @ torch.tensor([0.4, 0.6], dtype=torch.float64), groups, components
    )
    combined = torch.zeros(12, dtype=torch.float64)
    for k, weight in enumerate((0.4, 0.6)):
        r = components[:, k].view(3, 4)
        combined += weight * ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-8)).flatten()
    want = ((combined - combined.mean()) / (combined.std() + 1e-8)).clamp(-5, 5)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    with pytest.raises(ConfigError, match=r"algorithm\.global_std"):
        tiny("algorithm.reward_combination=pref_gdpo", "algorithm.global_std=true")


def test_a_chat_judge_names_its_endpoint_in_one_line():
    sets = ["reward.weights={win_rate: 1.0}", "reward.win_rate.judge=unifiedreward_think"]
    with pytest.raises(ConfigError, match=r"reward\.win_rate\.judge_endpoint=None: name the reward\.judges entry"):
        tiny(*sets)


@pytest.mark.timeout(120)
def test_the_preset_cites_every_value_is_the_published_recipe_and_plans(tmp_path):
    values = preset_value_lines("prefgrpo-flux")
    assert len(values) >= 50
    assert not uncited(values, "sde_window_max_start: null")
    cfg = load_config(None, [], preset="prefgrpo-flux")
    published = {  # scripts/full_train/ur_think_prefgrpo_flux.sh and scripts/_common_finetune.sh at 3e787f6
        ("model", "family"): "flux",
        ("model", "resolution"): 720,
        ("model", "full_finetune"): True,
        ("sample", "num_steps"): 25,
        ("sample", "noise_level"): 0.7,
        ("sample", "shift"): 3.0,
        ("sample", "timestep_fraction"): 0.6,
        ("sample", "init_same_noise"): True,
        ("algorithm", "name"): "grpo_guard",
        ("algorithm", "reward_combination"): "pref_gdpo",
        ("algorithm", "clip_range"): 1e-4,
        ("algorithm", "beta"): 0.0,
        ("train", "group_size"): 8,
        ("train", "prompts_per_iteration"): 64,
        ("train", "optimizer_steps_per_iteration"): 2,
        ("optimizer", "lr"): 1e-5,
    }
    for (section, key), value in published.items():
        assert getattr(getattr(cfg, section), key) == value, (section, key)
    assert cfg.reward.weights == {"win_rate": 0.4, "clip_score": 0.6}
    assert (cfg.reward.win_rate.judge, cfg.reward.win_rate.judge_endpoint) == ("unifiedreward_think",) * 2
    endpoint = cfg.reward.judges["unifiedreward_think"]
    assert (endpoint.base_url, endpoint.model, endpoint.max_tokens) == ("http://localhost:8080", "UnifiedReward", 4096)
    from lean.plan.cost import main as plan

    # the published size, counted on the meta device (the rows on GPUs: tests/test_layout.py's published recipes)
    report = plan(cfg, out=str(tmp_path))
    assert report["published_size"]["transformer_parameters"] == pytest.approx(11.9e9, rel=0.01)
