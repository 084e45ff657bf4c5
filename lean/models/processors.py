"""Multimodal processor folders of a pipeline (``FamilySpec.processors``): Qwen-Image-Edit's ``processor``, a
transformers ``Qwen2VLProcessor`` that writes the reference image into the prompt (its ``<|image_pad|>`` expanded to
one token per merged 28x28 patch) and turns the image into the vision tower's patches; or an image processor alone
(Wan2.1 image-to-video's ``image_processor``, a ``CLIPImageProcessor`` whose ``processor_class`` is its own
``image_processor_class``: :func:`is_image_processor`), which prepares the conditioning image for an image encoder.

A folder holds the processor's two parts, as ``ProcessorMixin.save_pretrained`` writes them: the tokenizer's files
and the image processor's ``preprocessor_config.json``. lean builds the processor object from those parts
(:func:`make_processor`) with the class's own ``__init__`` and ``__call__``, skipping one thing: the constructor's
class check of the video processor, which in transformers 5 exists only with torchvision (the Qwen2VL video
processor is torchvision's). Images are never videos here, so the processor runs without one, on the image
processor's PIL backend where torchvision is absent; the same object serves the diffusers pipeline (``lean sample``
passes it as the pipeline's ``processor``), so both prepare the reference alike. Its ``save_pretrained`` writes the
two parts (the class's own would save the missing video processor).
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

from lean.models.spec import Processor


def is_image_processor(spec: Processor) -> bool:
    """The folder is an image processor alone (no tokenizer): its class is its image processor's."""
    return spec.processor_class == spec.image_processor_class


def make_processor(spec: Processor, tokenizer, image_processor):
    """An instance of ``spec.processor_class`` over ``tokenizer`` and ``image_processor`` (no video processor)."""
    cls = getattr(importlib.import_module("transformers"), spec.processor_class)
    processor = cls.__new__(cls)
    processor.check_argument_for_proper_class = lambda name, value: None  # the video processor's check: see above
    try:
        cls.__init__(processor, image_processor=image_processor, tokenizer=tokenizer, video_processor=None)
    finally:
        del processor.check_argument_for_proper_class
    processor.save_pretrained = functools.partial(save_processor, processor)
    return processor


def random_processor(spec: Processor, tokenizer):
    """A random build's processor: lean's tokenizer and an image processor of the published arguments (the image
    processor alone where the folder is one)."""
    transformers = importlib.import_module("transformers")
    image_processor = getattr(transformers, spec.image_processor_class)(**spec.image_processor)
    return image_processor if is_image_processor(spec) else make_processor(spec, tokenizer, image_processor)


def load_processor(spec: Processor, folder: str | Path):
    """The processor saved in ``folder`` (by lean, or by transformers: the published pipeline's)."""
    transformers = importlib.import_module("transformers")
    image_processor = getattr(transformers, spec.image_processor_class).from_pretrained(folder)
    if is_image_processor(spec):
        return image_processor
    return make_processor(spec, transformers.AutoTokenizer.from_pretrained(folder), image_processor)


def save_processor(processor, folder: str | Path, **kwargs) -> None:
    """The processor's tokenizer and image processor into ``folder`` (``kwargs``: diffusers' save arguments)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    processor.tokenizer.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)
