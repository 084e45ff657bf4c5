"""Qwen-Image-Edit's sizes: Qwen-Image's (:mod:`lean.models.qwen_image.sizes`), each with the resolution its
reference image is encoded at.

Qwen/Qwen-Image-Edit's ``transformer/config.json``, ``vae/config.json`` and ``text_encoder/config.json`` are Qwen/Qwen-
Image's (the same QwenImageTransformer2DModel, 20.4B parameters, fine-tuned; the same Qwen2.5-VL-7B-Instruct, whose
vision tower now sees the reference). The pipeline encodes the reference at ``calculate_dimensions(1024 * 1024,
w / h)``: 1024 x 1024 for the square references lean makes (FlowGRPO first resizes them to 512 x 512,
train_qwenimage_edit.py:614, then the pipeline to 1024 x 1024, qwenimage_edit_pipeline_with_logprob.py:40-41,76-79;
at 9745241), whatever the samples' resolution. The smaller sizes keep the published ratio to their samples'
resolution instead (twice the side: tiny 32 px samples, 64 px references), so that a CPU build stays small: a 64 px
reference is 64 VAE tokens (4x VAE) and 4 vision tokens (the image processor's 56 x 56 floor).

The processor's image processor (``SPEC.processors``) takes Qwen2.5-VL-7B-Instruct's ``preprocessor_config.json``
(written from memory): 14 px patches, 2x2 merged, 2 frames per temporal patch, between 56^2 and 12845056 pixels,
OpenAI CLIP's mean and std.
"""

from __future__ import annotations

import dataclasses

from lean.models.qwen_image.sizes import SIZES as QWEN_IMAGE_SIZES

REFERENCE_RESOLUTION = {"tiny": 64, "small": 512, "full": 1024}  # full: the pipeline's calculate_dimensions(1024^2, 1)

SIZES = {
    name: dataclasses.replace(size, reference_resolution=REFERENCE_RESOLUTION[name])
    for name, size in QWEN_IMAGE_SIZES.items()
}

IMAGE_PROCESSOR = dict(  # Qwen/Qwen-Image-Edit processor/preprocessor_config.json (Qwen2.5-VL-7B-Instruct's)
    min_pixels=56 * 56,
    max_pixels=12845056,
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
)
