"""Group-wise rewards: Pref-GRPO's pairwise win rate inside a group, and the pairwise judges it asks.

Pref-GRPO (CodeGoat24/Pref-GRPO at 3e787f6, ``fastvideo/rewards/unifiedreward_think.py``) scores the G samples of one
prompt together: every unordered pair (i, j), i < j, is shown once to a pairwise judge, the earlier sample first
(``itertools.combinations``, lines 84-94: no self-pair, no pair in both orders); the preferred sample gets a win, a tie
or an unparseable verdict half a win each (lines 43-52); a sample's reward is its wins over its comparisons, G - 1
(lines 54-62; 0 for a group of one). The reward is then normalised inside the group as any other
(``fastvideo/rewards/dispatcher.py:628-641``: (r - mean) / (std + 1e-8), torch's unbiased std; lean's
``algorithm.std_estimator: unbiased`` with ``algorithm.adv_eps: 1e-8``) and clamped (``train_flux.py:723-727``).

    win_rate_i = (1 / (G - 1)) Σ_{j != i} c_ij        c_ij = credit of i against j, c_ij + c_ji = 1

``reward.win_rate.credit``: ``verdict`` (Pref-GRPO's: c_ij = 1 if P(i preferred) > 1/2, 0 if < 1/2, 1/2 on a tie) or
``probability`` (the expected wins, c_ij = P(i preferred)). Pref-GRPO rounds the rate to 3 decimals (line 56); lean
keeps it exact (the float64 certificate compares gradients to 1e-10).

A judge (:data:`JUDGES`, ``reward.win_rate.judge``) answers, for a group's pairs, P(first preferred | prompt): a
:class:`PairwiseJudge`. ``bradley_terry`` is built from any per-sample reward (``reward.win_rate.judge_reward``: a
registered, model or served one): P = sigmoid((r_first - r_second) / temperature), each image scored once.
``unifiedreward_think`` is Pref-GRPO's: a VLM at an OpenAI-compatible chat endpoint (the entry of ``reward.judges``
that ``reward.win_rate.judge_endpoint`` names: vLLM serving UnifiedReward-Think as Pref-GRPO's
vllm_utils/vllm_server_UnifiedReward_Think.sh does, or ``lean reward serve --vlm FOLDER`` on a local copy) is sent, per
pair, both images and the question ``PAIRWISE_TEMPLATES["unifiedreward_think"]`` (the pair's first as Image 1,
vllm_request.py:78-91), one request per pair, and its ``<answer>`` read as a win, a loss or a tie
(``lean.rewards.judge_templates.parse_verdict``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.config import ConfigError
from lean.config.checks import check_positive, choice, choices
from lean.config.registry import Registry
from lean.config.sections import register_options
from lean.rewards.base import GroupReward, RewardFn, check_model_entry, register_group, reward_names
from lean.rewards.http import json_headers, post_with_retries
from lean.rewards.judge_templates import PAIRWISE_TEMPLATES, parse_verdict
from lean.rewards.vlm_judge import answer_text, chat_request

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.rewards.options import RewardConfig

WIN_CREDITS: Registry[str] = Registry(
    "win credit",
    [
        ("verdict", "1 to the preferred sample, 1/2 each on a tie (Pref-GRPO's count of wins)"),
        ("probability", "P(preferred) to each sample of the pair: the expected wins"),
    ],
)


class PairwiseJudge:
    """Compares the samples of one group two by two: :meth:`prefer` -> P(first preferred) per pair."""

    def prefer(self, images: Tensor, pairs: Tensor, prompt: str) -> Tensor:
        """float64 [P] in [0, 1]: for each row (first, second) of ``pairs`` (long [P, 2], indices into ``images``
        [G, 3, H, W] or [G, 3, F, H, W]), the probability that ``images[first]`` is preferred for ``prompt``."""
        raise NotImplementedError


# a judge is built from the reward section (its reward.win_rate options, reward.judges) and the per-sample rewards
JUDGES: Registry[Callable[[RewardConfig, Callable[[str], RewardFn]], PairwiseJudge]] = Registry("pairwise judge")


@JUDGES.register("bradley_terry")
class BradleyTerryJudge(PairwiseJudge):
    """The Bradley-Terry preference of a per-sample reward: P(i over j) = sigmoid((r_i - r_j) / temperature)."""

    def __init__(self, cfg: RewardConfig, pointwise: Callable[[str], RewardFn]):
        options = cfg.win_rate
        self.reward, self.temperature = pointwise(options.judge_reward), options.temperature

    def prefer(self, images: Tensor, pairs: Tensor, prompt: str) -> Tensor:
        r = self.reward(images, [prompt] * len(images)).cpu().to(torch.float64)
        return torch.sigmoid((r[pairs[:, 0]] - r[pairs[:, 1]]) / self.temperature)


@JUDGES.register("unifiedreward_think")
class ChatPairwiseJudge(PairwiseJudge):
    """A VLM at an OpenAI-compatible chat endpoint asked which of two images is better (module docstring)."""

    def __init__(self, cfg: RewardConfig, pointwise: Callable[[str], RewardFn]):
        self.endpoint, self.settings = cfg.win_rate.judge_endpoint, cfg.judges[cfg.win_rate.judge_endpoint]
        self.template_name = cfg.win_rate.judge
        self.template = PAIRWISE_TEMPLATES[self.template_name]

    def prefer_one(self, first: Tensor, second: Tensor, prompt: str) -> float:
        """P(first preferred) of one pair: 1, 0 or 1/2 from the judge's answer."""
        s = self.settings
        body = chat_request(s, [first, second], self.template.text.replace("{prompt}", prompt), s.image_size)
        what, headers = f"reward win_rate ({self.endpoint})", json_headers(s.api_key_env)
        return post_with_retries(what, s.url, body, headers, s, lambda a: parse_verdict(answer_text(a), self.template))

    def prefer(self, images: Tensor, pairs: Tensor, prompt: str) -> Tensor:
        if images.dim() != 4:  # Pref-GRPO's video judge samples frames from files (cal_win_rate_videos): not built
            raise ValueError(f"reward.win_rate.judge={self.template_name}: compares images, got {list(images.shape)}")
        images = images.cpu()
        with ThreadPoolExecutor(max_workers=min(self.settings.concurrency, len(pairs))) as pool:
            verdicts = pool.map(lambda pair: self.prefer_one(images[pair[0]], images[pair[1]], prompt), pairs.tolist())
            return torch.tensor(list(verdicts), dtype=torch.float64)


def group_pairs(size: int) -> Tensor:
    """long [G (G - 1) / 2, 2]: every unordered pair (i, j) with i < j once, in Pref-GRPO's order."""
    return torch.combinations(torch.arange(size), 2).reshape(-1, 2)


def win_rates(preferred: Tensor, pairs: Tensor, size: int, credit: str) -> Tensor:
    """float64 [G]: each sample's wins over its G - 1 comparisons (0 for a group of one); ``preferred`` [P] is
    P(first preferred) of each row of ``pairs``, turned into credits by ``credit`` (:data:`WIN_CREDITS`)."""
    p = preferred.to(torch.float64)
    first = p if credit == "probability" else (p > 0.5).to(torch.float64) + 0.5 * (p == 0.5)
    wins = torch.zeros(size, dtype=torch.float64)
    wins.index_add_(0, pairs[:, 0], first).index_add_(0, pairs[:, 1], 1 - first)
    return wins / max(size - 1, 1)


@register_group("win_rate")
class PairwiseWinRate(GroupReward):
    """Pref-GRPO's reward: each sample's win rate against the others of its group, as ``reward.win_rate.judge``
    prefers them (module docstring)."""

    def __init__(self, cfg: RewardConfig, pointwise: Callable[[str], RewardFn]):
        super().__init__(cfg, pointwise)
        self.options: WinRateConfig = cfg.win_rate
        self.judge = JUDGES[self.options.judge](cfg, pointwise)

    @classmethod
    def check_config(cls, name: str, cfg: RunConfig, world_size: int | None) -> None:
        """Whole groups (:class:`GroupReward`), and a per-sample reward for the Bradley-Terry judge to compare."""
        super().check_config(name, cfg, world_size)
        options, key = cfg.reward.win_rate, "reward.win_rate.judge_reward"
        if options.judge in PAIRWISE_TEMPLATES:  # a chat judge: its endpoint is an entry of reward.judges
            if options.judge_endpoint not in cfg.reward.judges:
                known = ", ".join(cfg.reward.judges) or "none"
                why = f"name the reward.judges entry (base_url, model) the {options.judge} judge asks; known: {known}"
                raise ConfigError("reward.win_rate.judge_endpoint", options.judge_endpoint, why)
            return
        if options.judge != "bradley_terry":
            return
        if options.judge_reward is None:
            raise ConfigError(key, None, "name the per-sample reward the bradley_terry judge compares")
        known = reward_names()
        if options.judge_reward not in [*known, *cfg.reward.remote]:
            why = "must be a per-sample reward (registered or in reward.remote); known: " + ", ".join(sorted(known))
            raise ConfigError(key, options.judge_reward, why)
        check_model_entry(cfg, options.judge_reward)

    def score_group(self, images: Tensor, prompt: str) -> Tensor:
        pairs = group_pairs(len(images))
        preferred = self.judge.prefer(images, pairs, prompt) if len(pairs) else torch.zeros(0, dtype=torch.float64)
        return win_rates(preferred, pairs, len(images), self.options.credit)


@register_options("reward.win_rate")
@dataclass
class WinRateConfig:
    """``reward.win_rate``: the pairwise win rate's judge and credit (``lean.rewards.groupwise``), read only when
    ``reward.weights`` names ``win_rate``."""

    judge: str = choice("pairwise judge")
    """Who compares two samples: a name of ``lean.rewards.groupwise.JUDGES``."""
    judge_reward: str | None = None
    """The per-sample reward the ``bradley_terry`` judge compares (registered, a model reward, or served)."""
    judge_endpoint: str | None = None
    """The entry of ``reward.judges`` (base_url, model, max_tokens, ...) a chat judge (``unifiedreward_think``) asks;
    its template is the judge's own (``lean.rewards.judge_templates.PAIRWISE_TEMPLATES``)."""
    temperature: float = 1.0
    """The Bradley-Terry temperature: P(i over j) = sigmoid((r_i - r_j) / temperature)."""
    credit: str = choice("win credit")
    """How a preference counts: a name of ``lean.rewards.groupwise.WIN_CREDITS`` (verdict: Pref-GRPO's)."""

    def validate(self, prefix: str) -> None:
        choices(self, prefix)
        check_positive(f"{prefix}.temperature", self.temperature)
