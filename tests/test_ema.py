"""The EMA of the trained weights: FlowGRPO's warm-up schedule, lora_ema.safetensors, and resume keeping it."""

import pytest
import torch
from helpers import tiny
from safetensors.torch import load_file

from lean import checkpoint
from lean.config.run_sections import EMAConfig, OptimizerConfig
from lean.configure import load_config
from lean.parallel.distributed import World
from lean.run.iteration import IterationResult
from lean.run.optimizer import TrainState, ema_decay
from lean.train import Trainer, train


def flowgrpo_decay(global_step: int, decay: float) -> float:
    """flow_grpo/ema.py EMAModuleWrapper.get_current_decay, as published."""
    return min((1 + global_step) / (10 + global_step), decay)


def test_warmup_decay_sequence_is_flowgrpos():
    for every in (1, 3, 8):
        for s in range(1, 400):
            # FlowGRPO: global_step += 1 after the optimizer step, then ema.step(params, global_step) updates when
            # (global_step + 1) % update_step_interval == 0
            expected = flowgrpo_decay(s, 0.9) if (s + 1) % every == 0 else None
            assert ema_decay(s, 0.9, every, warmup=True) == expected, (every, s)
            assert ema_decay(s, 0.9, every, warmup=False) == (0.9 if s % every == 0 else None), (every, s)
    assert ema_decay(7, 0.9, 8, True) == 8 / 17 and ema_decay(79, 0.9, 8, True) == 80 / 89
    assert ema_decay(87, 0.9, 8, True) == 0.9


def test_iteration_unit_counts_flow_factorys_epochs():
    """ema.unit=iteration: t is the iteration's index from 0 (Flow-Factory's epoch, trainers/grpo.py:89); with or
    without the warm-up the EMA updates after the iterations t with (t + 1) % every == 0 (ema/ema.py:107)."""
    for every in (1, 4):
        for t in range(200):
            fires = (t + 1) % every == 0
            assert ema_decay(t, 0.9, every, True, first=0) == (min((1 + t) / (10 + t), 0.9) if fires else None)
            assert ema_decay(t, 0.9, every, False, first=0) == (0.9 if fires else None)
    assert ema_decay(3, 0.9, 4, True, first=0) == 4 / 13 and ema_decay(83, 0.9, 4, True, first=0) == 0.9


def test_trainer_updates_an_iteration_ema_after_the_iterations_last_step():
    """Two optimizer steps per iteration, ema.every=1 counting iterations: ``Trainer.iteration`` moves the EMA once,
    after both steps (its pipeline stands in here: two AdamW steps), by the warm-up decay of iteration 0 (1/10)."""
    params = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))]
    ema = EMAConfig(enabled=True, every=1, unit="iteration", warmup=True)
    trainer = Trainer.__new__(Trainer)
    trainer.state = TrainState([("a", params[0])], OptimizerConfig(lr=1e-2), ema, World())
    trainer.cfg, trainer.world = load_config(None, []), World()
    seen = []

    class TwoSteps:
        def run(self, iteration, schedule, step, **_):
            for _ in range(2):
                params[0].grad = torch.ones_like(params[0])
                step()
                seen.append(trainer.state.ema[0].clone())
            return IterationResult({}, torch.zeros(0), torch.zeros(0))

    trainer.pipeline = TwoSteps()
    start = params[0].detach().clone()
    trainer.iteration(0, "recompute")
    assert trainer.state.steps == 2 and all(torch.equal(e, start) for e in seen)  # not moved between the steps
    torch.testing.assert_close(trainer.state.ema[0], start + (1 - 1 / 10) * (params[0].detach() - start))


@pytest.mark.parametrize("warmup,repeats", [(True, 1), (False, 1), (True, 2)])
def test_train_state_follows_the_schedule(warmup, repeats):
    """100 AdamW steps on two tensors: the EMA equals the lerps of the schedule recomputed here, each update applied
    ``repeats`` times to the same weights (FlowGRPO: once per training micro-batch)."""
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in ((4, 3), (5,))]
    ema = EMAConfig(enabled=True, decay=0.95, every=3, warmup=warmup, repeats=repeats)
    state = TrainState(list(zip(["a", "b"], params)), OptimizerConfig(lr=1e-2), ema, World())
    expected = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(0)
    for s in range(1, 101):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        state.step()
        fires = (s + 1) % 3 == 0 if warmup else s % 3 == 0
        if fires:
            d = min((1 + s) / (10 + s), 0.95) if warmup else 0.95
            for _ in range(repeats):
                expected = [e + (1 - d) * (p.detach() - e) for e, p in zip(expected, params)]
    for e, got, p in zip(expected, state.ema, params):
        torch.testing.assert_close(got, e, rtol=1e-6, atol=1e-6)
        assert not torch.equal(got, p)  # it lags the weights
    assert set(state.ema_state_dict()) == {"a", "b"}


EMA_RUN = ("ema.enabled=true", "ema.every=1", "ema.warmup=true", "optimizer.lr=1e-2", "checkpoint.every=1")


@pytest.mark.timeout(300)
def test_lora_ema_is_written_and_resume_keeps_the_ema(tmp_path):
    cfg = tiny(*EMA_RUN, "train.iterations=2")
    train(cfg, out=str(tmp_path / "full"))
    lora = load_file(tmp_path / "full" / "lora.safetensors")
    ema = load_file(tmp_path / "full" / "lora_ema.safetensors")
    assert ema.keys() == lora.keys()
    assert all(ema[k].dtype == lora[k].dtype and ema[k].shape == lora[k].shape for k in lora)
    assert any(not torch.equal(ema[k], lora[k]) for k in lora)  # decays 2/11 then 3/12: the EMA lags

    saved = checkpoint.latest(tmp_path / "full" / "checkpoints")["trainer"]  # the state after the last iteration
    names = Trainer(cfg).state.names
    assert saved["optimizer_steps"] == 2
    assert all(torch.equal(ema[n], e) for n, e in zip(names, saved["ema"], strict=True))

    train(tiny(*EMA_RUN, "train.iterations=1"), out=str(tmp_path / "resumed"))  # stopped after iteration 0
    train(cfg, out=str(tmp_path / "resumed"), resume=True)
    resumed = load_file(tmp_path / "resumed" / "lora_ema.safetensors")
    assert all(torch.equal(resumed[k], ema[k]) for k in ema)
