"""LeanGRPO's alignment protocol (App. E) as ``lean equivalence --deterministic``: with deterministic kernels,
Recompute recomputing at the rollout's micro-batches and Retain backpropagating each kept graph on its own in
Recompute's order, Retain's gradient, update and AdamW moments are Recompute's bit for bit, in float32 and in
bfloat16; Reweight's are close (it scales a formed gradient where Recompute scales the loss)."""

from __future__ import annotations

import json

import pytest
import torch

from lean.tools.alignment import QUANTITIES, deterministic_overrides, metrics


@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_retain_is_recomputes_update_bit_for_bit_in_deterministic_mode(family, dtype, tmp_path, capsys):
    from lean.cli import main

    sets = [f"model.family={family}", f"model.dtype={dtype}", "sample.num_steps=4"]
    args = [a for s in sets for a in ("--set", s)]
    assert main(["equivalence", "--deterministic", *args, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["passes"] and report["layout"] == "slice"
    retain, reweight = report["alignment"]["retain"], report["alignment"]["reweight"]
    assert set(retain) == set(QUANTITIES)
    for quantity, m in retain.items():  # every element equal: RelL2 and MaxAbs exactly 0
        assert m["bitwise_equal"] and m["rel_l2"] == 0.0 and m["max_abs"] == 0.0, quantity
    assert not reweight["gradient"]["bitwise_equal"] and reweight["gradient"]["cosine"] > 0.99
    assert "alignment against recompute" in capsys.readouterr().out
    assert torch.get_num_threads() >= 1 and not torch.are_deterministic_algorithms_enabled()  # restored


def test_the_protocols_overrides_and_metrics():
    """The command line's own settings win over the protocol's; the metrics are App. E's (cos, RelL2, MaxAbs)."""
    overrides = deterministic_overrides(["parallel.layout=group", "model.family=wan"])
    assert "parallel.layout=slice" not in overrides and "train.recompute_batching=rollout" in overrides
    x, y = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])
    m = metrics(x, y)
    assert m["rel_l2"] == pytest.approx(0.1) and m["max_abs"] == pytest.approx(0.5) and not m["bitwise_equal"]
    assert m["cosine"] == pytest.approx((9 + 18) / (5 * (9 + 20.25) ** 0.5))
    tiny = metrics(torch.full((4,), 1e-12), torch.full((4,), 1e-12))  # AdamW's second moments: no floor on norms
    assert tiny["cosine"] == pytest.approx(1.0) and tiny["bitwise_equal"]
