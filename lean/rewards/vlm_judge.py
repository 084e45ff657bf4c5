"""VLM judges over the OpenAI chat API: each image and a prompt template, filled with the sample's prompt, go to any
OpenAI-compatible endpoint (vLLM, SGLang, ``lean reward serve --vlm``) and a score is parsed from the answer.

One request per image, ``concurrency`` of them in flight (a thread pool):

    POST <base_url>/v1/chat/completions
    {"model": m, "temperature": t, "max_tokens": n,
     "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                                               {"type": "text", "text": question with p}]}],
     "structured_outputs": {"choice": [...]}}    (only when set: vLLM's constrained decoding, lean's server's too)
    -> {"choices": [{"message": {"content": "... Final Score: 4"}}]}

The score is the first group of the template's ``pattern`` in the answer, a number in [low, high]; the reward is
``s / high`` (``normalise: max``, FlowGRPO's), ``(s - low) / (high - low)`` (``range``) or ``s`` (``none``). An
answer without a score in range is retried like a refused connection (:func:`lean.rewards.http.post_with_retries`),
then the run stops with one RewardServerError line naming the endpoint (FlowGRPO scores it 0 instead:
``unparseable_score: 0``).

The templates and the options are in ``lean.rewards.judge_templates``.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from lean.rewards.base import over_frames
from lean.rewards.builtin import to_uint8
from lean.rewards.http import json_headers, post_with_retries
from lean.rewards.judge_templates import JUDGE_TEMPLATES, parse_score
from lean.rewards.remote import encode_png

if TYPE_CHECKING:
    from lean.rewards.judge_templates import VLMJudgeConfig


def data_url(image: Tensor, size: int | None) -> str:
    """float [3, H, W] in [0, 1] -> a base64 PNG data URL, resized to size x size (PIL's default filter,
    as FlowGRPO's)."""
    picture = Image.fromarray(to_uint8(image[None])[0])
    if size is not None:
        picture = picture.resize((size, size))
    return "data:image/png;base64," + encode_png(np.asarray(picture))


def answer_text(answer: bytes) -> str:
    """The message content of a chat completion; ValueError unless it is one."""
    try:
        content = json.loads(answer)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"the answer is not a chat completion: {answer[:80]!r}") from None
    if not isinstance(content, str):
        raise ValueError(f"the answer's message content is not text: {str(content)[:80]}")
    return content


def chat_request(settings: VLMJudgeConfig, images: list[Tensor], text: str, size: int | None) -> bytes:
    """One user turn of ``images`` [3, H, W] (in order) and then ``text``, as a chat completion request of the
    endpoint ``settings`` (its model, temperature, max_tokens and allowed answers)."""
    content = [{"type": "image_url", "image_url": {"url": data_url(image, size)}} for image in images]
    content.append({"type": "text", "text": text})
    body = {"model": settings.model, "messages": [{"role": "user", "content": content}]}
    body |= {"temperature": settings.temperature, "max_tokens": settings.max_tokens}
    if settings.guided_choice is not None:
        choices = list(settings.guided_choice)
        field = settings.guided_choice_field
        body[field] = {"choice": choices} if field == "structured_outputs" else choices
    return json.dumps(body).encode()


class VLMJudge:
    """A reward scored by a VLM at an OpenAI-compatible chat endpoint: float64 [B] (videos: the mean over frames)."""

    def __init__(self, name: str, settings: VLMJudgeConfig):
        self.name, self.settings = name, settings
        self.template = JUDGE_TEMPLATES[settings.template]
        self.question = settings.prompt if settings.prompt is not None else self.template.text
        self.image_size = settings.image_size if settings.image_size is not None else self.template.image_size

    def request(self, image: Tensor, prompt: str) -> bytes:
        """The chat completion request of one image [3, H, W] and its prompt."""
        return chat_request(self.settings, [image], self.question.replace("{prompt}", prompt), self.image_size)

    def parse(self, answer: bytes) -> float:
        """The normalised score of one answer (see the module docstring)."""
        text = answer_text(answer)
        try:
            score = parse_score(text, self.template)
        except ValueError:
            if self.settings.unparseable_score is None:
                raise
            return self.settings.unparseable_score
        low, high = self.template.low, self.template.high
        return {"max": score / high, "range": (score - low) / (high - low), "none": score}[self.settings.normalise]

    def score_one(self, image: Tensor, prompt: str) -> float:
        body, headers = self.request(image, prompt), json_headers(self.settings.api_key_env)
        return post_with_retries(f"reward {self.name}", self.settings.url, body, headers, self.settings, self.parse)

    def score_images(self, images: Tensor, prompts: list[str]) -> Tensor:
        pool = ThreadPoolExecutor(max_workers=min(self.settings.concurrency, len(prompts)))
        try:
            scores = list(pool.map(self.score_one, images.cpu(), prompts))
        finally:  # after a failure, the requests not yet sent are dropped
            pool.shutdown(cancel_futures=True)
        return torch.tensor(scores, dtype=torch.float64)

    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        return over_frames(self.score_images, images, prompts)
