"""The ``reward`` section: the weighted rewards, what is decoded, and the model rewards', remote rewards' and VLM
judges' settings (registered with ``lean.config.sections``; a reward's own options would be a group registered under
``reward.<name>``)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from lean.config.checks import ConfigError, check_positive, choice, choices
from lean.config.dtypes import DTYPES
from lean.config.sections import register_options
from lean.rewards.http import RetryOptions
from lean.rewards.judge_templates import VLMJudgeConfig


@dataclass
class RewardModelConfig:
    """``reward.models.<name>``: where a model reward (``lean.rewards.MODEL_REWARDS``) loads from and how it runs."""

    folder: str | None = None
    """A local model folder (the layout each reward needs: ``lean.rewards.models``, docs/rewards.md)."""
    batch_size: int = 32
    """Images (video frames) per forward."""
    dtype: str = choice("dtype", DTYPES.default)
    """What the reward model computes in: a name of ``lean.config.dtypes.DTYPES``."""
    device: str | None = None
    """Where it runs (``cuda:1``, ``cpu``); None: the run's device."""

    def validate(self, key: str) -> None:
        """The fields alone; the folder's files are checked by the reward (``lean.rewards.check_config``)."""
        check_positive(f"{key}.batch_size", self.batch_size)
        choices(self, key)


@dataclass
class RemoteRewardConfig(RetryOptions):
    """``reward.remote.<name>``: the reward is computed by a ``lean reward serve`` server (``lean.rewards.remote``)."""

    url: str = ""
    """The server's base URL, e.g. http://10.0.0.5:8100 (the client posts to <url>/score)."""
    token_env: str | None = None
    """An environment variable holding the server's bearer token (None: no token)."""

    def validate(self, key: str) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"{key}.url", self.url, "must be an http:// or https:// URL of a lean reward server")
        if self.token_env is not None and not os.environ.get(self.token_env):
            raise ConfigError(f"{key}.token_env", self.token_env, "this environment variable is not set")
        self.validate_retries(key)


@dataclass
class PickleServerConfig(RetryOptions):
    """``reward.pickle_servers.<name>``: the reward is computed by one of FlowGRPO's own reward servers, which speak
    Python pickle over HTTP (``lean.rewards.pickle_servers``; ``<name>``: geneval, deqa, unifiedreward_remote).

    Unpickling what a server sends can run any code it chooses, so the client needs ``allow_pickle`` and a loopback
    address (or the host named in ``allow_host``), and unpickles answers with a restricted unpickler."""

    url: str = ""
    """Where the server listens; the client posts to this URL as it is (FlowGRPO's defaults: GenEval
    http://127.0.0.1:18085, DeQA http://127.0.0.1:18086)."""
    allow_pickle: bool = False
    """The opt-in: true accepts that the server's answers are pickles (read by a restricted unpickler)."""
    allow_host: str | None = None
    """A host other than loopback that you trust to answer pickles: the URL's host exactly (None: loopback only)."""
    batch_size: int = 64
    """Images per request (FlowGRPO's 64; the batch is split into near-equal parts as np.array_split does)."""
    only_strict: bool = True
    """GenEval only: the server skips its non-strict check (FlowGRPO's training requests; the reward, ``scores``, is
    the same either way)."""

    def validate(self, key: str) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"{key}.url", self.url, "must be the http:// URL of the reward server")
        if not self.allow_pickle:
            raise ConfigError(
                f"{key}.allow_pickle", False, "this server answers in pickle, which can run code here: set it true"
            )
        host = urlsplit(self.url).hostname or ""
        if host != self.allow_host and not is_loopback(host):
            raise ConfigError(
                f"{key}.url",
                self.url,
                f"{host} is not loopback; a pickle server elsewhere can run code here: "
                f"name it in {key}.allow_host to trust it",
            )
        check_positive(f"{key}.batch_size", self.batch_size)
        self.validate_retries(key)


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1 (a name other than localhost is not resolved: it could point anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@register_options("reward")
@dataclass
class RewardConfig:
    """What a sample scores: a weighted sum of registered rewards (``lean.rewards``)."""

    weights: dict[str, float] = field(default_factory=lambda: {"color_match": 1.0})
    """reward name (``lean.rewards.REWARDS`` or ``MODEL_REWARDS``, or one of ``remote`` or ``judges``) -> weight."""
    decode: str = choice("decode target")
    """What is decoded and scored: a name of ``lean.sampling.rollout.DECODE_TARGETS`` (the final sample, or DanceGRPO's
    prediction of x_0 at the last step)."""
    async_scoring: bool = True
    """Decode and score each rollout micro-batch in a worker thread while the next one rolls out
    (``lean.run.async_scoring``); false: score each micro-batch after the rollout, in the training thread. The rewards
    are the same."""
    models: dict[str, RewardModelConfig] = field(default_factory=dict)
    """model reward name -> its folder, batch size, dtype and device; every entry's folder is checked (but for a
    reward ``remote`` names: ``lean reward serve`` checks it on the server)."""
    remote: dict[str, RemoteRewardConfig] = field(default_factory=dict)
    """reward name -> the server that computes it (the name need not be registered in this process)."""
    pickle_servers: dict[str, PickleServerConfig] = field(default_factory=dict)
    """FlowGRPO's server reward name (geneval, deqa, unifiedreward_remote) -> the server that computes it."""
    judges: dict[str, VLMJudgeConfig] = field(default_factory=dict)
    """reward name (your choice, e.g. unifiedreward) -> a VLM judge at an OpenAI-compatible chat endpoint
    (``lean.rewards.judge_templates``, ``lean.rewards.vlm_judge``)."""

    def validate(self) -> None:
        """The fields alone; which rewards exist and what their folders hold is ``lean.rewards.check_config``'s."""
        choices(self, "reward")
        if not self.weights:
            raise ConfigError("reward.weights", self.weights, "name at least one reward")
        for name, remote in self.remote.items():
            remote.validate(f"reward.remote.{name}")
        for name, server in self.pickle_servers.items():
            server.validate(f"reward.pickle_servers.{name}")
        for name, entry in self.models.items():
            entry.validate(f"reward.models.{name}")
        for name, judge in self.judges.items():
            if name in self.remote:
                raise ConfigError(f"reward.judges.{name}", name, "is also under reward.remote: name it in one")
            judge.validate(f"reward.judges.{name}")
