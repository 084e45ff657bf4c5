"""Memory through one iteration, as the LeanGRPO paper plots it (arXiv 2609.03528, Fig. 6): the resident bytes after
each SDE step of the rollout, then the peaks of the update's backward and of the optimizer stage.

A :class:`MemoryTrace` is a :class:`~lean.observe.metrics.PeakMemory` (its ``peak_mb`` is the iteration's peak, the
largest of its phases') that also records, in order:

    step points     (micro-batch, step i, MiB resident when step i's forward has run), one per SDE step: the step's
                    graph is alive (Retain keeps it, Reweight backpropagates it next, Recompute has none)
    rollout peak    the high-water mark from the iteration's start to the end of the rollout (decode, rewards)
    update peak     from there to the first optimizer step: advantages, the backwards, Reweight's correction
    optimizer peak  the largest over the optimizer steps: gradient sync and its buffer, clipping, AdamW (its moments
                    allocated on the first step), the EMA

Resident memory is what tensors hold: ``torch.cuda.memory_allocated`` on a GPU; on a CPU the resident set under
``live_bytes_heap`` (every large block mapped on its own and unmapped on free), each phase's high-water mark reset
through /proc/self/clear_refs. The curve's figures (:func:`curve_summary`):

    slope       median growth between consecutive tracked steps of one rollout micro-batch (MiB per step): Retain's
                kept graph per step; ~0 for Recompute and Reweight
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lean.observe.metrics import PeakMemory, median, read_status_kb, reset_cpu_peak, rss_mb


class MemoryTrace(PeakMemory):
    """``with MemoryTrace(device) as trace:`` around an iteration; :meth:`on_step` as the rollout's step hook,
    :meth:`end_rollout` between the rollout and the update, :meth:`optimizer_step` wrapping the optimizer step."""

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(device)
        self.steps: list[dict] = []  # {"micro_batch", "step", "tracked", "mb"}
        self.phases: dict[str, float] = {}  # phase -> its peak MiB

    def current_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 2**20
        return rss_mb()

    def _take_peak(self) -> float:
        """The high-water mark since the last reset (MiB), then reset it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        kb = read_status_kb("VmHWM")
        peak = kb / 1024 if kb is not None else float("nan")
        reset_cpu_peak()
        return peak

    def on_step(self, step) -> None:
        """After step i's forward (``step``: its ``lean.sampling.transition.Transition``), before the schedule sees it
        (keeps, backpropagates or drops its graph). A step run in several forwards (gradient micro-batches) is one
        point, taken after its last; a step index lower than the last starts the next rollout micro-batch."""
        index = step.index if isinstance(step.index, int) else int(step.index.max())
        tracked = step.log_prob is not None and step.log_prob.requires_grad
        last = self.steps[-1] if self.steps else None
        if last is not None and last["step"] == index:
            last.update(tracked=last["tracked"] or tracked, mb=self.current_mb())
            return
        micro_batch = 0 if last is None else last["micro_batch"] + (index < last["step"])
        self.steps.append({"micro_batch": micro_batch, "step": index, "tracked": tracked, "mb": self.current_mb()})

    def end_rollout(self) -> None:
        self.phases["rollout"] = self._take_peak()

    def optimizer_step(self, step: Callable[[], dict]) -> Callable[[], dict]:
        """``step`` with the update's peak taken before it and the optimizer stage's after it."""

        def traced() -> dict:
            self.phases.setdefault("update", self._take_peak())  # the backwards before the first optimizer step
            out = step()
            self.phases["optimizer"] = max(self.phases.get("optimizer", 0.0), self._take_peak())
            return out

        return traced

    def __exit__(self, *exc):
        last = self._take_peak()  # after the last optimizer step (a later update's backwards, the EMA)
        self.phases["update"] = max(self.phases.get("update", 0.0), last)
        self.peak_mb = max(self.phases.values())
        return False

    def curve(self) -> dict:
        """The trace as JSON: the start, the step points, the phases' peaks, the per-step slope."""
        return {"start_mb": self.start_mb, "steps": self.steps, "phases": self.phases, **curve_summary(self.steps)}


def curve_summary(steps: list[dict]) -> dict:
    """``slope_mb``: the median growth per tracked step within a micro-batch (MiB); ``tracked_steps`` counted."""
    growth = [
        b["mb"] - a["mb"]
        for a, b in zip(steps, steps[1:])
        if a["tracked"] and b["tracked"] and a["micro_batch"] == b["micro_batch"]
    ]
    return {"slope_mb": median(growth) if growth else 0.0, "tracked_steps": sum(p["tracked"] for p in steps)}
