"""Clients of the reward servers FlowGRPO users already run, in their wire format: Python pickle over HTTP.

FlowGRPO's ``flow_grpo/rewards.py`` (yifan123/flow_grpo at ac4c86e) posts, per chunk of at most 64 images
(``np.array_split`` into ``ceil(B / 64)`` near-equal chunks), ``pickle.dumps(dict)`` to the server's URL and reads
``pickle.loads(answer)``; each image travels as JPEG bytes, PIL's default quality (75), from 8-bit RGB:

    geneval               (rewards.py:160-229; server yifan123/reward-server app_geneval.py)
        request  {"images": [B JPEG bytes], "meta_datas": [B dicts], "only_strict": bool}
        answer   {"scores": [B], "rewards": [B], "strict_rewards": [B], "group_rewards": {tag: [B]},
                  "group_strict_rewards": {tag: [B]}}
        reward   scores: the partial score of the detector's checks (rewards.py:383-393 weights ``scores``;
                 reward_server/gen_eval.py evaluate_reward), the strict and non-strict accuracies are details
    deqa                  (rewards.py:111-158; server app_deqa.py)
        request  {"images": [B JPEG bytes]}          answer {"outputs": [B]}   (DeQA-Score / 5)
    unifiedreward_remote  (rewards.py:231-282; its server is not public)
        request  {"images": [B JPEG bytes], "prompts": [B strings]}            answer {"outputs": [B]}

``meta_datas`` are the prompts' records (``lean.config.prompts.MetadataPrompt``: each line of GenEval's
``*_metadata.jsonl``, as FlowGRPO's ``GenevalPromptDataset`` passes them). FlowGRPO sends UnifiedReward's prompts as a
numpy array of strings; this client sends a list (the same items; no numpy needed to read it).

Unpickling runs whatever the pickle names, so answers are read by :class:`AnswerUnpickler`, which builds builtin
containers, numbers and strings and numpy arrays and scalars, and refuses every other global (one
:class:`RewardServerError` line, not retried). Requests are pickled by this process (protocol 4, which Python >= 3.4
reads). Retries, time-outs and errors are :func:`lean.rewards.http.post_with_retries`'s: an answer that is not a
pickle or lacks ``B`` numbers under its key is retried; FlowGRPO's servers answer a failure with HTTP 500 and the
traceback, retried too.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from lean.config import ConfigError, check_choice
from lean.config.prompts import prompt_metadata
from lean.rewards.base import REWARDS, over_frames
from lean.rewards.builtin import to_uint8
from lean.rewards.http import RewardServerError, post_with_retries

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.rewards.options import PickleServerConfig

# What an answer may name besides the pickle opcodes' own builtins: containers, and numpy arrays and scalars (numpy 1
# and 2 spell their module differently). An object array's items are unpickled by the same unpickler.
ALLOWED_GLOBALS = frozenset(
    {("builtins", name) for name in ("set", "frozenset", "bytearray", "complex", "slice")}
    | {("collections", "OrderedDict")}
    | {(f"numpy.{core}.multiarray", name) for core in ("core", "_core") for name in ("_reconstruct", "scalar")}
    | {("numpy", "ndarray"), ("numpy", "dtype")}
)


class ForbiddenGlobal(pickle.UnpicklingError):
    """An answer names a global the unpickler does not build."""


class AnswerUnpickler(pickle.Unpickler):
    """Builds only builtin containers, numbers, strings and numpy arrays (:data:`ALLOWED_GLOBALS`)."""

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise ForbiddenGlobal(f"{module}.{name}")
        return super().find_class(module, name)


def load_answer(answer: bytes):
    """The unpickled answer; ``ValueError`` when it is not a pickle, :class:`ForbiddenGlobal` when it names a global
    outside :data:`ALLOWED_GLOBALS`."""
    try:
        return AnswerUnpickler(io.BytesIO(answer)).load()
    except ForbiddenGlobal:
        raise
    except Exception as err:  # UnpicklingError, EOFError, and what a corrupt stream makes the opcodes raise
        raise ValueError(f"the answer is not a pickle ({type(err).__name__}): {answer[:80]!r}") from None


def encode_jpeg(image: np.ndarray) -> bytes:
    """uint8 [H, W, 3] -> JPEG bytes, as FlowGRPO's clients write them (PIL's default quality)."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG")
    return buffer.getvalue()


def chunks(count: int, batch_size: int) -> list[np.ndarray]:
    """The indices of each request: ``np.array_split(range(count), ceil(count / batch_size))``, FlowGRPO's split."""
    return np.array_split(np.arange(count), math.ceil(count / batch_size))


def scores_under(answer, key: str, count: int) -> Tensor:
    """float64 [count] from ``answer[key]``; ``ValueError`` unless the answer is a dict holding ``count`` numbers
    there (a list, tuple or 1-d numpy array)."""
    if not isinstance(answer, dict) or key not in answer:
        raise ValueError(f"need a dict with {key!r}, got {str(answer)[:80]}")
    values = answer[key]
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()
    numeric = isinstance(values, (list, tuple)) and all(
        isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) for v in values
    )
    if not numeric or len(values) != count:
        raise ValueError(f"need {count} numbers under {key!r}, got {str(values)[:80]}")
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


# ---------------------------------------------------------------- the three servers


def geneval_request(jpegs: list[bytes], prompts: list[str], settings: PickleServerConfig) -> dict:
    """rewards.py:199-203: the images, each prompt's metadata record, and ``only_strict``."""
    problem = metadata_problem(prompts)
    if problem is not None:
        raise ValueError(problem)
    return {"images": jpegs, "meta_datas": [prompt_metadata(p) for p in prompts], "only_strict": settings.only_strict}


def deqa_request(jpegs: list[bytes], prompts: list[str], settings: PickleServerConfig) -> dict:
    """rewards.py:145-147: the images alone (DeQA scores quality, not the prompt)."""
    return {"images": jpegs}


def unifiedreward_request(jpegs: list[bytes], prompts: list[str], settings: PickleServerConfig) -> dict:
    """rewards.py:266-269: the images and their prompts."""
    return {"images": jpegs, "prompts": [str(p) for p in prompts]}


@dataclass(frozen=True)
class PickleProtocol:
    """One server's wire format: what a request holds, and which list of the answer is the reward."""

    request: Callable[[list[bytes], list[str], PickleServerConfig], dict]
    reward_key: str


PROTOCOLS: dict[str, PickleProtocol] = {
    "geneval": PickleProtocol(geneval_request, "scores"),
    "deqa": PickleProtocol(deqa_request, "outputs"),
    "unifiedreward_remote": PickleProtocol(unifiedreward_request, "outputs"),
}


def metadata_problem(prompts: list[str]) -> str | None:
    """Why GenEval's server cannot score these prompts (one line), or None: each needs its record with a ``tag``."""
    for prompt in prompts:
        metadata = prompt_metadata(prompt)
        if not isinstance(metadata, dict) or "tag" not in metadata:
            return (
                f"prompt {str(prompt)[:60]!r} has no GenEval metadata: read the prompts from GenEval's "
                f"*_metadata.jsonl (train.prompts_file), whose lines carry tag and include"
            )
    return None


def check_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """Every ``reward.pickle_servers`` key is one of FlowGRPO's servers, a weighted server reward has its entry, and
    GenEval's scores prompts with metadata (the training prompts and the eval prompts)."""
    r = cfg.reward
    for name in r.pickle_servers:
        check_choice("reward.pickle_servers key", name, PROTOCOLS)
    for name, weight in r.weights.items():
        if name in PROTOCOLS and name not in r.pickle_servers and name not in r.remote and name not in REWARDS:
            raise ConfigError(
                f"reward.weights.{name}",
                weight,
                f"{name} is FlowGRPO's server: set reward.pickle_servers.{name}.url and .allow_pickle",
            )
    if "geneval" not in r.pickle_servers or "geneval" not in r.weights:
        return
    for key, section in (("train", cfg.train), ("eval", cfg.eval)):
        problem = None if section.prompts is None else metadata_problem(section.prompts)
        if problem is not None:
            raise ConfigError(f"{key}.prompts_file", section.prompts_file, problem)


# ---------------------------------------------------------------- client


class PickleServerReward:
    """A reward computed by FlowGRPO's server ``name`` (a key of :data:`PROTOCOLS`) at ``settings.url``."""

    def __init__(self, name: str, settings: PickleServerConfig):
        self.name, self.settings, self.protocol = name, settings, PROTOCOLS[name]
        self.what = f"reward {name}"

    def parse(self, answer: bytes, count: int) -> Tensor:
        """The reward of one answer; a forbidden global stops at once (another attempt would not be safer)."""
        try:
            loaded = load_answer(answer)
        except ForbiddenGlobal as err:
            raise RewardServerError(
                f"{self.what}: server {self.settings.url}: the answer names {err}, which the restricted unpickler "
                "refuses (it builds only containers, numbers, strings and numpy arrays)"
            ) from None
        return scores_under(loaded, self.protocol.reward_key, count)

    def score_images(self, images: Tensor, prompts: list[str]) -> Tensor:
        """[B, 3, H, W] -> float64 [B], one request per chunk of ``settings.batch_size``."""
        jpegs = [encode_jpeg(a) for a in to_uint8(images)]
        scores = []
        for index in chunks(len(jpegs), self.settings.batch_size):
            request = self.protocol.request([jpegs[i] for i in index], [prompts[i] for i in index], self.settings)
            body = pickle.dumps(request, protocol=4)
            headers = {"Content-Type": "application/octet-stream"}
            scores.append(
                post_with_retries(
                    self.what, self.settings.url, body, headers, self.settings, lambda a, n=len(index): self.parse(a, n)
                )
            )
        return torch.cat(scores)

    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        return over_frames(self.score_images, images, prompts)
