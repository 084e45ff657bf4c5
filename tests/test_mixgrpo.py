"""MixGRPO (lean/algorithms/mixgrpo.py): the window slides as Tencent-Hunyuan/MixGRPO's GRPOTrainingStates moves it,
the Flash tail runs DPM-Solver++(2M) on the compressed grid of its sampling_utils, and the solver is second order."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny

from lean.algorithms.mixgrpo import MixGRPO, window_start
from lean.config import ConfigError
from lean.run.iteration import local_batch
from lean.sampling.rollout import RolloutHooks, RolloutPlan, Sampler, rollout
from lean.sampling.sde import dpm_solver_pp_step, ode_step, rollout_sigmas, sigma_schedule, tail_sigmas

MIX = ["algorithm.name=mixgrpo"]


def published_windows(iterations: int, num_steps: int, group: int, every: int, stride: int) -> list[list[int]]:
    """The source's progressive states, transcribed: cur moves by ``stride`` every ``every`` iterations and rolls
    back past max_timesteps = N - 2; each iteration trains range(cur, min(cur + group, N - 2)) (grpo_states.py)."""
    cur, in_group, windows = 0, 0, []
    for _ in range(iterations):
        windows.append(list(range(cur, min(cur + group, num_steps - 2))))
        in_group += 1
        if in_group >= every:
            in_group, cur = 0, cur + stride
        if cur > num_steps - 2:
            cur = 0
    return windows


@pytest.mark.parametrize(("every", "stride"), [(25, 1), (20, 1), (25, 0), (3, 2)])
def test_the_window_moves_as_the_sources_states(every, stride):
    cfg = tiny(
        *MIX, "sample.num_steps=25", f"algorithm.mixgrpo.move_every={every}", f"algorithm.mixgrpo.stride={stride}"
    )
    expected = published_windows(300 if every > 3 else 120, 25, 4, every, stride)  # (3, 2): past its roll-back
    for g, window in enumerate(expected):
        if not window:  # the source's window at start N - 2 is empty (its script then fails); lean rolls back earlier
            continue
        steps = MixGRPO.steps(cfg, g, 3)
        assert torch.nonzero(steps.stochastic).flatten().tolist() == window, g
        assert steps.trained.all(dim=0).tolist() == steps.stochastic.tolist()


def test_the_iteration_rolls_out_the_algorithms_window():
    cfg = tiny(*MIX, "sample.num_steps=8", "algorithm.mixgrpo.move_every=2", "algorithm.mixgrpo.window=3")
    assert window_start(5, 8, 2, 1) == 2
    batch = local_batch(cfg, iteration=5)
    assert torch.nonzero(batch.steps.stochastic).flatten().tolist() == [2, 3, 4]


def test_mixgrpo_refuses_a_second_window_in_one_line():
    with pytest.raises(ConfigError, match=r"sample\.sde_window=2.*algorithm\.mixgrpo\.window"):
        tiny(*MIX, "sample.sde_window=2", "sample.num_steps=6")


def test_flash_tail_grid_is_the_sources_compressed_grid():
    """sampling_utils.py:33-44: int(max((N - L) r, 1)) points from the unshifted t_{L+1} to 0, shifted."""
    n, shift, last = 25, 3.0, 3
    sigmas = sigma_schedule(n, shift, "uniform")
    tail = tail_sigmas(sigmas, last, 0.4, shift)
    assert len(tail) == int(max((n - last) * 0.4, 1)) == 8
    t = torch.linspace(float(torch.linspace(1, 0, n + 1)[last + 1]), 0, 8)
    torch.testing.assert_close(tail, (shift * t / (1 + (shift - 1) * t)).double())
    torch.testing.assert_close(tail[0], sigmas[last + 1], rtol=1e-6, atol=0)  # the grid goes on where it was
    assert torch.equal(tail_sigmas(sigmas, last, 1.0, shift), sigmas[last + 1 :])
    sets = ["sample.sigma_grid=uniform", "sample.tail_solver=dpmsolver++", "sample.tail_compress=0.4"]
    cfg = tiny(*MIX, *sets, "sample.num_steps=25", "sample.shift=3")
    stochastic = [False] * 25
    stochastic[2:4] = [True, True]
    grid = rollout_sigmas(sigmas, stochastic, cfg.sample)
    assert len(grid) - 1 == last + 8  # the source's last + n_post steps
    assert torch.equal(grid[: last + 1], sigmas[: last + 1])


def test_a_compressed_tail_needs_the_uniform_grid_and_a_multistep_solver():
    with pytest.raises(ConfigError, match=r"sample\.tail_compress=0\.4.*sigma_grid=uniform"):
        tiny(*MIX, "sample.tail_compress=0.4", "sample.sigma_grid=euler", "sample.tail_solver=dpmsolver++")
    with pytest.raises(ConfigError, match=r"sample\.tail_compress=0\.4.*sample\.tail_solver"):
        tiny(*MIX, "sample.tail_compress=0.4", "sample.sigma_grid=uniform")


def gaussian_flow(scale: float):
    """Data N(0, scale^2): the exact x0 prediction E[x0 | x_sigma] and the exact ODE map between two sigmas."""

    def x0(x, sigma):
        a = 1 - sigma
        return a * scale**2 * x / (a**2 * scale**2 + sigma**2)

    def exact(x, sigma, sigma_next):
        norm = lambda s: math.sqrt((1 - s) ** 2 * scale**2 + s**2)  # noqa: E731
        return x * norm(sigma_next) / norm(sigma)

    return x0, exact


def solve(solver: str, num_steps: int, x: torch.Tensor, x0_of) -> torch.Tensor:
    """Integrate from sigma = 0.98 to 0.02 with Euler or DPM-Solver++(2M), on a uniform grid."""
    sigmas = torch.linspace(0.98, 0.02, num_steps + 1, dtype=torch.float64)
    prev = None
    for i in range(num_steps):
        d0 = x0_of(x, sigmas[i])
        if solver == "euler":
            x = ode_step((x - d0) / sigmas[i], x, sigmas, i)
        else:
            x = dpm_solver_pp_step(x, d0, prev, sigmas[i - 1] if i else None, sigmas[i], sigmas[i + 1])
        prev = d0
    return x


def test_dpm_solver_pp_2m_is_second_order_and_beats_euler():
    x0_of, exact = gaussian_flow(0.5)
    x = torch.linspace(-2, 2, 9, dtype=torch.float64)
    truth = exact(x, 0.98, 0.02)
    error = {
        (s, n): (solve(s, n, x.clone(), x0_of) - truth).abs().max().item() for s in ("euler", "dpm") for n in (32, 64)
    }
    assert error[("dpm", 32)] < error[("euler", 32)] / 3
    assert 3.5 < error[("dpm", 32)] / error[("dpm", 64)] < 5  # second order: halving the step quarters the error
    assert 1.7 < error[("euler", 32)] / error[("euler", 64)] < 2.3  # Euler: first order


def test_dpm_solver_last_step_lands_on_the_prediction():
    x, d0 = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    out = dpm_solver_pp_step(x, d0, d0 + 1, torch.tensor(0.5), torch.tensor(0.2), torch.tensor(0.0))
    assert torch.equal(out, d0)


def test_flash_rollout_takes_the_window_then_the_compressed_tail():
    cfg = tiny(
        *MIX,
        "sample.num_steps=12",
        "sample.sigma_grid=uniform",
        "sample.tail_solver=dpmsolver++",
        "sample.tail_compress=0.5",
        "algorithm.mixgrpo.window=2",
        "sample.shift=3",
    )
    from lean.train import Trainer

    trainer = Trainer(cfg)
    pipeline = trainer.pipeline
    batch = pipeline.local_batch(0)
    steps, seen = [], []
    with torch.no_grad():
        plan = RolloutPlan(
            sampler=Sampler(pipeline.cfg.sample, pipeline.sigmas),
            emb=pipeline.embed(batch),
            generators=batch.generators,
            steps=batch.steps,
        )
        final = rollout(
            pipeline.policy, plan, RolloutHooks(on_step=lambda s: steps.append(s.index), progress=seen.append)
        )
    assert sorted(set(steps)) == [0, 1]  # the window's SDE steps, at their own sigmas
    assert len(seen) == 1 + int(max((12 - 1) * 0.5, 1))  # L + n_post steps: the window ends at L = 1
    assert torch.isfinite(final).all()


@pytest.mark.parametrize("grad_micro_batch", [None, 1])
def test_a_tail_after_a_window_tracked_in_parts_is_the_same_trajectory(grad_micro_batch):
    """A schedule may run a tracked step one row at a time (Reweight under a full fine-tune); DPM-Solver++'s history
    must hold every row of the micro-batch, so the trajectories do not depend on it."""
    from lean.train import Trainer

    sets = ["sample.num_steps=12", "sample.sigma_grid=uniform", "sample.tail_solver=dpmsolver++", "model.dtype=float64"]
    trainer = Trainer(tiny(*MIX, *sets, "sample.tail_compress=0.5", "algorithm.mixgrpo.window=2", "sample.shift=3"))
    pipeline = trainer.pipeline

    def final(hooks: RolloutHooks | None = None, grad_micro_batch: int | None = None):
        batch = pipeline.local_batch(0)  # fresh random streams: a rollout consumes them
        sampler = Sampler(pipeline.cfg.sample, pipeline.sigmas)
        plan = RolloutPlan(sampler=sampler, emb=pipeline.embed(batch), generators=batch.generators, steps=batch.steps)
        plan.grad_micro_batch = grad_micro_batch
        return rollout(pipeline.policy, plan, hooks).detach()

    untracked = final()
    tracked = final(RolloutHooks(track_grad=lambda i: True), grad_micro_batch)
    torch.testing.assert_close(tracked, untracked, rtol=1e-12, atol=1e-12)  # the forward in parts rounds apart
