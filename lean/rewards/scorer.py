"""A run's rewards, built once: :class:`Scorer` turns ``reward`` config into callables and sums them.

``total = Σ_name weights[name] · r_name(images, prompts)`` (float64 [B]), with every unweighted component. Each
``r_name`` is, in this order: a :class:`lean.rewards.remote.RemoteReward` when ``reward.remote`` names it; a
:class:`lean.rewards.pickle_servers.PickleServerReward` when ``reward.pickle_servers`` does;
:class:`lean.rewards.vlm_judge.VLMJudge` when ``reward.judges`` does; a model reward (``MODEL_REWARDS``) loaded from
``reward.models.<name>`` onto its device; a group-wise reward (``GROUP_REWARDS``, ``lean.rewards.groupwise``); a
built-in function (``REWARDS``).

A rollout is scored as it finishes, micro-batch by micro-batch (:meth:`Scorer.stream`): the per-sample rewards score
each micro-batch at once; a group-wise reward holds its samples (images, prompt, the per-sample components) until the
last of its group arrives, then scores the group, and its rows' totals come out with it (:class:`ScoreStream`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.rewards.base import GROUP_REWARDS, MODEL_REWARDS, REWARDS, GroupReward, RewardFn, reads_audio
from lean.rewards.pickle_servers import PickleServerReward
from lean.rewards.remote import RemoteReward
from lean.rewards.vlm_judge import VLMJudge

if TYPE_CHECKING:
    from lean.rewards.options import RewardConfig


def build_reward(
    name: str,
    cfg: RewardConfig,
    device: torch.device | str,
    remote: bool = True,
    pointwise: Callable[[str], RewardFn] | None = None,
) -> RewardFn:
    """The reward ``name`` of ``cfg`` ready to call (a model reward loads its model here); ``remote=False`` builds
    it in this process even when ``reward.remote`` names it (what its server does). A group-wise reward builds the
    per-sample rewards it reads with ``pointwise`` (default: afresh, by this function)."""
    if remote and name in cfg.remote:
        return RemoteReward(name, cfg.remote[name])
    if remote and name in cfg.pickle_servers:
        return PickleServerReward(name, cfg.pickle_servers[name])
    if name in cfg.judges:
        return VLMJudge(name, cfg.judges[name])
    if name in MODEL_REWARDS:
        if name not in cfg.models:
            raise ValueError(f"reward {name!r} loads a model: set reward.models.{name}.folder")
        return MODEL_REWARDS[name](cfg.models[name], device)
    if name in GROUP_REWARDS:
        return GROUP_REWARDS[name](cfg, pointwise or (lambda other: build_reward(other, cfg, device, remote)))
    return REWARDS.get_or_raise(name)


def declared_reads_audio(cfg: RewardConfig) -> bool:
    """Whether a weighted reward of ``cfg`` reads the soundtrack, by what the entry :func:`build_reward` would build
    declares (nothing is built: ``lean plan`` counts the audio decode from it). A remote reward, a pickle server's or
    a VLM judge reads frames."""
    served = {*cfg.remote, *cfg.pickle_servers, *cfg.judges}
    for name in cfg.weights:
        if name not in served:
            entry = next((r[name] for r in (MODEL_REWARDS, GROUP_REWARDS, REWARDS) if name in r), None)
            if reads_audio(entry):
                return True
    return False


def weighted_sum(
    rewards: Mapping[str, RewardFn],
    weights: Mapping[str, float],
    images: Tensor,
    prompts: list[str],
    group_ids: Tensor | None = None,
    audio: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(``Σ weights[name] · rewards[name](images, prompts)`` float64 [B], each unweighted component on the host); a
    group-wise reward scores each group of ``group_ids`` [B] (None: the samples of each prompt); the rewards that
    read audio get ``audio``."""
    components = scored(rewards, weights, images, prompts, group_ids, audio)
    return total_of(components, weights), components


def scored(
    rewards: Mapping[str, RewardFn],
    names,
    images: Tensor,
    prompts: list[str],
    group_ids: Tensor | None = None,
    audio: Tensor | None = None,
) -> dict[str, Tensor]:
    """Each reward of ``names`` on the images, float64 [B] on the host (a group-wise one per group of ``group_ids``);
    a reward that reads audio (:func:`lean.rewards.base.reads_audio`) is handed ``audio`` [B, channels, samples]."""
    grouped = {name: (group_ids,) if isinstance(rewards[name], GroupReward) else () for name in names}
    heard = {name: {"audio": audio} if reads_audio(rewards[name]) else {} for name in names}
    return {
        name: rewards[name](images, prompts, *grouped[name], **heard[name]).cpu().to(torch.float64) for name in names
    }


def total_of(components: Mapping[str, Tensor], weights: Mapping[str, float]) -> Tensor:
    """``Σ weights[name] · components[name]``, float64 [B], in ``weights`` order (the same sum wherever it is made)."""
    total = torch.zeros(len(next(iter(components.values()))), dtype=torch.float64)
    for name, weight in weights.items():
        total += weight * components[name]
    return total


class Scorer:
    """The weighted rewards of ``cfg`` (validated), each built once (a per-sample reward a group-wise one reads too);
    ``device`` is where model rewards run unless their ``reward.models.<name>.device`` says otherwise."""

    def __init__(self, cfg: RewardConfig, device: torch.device | str):
        self.weights = dict(cfg.weights)
        built: dict[str, RewardFn] = {}

        def pointwise(name: str) -> RewardFn:
            if name not in built:
                built[name] = build_reward(name, cfg, device, pointwise=pointwise)
            return built[name]

        self.rewards = {name: pointwise(name) for name in self.weights}

    @property
    def groupwise(self) -> list[str]:
        """The weighted rewards that score whole groups."""
        return [name for name, reward in self.rewards.items() if isinstance(reward, GroupReward)]

    @property
    def reads_audio(self) -> bool:
        """Whether a weighted reward reads the samples' audio (then the caller decodes it)."""
        return any(reads_audio(reward) for reward in self.rewards.values())

    def __call__(
        self, images: Tensor, prompts: list[str], group_ids: Tensor | None = None, audio: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return weighted_sum(self.rewards, self.weights, images, prompts, group_ids, audio)

    def stream(self, group_ids: Tensor) -> ScoreStream:
        """A :class:`ScoreStream` of a local batch whose rows belong to the groups ``group_ids`` [B]."""
        return ScoreStream(self, group_ids)


class ScoreStream:
    """Scores a local batch micro-batch by micro-batch, in row order (one call per micro-batch, from one thread).

    Each call scores the per-sample rewards of its rows and returns ``(rows, total, components)`` for the rows whose
    scores are all known: its own rows without a group-wise reward; with one, the rows of every group it completes
    (the others wait, held, for their group's last sample: their totals come out with it)."""

    def __init__(self, scorer: Scorer, group_ids: Tensor):
        self.scorer, self.group_ids = scorer, group_ids.tolist()
        self.missing = Counter(self.group_ids)  # group -> its rows not yet seen
        self.held: dict[int, list[tuple[int, Tensor, str, dict[str, Tensor]]]] = defaultdict(list)
        self.next_row = 0

    def __call__(
        self, images: Tensor, prompts: list[str], audio: Tensor | None = None
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``audio``: the micro-batch's soundtracks for the per-sample rewards that read them (a group-wise reward
        sees the frames only)."""
        rows = torch.arange(self.next_row, self.next_row + len(prompts))
        self.next_row += len(prompts)  # first: a failed call still moves on
        groupwise = self.scorer.groupwise
        pointwise = [n for n in self.scorer.rewards if n not in groupwise]
        parts = scored(self.scorer.rewards, pointwise, images, prompts, audio=audio)
        if not groupwise:
            return rows, total_of(parts, self.scorer.weights), parts
        done: list[int] = []
        for i, row in enumerate(rows.tolist()):
            group = self.group_ids[row]
            self.held[group].append((row, images[i], prompts[i], {k: v[i] for k, v in parts.items()}))
            self.missing[group] -= 1
            if not self.missing[group]:
                done.append(group)
        return self._score_groups(done, groupwise)

    def _score_groups(self, groups: list[int], names: list[str]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """The held rows of the complete ``groups``, each group scored by the group-wise rewards ``names``."""
        rows: list[int] = []
        parts: dict[str, list[Tensor]] = defaultdict(list)
        for group in groups:
            held = sorted(self.held.pop(group), key=lambda h: h[0])
            images = torch.stack([image for _, image, _, _ in held])
            rows += [row for row, _, _, _ in held]
            for name in names:
                parts[name].append(self.scorer.rewards[name].score_group(images, held[0][2]).cpu().to(torch.float64))
            for name in held[0][3]:
                parts[name].append(torch.stack([own[name] for _, _, _, own in held]))
        empty = torch.zeros(0, dtype=torch.float64)
        joined = {name: torch.cat(parts[name]) if groups else empty for name in self.scorer.weights}
        return torch.tensor(rows, dtype=torch.long), total_of(joined, self.scorer.weights), joined


def compute_rewards(
    weights: Mapping[str, float], images: Tensor, prompts: list[str]
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`weighted_sum` of built-in (weight-free) rewards; a model reward needs a :class:`Scorer`."""
    unknown = [name for name in weights if name not in REWARDS]
    if unknown:
        kind = "loads a model (use a Scorer)" if unknown[0] in MODEL_REWARDS else "unknown"
        raise ValueError(f"reward {unknown[0]!r}: {kind}; known: {', '.join(sorted(REWARDS))}")
    return weighted_sum(REWARDS, weights, images, prompts)
