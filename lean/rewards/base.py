"""The reward registries and the input contract every reward shares.

A reward scores ``images`` in [0, 1] (float, [B, 3, H, W], or videos [B, 3, F, H, W]) against ``prompts`` (B strings)
and returns float64 [B]. Rewards are written for images; :func:`over_frames` makes one accept videos by scoring every
frame as an image and averaging over the frames: ``r(video_b) = (1/F) Σ_f r(frame_{b,f})``.

* :data:`REWARDS`: weight-free functions (``lean.rewards.builtin``), registered with :func:`register`.
* :data:`MODEL_REWARDS`: rewards that load a model from a local folder (``lean.rewards.models``): a
  :class:`ModelReward` class, built once per run from its ``reward.models.<name>`` settings and a device.
* :data:`GROUP_REWARDS`: group-wise rewards (``lean.rewards.groupwise``): a :class:`GroupReward` class scores the
  samples of one prompt together (Pref-GRPO's win rate), so it is computed once the whole group is decoded.

A reward name is in at most one of them (:func:`reward_names` lists the per-sample ones).

What a reward reads beyond the frames it declares: ``uses_prompts`` (a model reward), and ``reads_audio``
(:func:`reads_audio`): such a per-sample reward is also called with ``audio=`` each sample's decoded soundtrack,
float32 ``[B, channels, samples]`` in [-1, 1] (a family that makes one: ``FamilySpec.audio``, LTX-2), or None where
the family makes none. Every other reward reads the frames only, and no audio is decoded for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from lean.config import ConfigError, check_choice, suggest
from lean.config.registry import Registry

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.rewards.options import RewardConfig, RewardModelConfig

RewardFn = Callable[[Tensor, list[str]], Tensor]


def reads_audio(reward) -> bool:
    """Whether ``reward`` (a built reward: a function, a :class:`ModelReward`) asks for the samples' audio: its
    ``reads_audio`` attribute (:func:`register`'s ``reads_audio``, the class's), False when it has none."""
    return bool(getattr(reward, "reads_audio", False))


def check_inputs(images: Tensor, prompts: list[str]) -> None:
    """``ValueError`` unless ``images`` is float [B, 3, H, W] or [B, 3, F, H, W] with B prompts."""
    if images.ndim not in (4, 5) or images.shape[1] != 3 or not images.is_floating_point():
        raise ValueError(
            f"images: need float [B,3,H,W] or [B,3,F,H,W] in [0, 1], got {images.dtype} {list(images.shape)}"
        )
    if len(prompts) != images.shape[0]:
        raise ValueError(f"prompts: got {len(prompts)} prompts for {images.shape[0]} images")


def over_frames(score_images: RewardFn, images: Tensor, prompts: list[str]) -> Tensor:
    """``score_images`` (written for [B, 3, H, W]) applied to images or videos: float64 [B], a video's score the mean
    over its frames (every frame is scored with its sample's prompt)."""
    check_inputs(images, prompts)
    if images.ndim == 4:
        return score_images(images, list(prompts)).to(torch.float64)
    b, _, f = images.shape[:3]
    frames = images.permute(0, 2, 1, 3, 4).reshape(b * f, 3, *images.shape[3:])
    per_frame = score_images(frames, [p for p in prompts for _ in range(f)]).to(torch.float64)
    return per_frame.view(b, f).mean(dim=1)


class ModelReward:
    """A reward that loads a model from ``settings.folder`` once, onto ``device``; calling it scores a batch.

    Subclasses define :meth:`folder_problem` (a cheap check of the folder's files: it runs at config validation,
    before any model is built), ``__init__`` (the loading) and :meth:`score_images` ([B, 3, H, W] -> [B])."""

    uses_prompts: ClassVar[bool] = True  # False: the score depends on the image alone (an aesthetic predictor)
    # True: ``__call__`` also takes ``audio=`` (the decoded soundtracks, :func:`reads_audio`) and scores the samples
    # itself (a subclass overrides it)
    reads_audio: ClassVar[bool] = False

    @classmethod
    def folder_problem(cls, folder: Path) -> str | None:
        """What keeps ``folder`` from loading as this reward (one line, naming the missing file), or None."""
        raise NotImplementedError

    def __init__(self, settings: RewardModelConfig, device: torch.device | str):
        self.settings = settings

    def score_images(self, images: Tensor, prompts: list[str]) -> Tensor:
        raise NotImplementedError

    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        return over_frames(self.score_images, images, prompts).cpu()


class GroupReward:
    """A reward of a whole group: the G samples of one prompt scored together, ``score_group(images [G, ...], prompt)
    -> float64 [G]`` (a sample's score depends on the others', so no sample is scored before its group is complete).

    Built once per run from the ``reward`` config and ``pointwise`` (name -> a built per-sample reward: what a judge
    made of pointwise rewards compares). :meth:`check_config` holds what the run must give it: whole groups."""

    def __init__(self, cfg: RewardConfig, pointwise: Callable[[str], RewardFn]):
        self.cfg = cfg

    @classmethod
    def check_config(cls, name: str, cfg: RunConfig, world_size: int | None) -> None:
        """Every process holds whole groups (the prompts divide over the data-parallel ranks) and scores them whole
        (no split decode, which scores each process's share of a micro-batch); the reward runs in the trainer."""
        p, t = cfg.parallel, cfg.train
        ranks = p.data_parallel_size(world_size)
        if t.prompts_per_iteration % ranks:
            why = f"reward {name} scores whole groups: must divide over the {ranks} data-parallel ranks"
            raise ConfigError("train.prompts_per_iteration", t.prompts_per_iteration, why)
        if p.sequence_parallel > 1 and p.split_decode:
            raise ConfigError("parallel.split_decode", True, f"reward {name} scores whole groups: set it to false")
        if name in cfg.reward.remote:
            why = f"the group-wise reward {name} runs in the trainer (serve the pointwise reward it reads instead)"
            raise ConfigError(f"reward.remote.{name}", cfg.reward.remote[name].url, why)

    def score_group(self, images: Tensor, prompt: str) -> Tensor:
        raise NotImplementedError

    def __call__(self, images: Tensor, prompts: list[str], group_ids: Tensor | None = None) -> Tensor:
        """float64 [B]: each group of ``group_ids`` [B] (None: the samples of each prompt) scored on its own."""
        check_inputs(images, prompts)
        if group_ids is None:
            group_ids = torch.tensor([prompts.index(p) for p in prompts])
        scores = torch.zeros(len(prompts), dtype=torch.float64)
        for g in torch.unique(group_ids):
            rows = torch.nonzero(group_ids == g).flatten()
            scores[rows] = self.score_group(images[rows.to(images.device)], prompts[rows[0]]).cpu().to(torch.float64)
        return scores


REWARDS: Registry[RewardFn] = Registry("reward")
MODEL_REWARDS: Registry[type[ModelReward]] = Registry("model reward")
# reward name -> what it needs of a run that weights it and computes it here (a package, prompts it can score; a name
# reward.remote serves may be another server's reward): raises a ConfigError; run by :func:`check_config`
CONFIG_CHECKS: dict[str, Callable[[RunConfig], None]] = {}


GROUP_REWARDS: Registry[type[GroupReward]] = Registry("group reward")


def register(name: str, audio: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Register an image reward function under ``name`` in :data:`REWARDS`; the stored function also accepts videos
    (:func:`over_frames`) and checks shapes. With ``audio`` the function reads the soundtrack too:
    ``fn(images, prompts, audio) -> [B]`` scores whole samples (no frame average), float64."""

    def decorate(fn: RewardFn) -> RewardFn:
        def reward(images: Tensor, prompts: list[str], **kw) -> Tensor:
            if audio:
                check_inputs(images, prompts)
                return fn(images, list(prompts), kw.get("audio")).to(torch.float64)
            return over_frames(fn, images, prompts)

        reward.__name__, reward.__doc__, reward.reads_audio = fn.__name__, fn.__doc__, audio
        _check_unique(name)
        return REWARDS.register(name)(reward)

    return decorate


def register_model(name: str) -> Callable[[type[ModelReward]], type[ModelReward]]:
    """Register a :class:`ModelReward` subclass under ``name`` in :data:`MODEL_REWARDS`."""

    def decorate(cls: type[ModelReward]) -> type[ModelReward]:
        _check_unique(name)
        return MODEL_REWARDS.register(name)(cls)

    return decorate


def register_group(name: str) -> Callable[[type[GroupReward]], type[GroupReward]]:
    """Register a :class:`GroupReward` subclass under ``name`` in :data:`GROUP_REWARDS`."""

    def decorate(cls: type[GroupReward]) -> type[GroupReward]:
        _check_unique(name)
        return GROUP_REWARDS.register(name)(cls)

    return decorate


def _check_unique(name: str) -> None:
    if name in REWARDS or name in MODEL_REWARDS or name in GROUP_REWARDS:
        raise ValueError(f"reward {name!r} is registered twice")


def reward_names() -> list[str]:
    """Every registered per-sample reward (what ``lean reward serve`` serves): the functions, then the model
    rewards; :data:`GROUP_REWARDS` holds the group-wise ones."""
    return [*REWARDS, *MODEL_REWARDS]


def check_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """Every weighted reward is registered here or computed elsewhere (:func:`computed_elsewhere`), every model
    reward computed here has a folder with the files it needs, every reward computed here passes its
    :data:`CONFIG_CHECKS`, and every group-wise reward gets whole groups (``GroupReward.check_config``)."""
    r = cfg.reward
    known = [*reward_names(), *GROUP_REWARDS]
    elsewhere = computed_elsewhere(r)
    for name, weight in r.weights.items():
        if name not in known and name not in elsewhere:
            raise ConfigError(
                f"reward.weights.{name}",
                weight,
                f"unknown reward; known: {', '.join(sorted(known))}" + suggest(name, known),
            )
    for name, entry in r.models.items():
        check_choice(f"reward.models.{name} key", name, MODEL_REWARDS)
        if name not in r.remote:  # a served reward's folder is on the server's machine
            check_folder(f"reward.models.{name}.folder", name, entry.folder)
    for name in r.weights:
        check_model_entry(cfg, name)
        if name in CONFIG_CHECKS and name not in elsewhere:
            CONFIG_CHECKS[name](cfg)
        if name in GROUP_REWARDS:
            GROUP_REWARDS[name].check_config(name, cfg, world_size)


def computed_elsewhere(r: RewardConfig) -> set[str]:
    """The reward names another process computes: a lean reward server's, FlowGRPO's servers', a VLM judge's."""
    return {*r.remote, *r.pickle_servers, *r.judges}


def check_model_entry(cfg: RunConfig, name: str) -> None:
    """A ConfigError unless reward ``name``, when a model reward computed here, has its ``reward.models.<name>``."""
    r = cfg.reward
    if name in MODEL_REWARDS and name not in computed_elsewhere(r) and name not in r.models:
        raise ConfigError(f"reward.models.{name}.folder", None, f"set the local model folder of reward {name}")


def check_folder(key: str, name: str, folder: str | None) -> None:
    """A ConfigError of ``key`` unless ``folder`` holds what model reward ``name`` loads."""
    if folder is None:
        raise ConfigError(key, None, f"set the local model folder of reward {name}")
    problem = MODEL_REWARDS[name].folder_problem(Path(folder))
    if problem is not None:
        raise ConfigError(key, folder, problem)
