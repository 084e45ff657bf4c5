"""Scoring a rollout while it runs: each micro-batch is decoded and scored as soon as its trajectories finish.

The rollout (``lean.sampling.rollout``) takes its micro-batches one after the other, each through all its steps. With
``reward.async_scoring`` a worker thread decodes and scores micro-batch k while micro-batch k+1 rolls out:

    main thread   | roll out 0 | roll out 1 | roll out 2 | wait |  advantages -> update
    worker        |            |  score 0   |  score 1   | score 2 |

Only the last micro-batch's scoring (and whatever the worker had not finished) stays on the critical path. What is
hidden depends on where the work runs: a host-side or remote reward (JPEG, OCR, a reward server) hides behind a GPU
rollout; on a CPU, torch releases the GIL inside its kernels, so with one torch thread per process the decoder and the
rewards run on a second core. Rewards are the same numbers as when scored after the rollout: each sample's score
depends on its own image only (the rewards are per-sample functions; a model reward's batch size is its own key), or,
for a group-wise reward (``lean.rewards.groupwise``), on its group's: such a reward holds a group's samples until the
last one is scored (``lean.rewards.scorer.ScoreStream``), so a micro-batch's scores may come out with a later one's,
each batch naming its ``rows``; a group the process holds whole is complete by the end of its rollout.

The iteration's ``reward`` phase is the time the scoring itself took (decode + rewards, summed over micro-batches;
``decode`` the decoder's part of it), its ``reward_exposed`` phase the time the rollout's thread waited for it; the
difference was hidden.

Under sequence parallelism the P processes of a group hold the same samples. With ``parallel.split_decode`` each
decodes and scores its contiguous share of every micro-batch (``World.sequence_share``) and the group all-gathers the
rewards (:func:`merge_shares`), so a long video is decoded once, not P times: the decode per process is 1/P.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class ScoredBatch:
    """One micro-batch's decoded images and the rewards it completed; ``error`` when a reward failed (the images are
    kept)."""

    images: Tensor  # [b, 3, H, W] (or [b, 3, F, H, W]) in [0, 1]; a split decode: this process's share
    rewards: Tensor | None = None  # float64 [r]
    parts: dict[str, Tensor] = field(default_factory=dict)  # each reward's component [r]
    rows: Tensor | None = None  # long [r]: the local rows ``rewards`` are of; None: the micro-batch's own b, in order
    error: Exception | None = None
    seconds: float = 0.0
    decode_s: float = 0.0  # of seconds, the decoder's


def merge_shares(mine: ScoredBatch, every: list[tuple]) -> ScoredBatch:
    """A micro-batch scored in shares by the processes of a sequence-parallel group: ``every`` is each process's
    (rewards, parts, error) in group order (``World.gather_over_sequence_group``), ``mine`` this process's share
    (its images stay its own). One process's error is every process's."""
    error = next((e for _, _, e in every if e is not None), None)
    if error is not None:
        return ScoredBatch(mine.images, error=error, decode_s=mine.decode_s)
    keys = next((parts.keys() for rewards, parts, _ in every if len(rewards)), ())
    return ScoredBatch(
        mine.images,
        torch.cat([rewards for rewards, _, _ in every]),
        {k: torch.cat([parts[k] for rewards, parts, _ in every if len(rewards)]) for k in keys},
        decode_s=mine.decode_s,
    )


def placed(batches: list[ScoredBatch], starts: list[int], n: int) -> tuple[Tensor, dict[str, Tensor]]:
    """(rewards [n], each reward's component [n]) of ``batches``, every batch's values at its ``rows`` (None: the n_k
    rows from its ``starts``); NaN at rows whose group is not complete yet."""
    rewards = torch.full((n,), torch.nan, dtype=torch.float64)
    parts: dict[str, Tensor] = {}
    for batch, start in zip(batches, starts, strict=True):
        rows = batch.rows if batch.rows is not None else slice(start, start + len(batch.rewards))
        rewards[rows] = batch.rewards.to(torch.float64)
        for k, v in batch.parts.items():
            parts.setdefault(k, torch.full((n,), torch.nan, dtype=torch.float64))[rows] = v.to(torch.float64)
    return rewards, parts


ScoreFn = Callable[[Tensor, list[str]], ScoredBatch]


@dataclass
class ScoredRollout:
    """The whole local batch, in row order."""

    images: Tensor
    rewards: Tensor | None
    parts: dict[str, Tensor]
    error: Exception | None
    busy_s: float  # decode + rewards, summed over micro-batches
    decode_s: float = 0.0  # of busy_s, the decoder's


def timed(score: ScoreFn) -> ScoreFn:
    """``score`` with its wall time in ``seconds`` (the rewards come back to the host, so the device is done)."""

    def run(final: Tensor, prompts: list[str]) -> ScoredBatch:
        start = time.perf_counter()
        with torch.no_grad():
            scored = score(final, prompts)
        scored.seconds = time.perf_counter() - start
        return scored

    return run


def score_worker() -> ThreadPoolExecutor:
    """The one thread a pipeline scores in, for its whole life: a fresh thread per rollout would start cold every
    time (measured on Wan's decoder: 11.5 s in a fresh thread against 7.6 s in the main or a reused one). torch's
    thread count is per thread (OpenMP): the worker takes its creator's."""
    threads = torch.get_num_threads()
    return ThreadPoolExecutor(1, "lean-score", initializer=torch.set_num_threads, initargs=(threads,))


class RolloutScoring:
    """Scores a rollout micro-batch by micro-batch, as each is ``submit``-ted (in row order).

    With a ``worker`` (:func:`score_worker`) while the caller goes on rolling out; else in the caller's thread when
    it calls ``collect``. Either way every micro-batch is decoded and scored on its own, so the rewards are the same
    numbers (a decoder's result can depend on its batch size in the last bits). ``collect`` may be called again after
    more submits (the group layout scores each group before the next rolls out): it returns every batch so far."""

    def __init__(self, score: ScoreFn, worker: ThreadPoolExecutor | None):
        self.score = timed(score)
        self.worker = worker
        self.batches: list[ScoredBatch | Future | tuple[Tensor, list[str]]] = []
        self.starts: list[int] = []  # each batch's first row
        self.submitted = 0  # rows so far

    def submit(self, final: Tensor, prompts: list[str]) -> None:
        final, prompts = final.detach(), list(prompts)
        self.starts.append(self.submitted)
        self.submitted += len(prompts)
        self.batches.append((final, prompts) if self.worker is None else self.worker.submit(self.score, final, prompts))

    def _scored(self, batch) -> ScoredBatch:
        if isinstance(batch, ScoredBatch):
            return batch
        return batch.result() if isinstance(batch, Future) else self.score(*batch)

    def rewards(self) -> tuple[Tensor, dict[str, Tensor]] | None:
        """The rewards of every micro-batch so far (float64, row order; NaN at a row whose group-wise reward waits for
        the rest of its group) and each reward's component, waiting for them; None if a reward failed (``collect``
        then returns the error with the images)."""
        batches = self._resolve()
        if any(b.error is not None for b in batches):
            return None
        return placed(batches, self.starts, self.submitted)

    def _resolve(self) -> list[ScoredBatch]:
        try:
            self.batches = [self._scored(b) for b in self.batches]
        except BaseException:
            self.cancel()
            raise
        return self.batches

    def collect(self) -> ScoredRollout:
        """Every micro-batch's score so far, in row order; the first reward error is returned (not raised) with all
        images, so the caller can keep the rollout before it raises."""
        batches = self._resolve()
        error = next((b.error for b in batches if b.error is not None), None)
        rewards, parts = (None, {}) if error is not None else placed(batches, self.starts, self.submitted)
        shares = [b.images for b in batches if len(b.images)]  # a split decode's share may be empty
        images = torch.cat(shares) if shares else torch.zeros(0)
        busy_s, decode_s = sum(b.seconds for b in batches), sum(b.decode_s for b in batches)
        return ScoredRollout(images, rewards, parts, error, busy_s=busy_s, decode_s=decode_s)

    def cancel(self) -> None:
        """The rollout failed: drop what has not started (a running micro-batch finishes in the background)."""
        for batch in self.batches:
            if isinstance(batch, Future):
                batch.cancel()
