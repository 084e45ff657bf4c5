"""Qwen-Image-Edit's runtime (:class:`QwenImageEdit`): Qwen-Image (:class:`lean.models.qwen_image.QwenImage`: packing,
VAE normalisation, the transformer call, decoding) conditioned on a reference image twice, as diffusers'
``QwenImageEditPipeline`` runs it (diffusers 0.42, pipelines/qwenimage/pipeline_qwenimage_edit.py) and FlowGRPO samples
it (flow_grpo/diffusers_patch/qwenimage_edit_pipeline_with_logprob.py, yifan123/flow_grpo 9745241 read through its
zhtmike mirror).

Text conditioning (``encode_text``): prompt p and its reference image I (a PIL image at the family's reference
resolution, ``Size.reference_resolution``) go through the processor (``lean.models.processors``: Qwen2VLProcessor),
which formats T(p) (:data:`PROMPT_TEMPLATE`, the pipeline's ``prompt_template_encode``), replaces its one
``<|image_pad|>`` by n_I = (H/28)(W/28) pads (one per merged 2x2 group of 14 px patches of I, resized by the image
processor to multiples of 28) and gives I's patches to Qwen2.5-VL's vision tower, whose outputs replace the pads'
embeddings. With h the language model's last hidden states and d the tokens of the template before
``<|vision_start|>`` (its system turn; the pipeline's ``prompt_template_encode_start_idx`` = 64 for the real Qwen2
tokenizer, counted here with the tokenizer in use, as :mod:`lean.models.qwen_image` counts its 34):

    tokens = h[d:]   = [<|vision_start|>, n_I image states, <|vision_end|>, p's tokens, the assistant turn's]

all kept (mask 1): the transformer attends to the image's VL states as text. The pipeline's ``encode_prompt`` takes no
``max_sequence_length`` cut, so neither does lean: ``model.text_max_length`` does not shorten an edit's conditioning.
The pipeline passes the processor's ``input_ids``, ``attention_mask``, ``pixel_values`` and ``image_grid_thw`` and
not its ``mm_token_type_ids``, without which transformers 5's Qwen2.5-VL gives every token a 1-D position (it builds
3-D multimodal RoPE positions only from those type ids); lean passes the same, so it conditions as the diffusers
pipeline does in this environment (and ``lean sample`` samples alike).

Reference tokens (``encode_reference``): I in [-1, 1], one frame through the VAE, the latent distribution's mode
(``sample_mode="argmax"``), normalised per channel as the samples, packed 2x2: r ``[B, N_r, 64]``. The transformer
sees ``[x; r]`` with RoPE shapes ``img_shapes = [[(1, h/2, w/2), (1, h_r/2, w_r/2)]] * B`` (the second image's frame
index is 1) and the velocity is its first N output tokens. The reference carries no gradient and is encoded once per
prompt (``PromptEmbeds.reference``); CFG's negative branch is the negative prompt on the same image (the pipeline
encodes the negative prompt with the image too). The dynamic shift counts the noisy tokens only (the pipeline's
``image_seq_len = latents.shape[1]``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lean.models.qwen_image.model import QwenImage
from lean.models.text import PromptEmbeds, real_tokens

# QwenImageEditPipeline.prompt_template_encode (diffusers 0.42, pipelines/qwenimage/pipeline_qwenimage_edit.py)
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
)
VISION_START = "<|vision_start|>"
PIPELINE_PREFIX_TOKENS = 64  # QwenImageEditPipeline.prompt_template_encode_start_idx, for the real Qwen2 tokenizer


def prefix_tokens(tokenizer) -> int:
    """Tokens of the template before ``<|vision_start|>`` (the system turn the pipeline cuts), for ``tokenizer``."""
    prefix = PROMPT_TEMPLATE.split(VISION_START)[0]
    return len(tokenizer(prefix, add_special_tokens=False, verbose=False).input_ids)


class QwenImageEdit(QwenImage):
    """Qwen-Image-Edit geometry, conditioning and calls for a fixed resolution of the samples (the reference has its
    own, ``Size.reference_resolution``, read from the tokens it comes as)."""

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """Qwen2.5-VL's last hidden states of each edit (instruction + reference image) in the edit template, the
        system turn dropped (module docstring); ``max_length`` is not applied (the pipeline applies none). Without
        ``images`` (a text alone: the trainer caches the negative prompt so; no edit conditions on it) the template is
        tokenized as it is, its one ``<|image_pad|>`` an ordinary token (the processor refuses a pad without an
        image)."""
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} reference images for {len(prompts)} prompts")
        processor = tokenizers["processor"]
        drop = prefix_tokens(processor.tokenizer)
        texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
        if images is None:
            batch = processor.tokenizer(texts, padding=True, return_tensors="pt")
        else:
            batch = processor(text=texts, images=list(images), padding=True, return_tensors="pt")
        encoder = encoders["text_encoder"]
        vision = {}
        # On the meta device (lean plan at the published size) the vision tower cannot run (it reads its patch grid
        # back, grid_thw.tolist()): the image's pads are embedded as tokens, which gives the states' shape, all a plan
        # reads of them.
        if images is not None and torch.device(device).type != "meta":
            vision["pixel_values"] = batch["pixel_values"].to(device, encoder.dtype)
            vision["image_grid_thw"] = batch["image_grid_thw"].to(device)
        out = encoder(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            output_hidden_states=True,
            use_cache=False,
            **vision,
        )
        hidden = out.hidden_states[-1]
        kept = [row.nonzero().squeeze(1)[drop:] for row in batch["attention_mask"].bool()]
        return real_tokens(hidden, kept, device)

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> packed reference tokens ``[B, N_r, 4C]``: the mode of the VAE's latent of
        the one-frame video, normalised as the samples (QwenImageEditPipeline._encode_vae_image, _pack_latents)."""
        return self.latents_from_vae(vae.encode(pixels.unsqueeze(2), return_dict=False)[0].mode())

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, N, 4C]`` of the noisy tokens, the reference's tokens beside them."""
        if guidance_embed is not None:
            raise ValueError("Qwen-Image-Edit has no distilled-guidance embedding; use CFG (sample.cfg)")
        if emb.reference is None:
            raise ValueError('Qwen-Image-Edit edits a reference image: use a .jsonl prompt file with an "image" field')
        side = math.isqrt(emb.reference.shape[1])  # a square reference (lean resizes every reference to a square)
        out = transformer(
            hidden_states=torch.cat([x, emb.reference.to(x.dtype)], dim=1),
            encoder_hidden_states=emb.tokens,
            encoder_hidden_states_mask=emb.mask,
            timestep=sigma,
            img_shapes=[[self.img_shape, (1, side, side)]] * x.shape[0],
            guidance=None,
            return_dict=False,
        )[0]
        return out[:, : x.shape[1]]

    def shard_sequence(self, net, sp) -> list:
        raise NotImplementedError(
            "Qwen-Image-Edit has no sequence parallelism yet: its joint attention masks padded text tokens "
            "(encoder_hidden_states_mask), which lean's Ulysses processors do not carry"
        )
