"""E-GRPO (lean/algorithms/e_grpo.py): its step entropy is the source's Gaussian (written here in float64 from
shengjun-zhang/VisualGRPO at ae619bf, fastvideo/workers/sampler/flux_sampler.py:162-191, merged steps included), one
listed SDE step per rollout in turn, its schedules certified, its preset cited. One iteration of every schedule that
is exact on flux, sd3 and wan: tests/test_algorithms.py (its OWN_ROLLOUT line)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import preset_value_lines, reference_gap, tiny, uncited

from lean.algorithms import build_algorithm
from lean.algorithms.e_grpo import EGRPO, step_entropy
from lean.config import ConfigError
from lean.configure import load_config
from lean.run.iteration import local_batch
from lean.sampling.sde import Sde, sde_step_with_logprob, sigma_schedule
from lean.tools.equivalence import run_equivalence

E_GRPO = ["algorithm.name=e_grpo", "algorithm.e_grpo.steps=[1,2]"]  # FAST's 4 steps train steps 0-2


def source_grid(num_steps: int = 16, shift: float = 3.0) -> torch.Tensor:
    """flux_sampler.py:127-131 in float64: sd3_time_shift(shift, linspace(1, 0, N + 1))."""
    t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
    return shift * t / (1 + (shift - 1) * t)


def source_std(sigmas: torch.Tensor, index: int, eta: float, merge: int) -> torch.Tensor:
    """flux_sampler.py:163-170 and :184: the std of the SDE step from sigmas[index] to sigmas[index + merge_step]."""
    sigma, sigma_prev, sigma_max = sigmas[index], sigmas[index + merge], sigmas[1]
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    return std_dev_t * torch.sqrt(-1 * dt)


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_the_step_entropy_is_the_sources_gaussian(merge):
    sigmas = source_grid()
    got = step_entropy(Sde("flow_grpo", 0.7, sigmas), merge)
    want = torch.stack(
        [0.5 * torch.log(2 * math.pi * math.e * source_std(sigmas, i, 0.7, merge) ** 2) for i in range(17 - merge)]
    )
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    # merging m intervals into one step adds 1/2 log((sigma_i - sigma_{i+m}) / (sigma_i - sigma_{i+1}))
    gain = 0.5 * torch.log((sigmas[: 17 - merge] - sigmas[merge:]) / (sigmas[: 17 - merge] - sigmas[1 : 18 - merge]))
    torch.testing.assert_close(got - step_entropy(Sde("flow_grpo", 0.7, sigmas))[: 17 - merge], gain)


def test_the_listed_steps_are_the_high_entropy_ones_and_the_entropy_is_the_samplers():
    sigmas = source_grid()
    entropy = step_entropy(Sde("flow_grpo", 0.7, sigmas))
    assert (entropy[1:].diff() < 0).all()  # after step 0 (its noise scale read at sigmas[1]) it falls
    assert set(entropy.argsort(descending=True)[:4].tolist()) == {0, 1, 2, 3}  # the script's [1, 2, 3] among them
    # the entropy is E[-log p] of the sampler's own step (log p averaged over the latent's elements)
    x = torch.zeros(1, 200_000, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    _, log_p, _, _ = sde_step_with_logprob(Sde("flow_grpo", 0.7, sigmas), torch.zeros_like(x), x, 2, generator=g)
    assert float(-log_p) == pytest.approx(float(entropy[2]), abs=5e-3)


def test_each_rollout_trains_the_listed_steps_in_turn():
    cfg = tiny(*E_GRPO, "sample.num_steps=8", "algorithm.e_grpo.steps=[1,2,3]")
    for iteration in range(7):
        selection = EGRPO.steps(cfg, iteration, 5)
        (step,) = selection.stochastic.nonzero().flatten().tolist()  # one SDE step, every other an ODE step
        assert step == [1, 2, 3][iteration % 3]
        assert selection.trained.sum() == 5 and selection.trained[:, step].all()
    batch = local_batch(cfg, iteration=4)  # the iteration rolls out the algorithm's step
    assert batch.steps.stochastic.nonzero().flatten().tolist() == [2]


def test_its_targets_are_the_groups_unbiased_advantages():
    """buffer:115-124: (r - mean_g) / (torch's std_g + 1e-8) within the samples sharing a prompt and a step."""
    cfg = tiny(*E_GRPO, "algorithm.adv_std=unbiased", "algorithm.adv_eps=1e-8", "algorithm.adv_clip_max=5")
    rewards = torch.tensor([0.3, 0.9, 0.4, 0.1, 0.2, 0.6], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    got = build_algorithm(cfg, None).targets(rewards, groups)
    want = torch.cat([(r - r.mean()) / (r.std() + 1e-8) for r in rewards.view(2, 3)])
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


@pytest.mark.timeout(180)
def test_in_float64_retain_and_reweight_are_recompute_and_the_reference():
    cfg = tiny(*E_GRPO, "model.dtype=float64", "sample.init_same_noise=true")
    report = run_equivalence(cfg)
    assert set(report["reference"]) == {"recompute", "retain", "reweight"}
    for schedule in ("retain", "reweight"):
        assert report[schedule]["max_rel_grad_diff"] < 1e-10, (schedule, report[schedule])
    assert reference_gap(report) < 1e-10


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (["sample.sde_window=1"], r"sample\.sde_window"),
        (["algorithm.e_grpo.steps=[1,3]"], r"algorithm\.e_grpo\.steps.*num_steps - 2 = 2"),
        (["algorithm.e_grpo.steps=[]"], r"algorithm\.e_grpo\.steps"),
        (["algorithm.e_grpo.steps=[-1]"], r"algorithm\.e_grpo\.steps"),
    ],
)
def test_what_it_cannot_run_is_one_config_line(sets, key):
    with pytest.raises(ConfigError, match=key) as err:
        tiny(*E_GRPO, *sets)
    assert "\n" not in str(err.value)


def test_steps_past_the_grid_are_refused_with_a_fix_that_runs():
    for steps, fix in (("[1,2,3]", "algorithm.e_grpo.steps=[1,2]"), ("[5]", "sample.num_steps=7")):
        with pytest.raises(ConfigError) as err:
            tiny(*E_GRPO, f"algorithm.e_grpo.steps={steps}")
        assert err.value.fix == [fix]
        tiny(*E_GRPO, f"algorithm.e_grpo.steps={steps}", fix)


@pytest.mark.timeout(120)
def test_the_preset_cites_every_value_is_the_published_recipe_and_plans(tmp_path):
    values = preset_value_lines("egrpo-flux")
    assert len(values) >= 40
    assert not uncited(values, "sde_window_max_start: null")
    cfg = load_config(None, [], preset="egrpo-flux")
    published = {  # config.yaml, grpo_merge.yaml and train_grpo_merge.sh at ae619bf
        ("model", "family"): "flux",
        ("model", "resolution"): 720,
        ("model", "full_finetune"): True,
        ("sample", "num_steps"): 16,
        ("sample", "shift"): 3.0,
        ("sample", "noise_level"): 0.7,
        ("sample", "guidance_embed"): 3.5,
        ("sample", "init_same_noise"): True,
        ("algorithm", "name"): "e_grpo",
        ("algorithm", "clip_range"): 1e-4,
        ("algorithm", "adv_clip_max"): 5.0,
        ("algorithm", "beta"): 0.0,
        ("train", "group_size"): 12,
        ("train", "prompts_per_iteration"): 8,
        ("optimizer", "lr"): 1e-5,
        ("optimizer", "max_grad_norm"): 1.0,
    }
    for (section, key), value in published.items():
        assert getattr(getattr(cfg, section), key) == value, (section, key)
    assert cfg.algorithm.e_grpo.steps == [1, 2, 3]
    sigmas = sigma_schedule(16, 3.0, cfg.sample.sigma_grid)
    torch.testing.assert_close(sigmas, source_grid(), rtol=1e-6, atol=1e-7)  # lean's grid is the sampler's
    from lean.plan.cost import main as plan

    # the published size, counted on the meta device (the rows on GPUs: tests/test_layout.py's published recipes)
    report = plan(cfg, out=str(tmp_path))
    assert report["published_size"]["transformer_parameters"] == pytest.approx(11.9e9, rel=0.01)
