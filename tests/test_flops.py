"""lean's FLOP counter counts what torch's ``FlopCounterMode`` counts: on a training iteration, on the meta device."""

import pytest
import torch
from helpers import tiny
from torch.utils.flop_counter import FlopCounterMode

from lean.observe.flops import FlopCounter
from lean.observe.metrics import FlopTally
from lean.train import Trainer


@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_an_iterations_flops_equal_torchs_counter(family):
    """One Retain iteration (rollout with its backwards, the decode, a CFG branch under sd3) counted by both: the same
    total, and the regions of ``FlopTally`` add up to it."""
    trainer = Trainer(tiny(f"model.family={family}", *(["sample.guidance_scale=2.0"] if family == "sd3" else [])))
    state = trainer.state.state_dict()
    trainer.iteration(0, "retain")  # the prompts' embeddings cached: both count the same work
    trainer.state.load_state_dict(state)
    with FlopCounterMode(display=False) as torchs:
        trainer.iteration(0, "retain")
    trainer.state.load_state_dict(state)
    tally = FlopTally()
    with tally.measuring():
        trainer.iteration(0, "retain", tally=tally)
    assert tally.total() == torchs.get_total_flops() > 0
    assert tally.flops["backward"] > 0 and tally.flops["rollout_forward"] > 0


def test_meta_device_counts_equal_torchs_counter():
    """On the meta device (``lean plan``): attention, convolutions and a backward, no kernel run."""
    conv = torch.nn.Conv2d(4, 8, 3, device="meta")
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True, device="meta")

    def work():
        x = torch.randn(2, 4, 6, 6, device="meta", requires_grad=True)
        h = conv(x).flatten(2).transpose(1, 2)  # [2, 16, 8]
        out, _ = attention(h, h, h)
        torch.nn.functional.scaled_dot_product_attention(h, h, h).sum().add(out.sum()).backward()

    with FlopCounterMode(display=False) as torchs:
        work()
    with FlopCounter() as ours:
        work()
    assert ours.get_total_flops() == torchs.get_total_flops() > 0
