"""Qwen-Image's runtime (:class:`QwenImage`): a dual-stream MMDiT (QwenImageTransformer2DModel) over 2x2-packed
latents of a causal 3-D VAE run on one frame, conditioned on the last hidden states of Qwen2.5-VL's language model,
as diffusers' ``QwenImagePipeline`` runs it.

Text conditioning (``encode_text``): each prompt p is formatted into the pipeline's chat template T(p) (a system
prompt, then p as the user turn), tokenized with its attention mask and run through the text encoder; with h the last
hidden states ``[B, L, 3584]`` and d the number of tokens of the template's prefix (everything before p):

    tokens_b = h_b[real positions of row b][d : d + max_length]          [n_b, D]
    mask_b   = 1 for each of them                                        [n_b]

(the pipeline's ``_extract_masked_hidden`` and ``prompt_template_encode_start_idx``, then ``max_sequence_length``).
d is counted by tokenizing the prefix with the tokenizer in use: 34 for the real Qwen2 tokenizer (the pipeline's
constant; this cannot be checked offline), and whatever lean's word-level tokenizer makes of the same text. Rows of
different lengths are zero-padded to the longest with mask 0 (``PromptEmbeds.cat``), as the pipeline pads a batch;
the transformer attends to the masked-in text tokens only (``encoder_hidden_states_mask``), so the velocity does not
depend on the padding. The text encoder is causal, so cutting the template after ``max_length`` prompt tokens changes
none of the states kept.

Latent layout seen by the policy: packed tokens ``x [B, N, 4C]``, N = (h/2)(w/2) for a ``[C, h, w]`` latent, packed
exactly as FLUX (``lean.models.flux.model.pack``; QwenImagePipeline's ``_pack_latents``). The transformer takes
``timestep = sigma`` in [0, 1] (the pipeline passes t / 1000 with t = 1000 sigma; it scales by 1000 itself),
``img_shapes = [(1, h/2, w/2)] * B`` for its RoPE and no guidance embedding. The VAE's latent is normalised per
channel: z = (z_vae - mean_c) / std_c, decoded as z_vae = z std_c + mean_c through the VAE's ``[B, C, 1, h, w]``
(one frame) layout, keeping frame 0 of its output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.flux.model import PackedLatents, unpack
from lean.models.sequence_parallel import SequenceParallel
from lean.models.text import PromptEmbeds, real_tokens

# QwenImagePipeline.prompt_template_encode (diffusers 0.42, pipelines/qwenimage/pipeline_qwenimage.py)
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
PIPELINE_PREFIX_TOKENS = 34  # QwenImagePipeline.prompt_template_encode_start_idx, for the real Qwen2 tokenizer


def prefix_tokens(tokenizer) -> int:
    """Tokens of the template before the prompt, for ``tokenizer`` (the pipeline's start index, which it hard-codes
    as 34 for Qwen2's tokenizer)."""
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    return len(tokenizer(prefix, add_special_tokens=False, verbose=False).input_ids)


class QwenImage(PackedLatents):
    """Qwen-Image geometry, conditioning and calls for a fixed resolution (``num_frames`` is ignored: images)."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int = 1):
        scale = 2 ** len(vae_config.temperal_downsample)  # QwenImagePipeline.vae_scale_factor
        self.h = self.w = resolution // scale
        if self.h % 2 or resolution % scale:
            raise ValueError(
                f"resolution {resolution} gives a {resolution / scale:g} px latent; Qwen-Image packs 2x2 patches of "
                f"its {scale}x VAE latent: use a multiple of {2 * scale}"
            )
        self.channels = vae_config.z_dim
        self.mean = torch.tensor(vae_config.latents_mean).view(1, -1, 1, 1)
        self.std = torch.tensor(vae_config.latents_std).view(1, -1, 1, 1)
        self.img_shape = (1, self.h // 2, self.w // 2)  # (frame, rows, columns) of the packed tokens: the RoPE grid

    def latents_from_vae(self, z: Tensor) -> Tensor:
        """VAE latents ``[B, C, 1, h, w]`` (the VAE's layout) or ``[B, C, h, w]`` -> normalised packed tokens."""
        if z.ndim == 5:
            z = z[:, :, 0]
        return self.noise_to_latents((z - self.mean.to(z)) / self.std.to(z))

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """Qwen2.5-VL's last hidden states of each prompt's tokens inside the chat template (module docstring), at
        most ``max_length`` per prompt, with their mask. Which positions are kept is read from the tokenizer's mask on
        the host, so nothing is read back from the device (and the meta device runs it)."""
        if images is not None:
            raise ValueError("Qwen-Image's text-to-image encoder takes no image (Qwen-Image-Edit does)")
        tokenizer = tokenizers["tokenizer"]
        drop = prefix_tokens(tokenizer)
        batch = tokenizer(
            [PROMPT_TEMPLATE.format(p) for p in prompts],
            max_length=max_length + drop,
            padding=True,
            truncation=True,
            return_tensors="pt",
        )
        out = encoders["text_encoder"](
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            output_hidden_states=True,
            use_cache=False,
        )
        hidden = out.hidden_states[-1]
        kept = [row.nonzero().squeeze(1)[drop : drop + max_length] for row in batch.attention_mask.bool()]
        return real_tokens(hidden, kept, device)

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, N, 4C]``."""
        if guidance_embed is not None:
            raise ValueError("Qwen-Image has no distilled-guidance embedding; use CFG (sample.cfg)")
        return transformer(
            hidden_states=x,
            encoder_hidden_states=emb.tokens,
            encoder_hidden_states_mask=emb.mask,
            timestep=sigma,
            img_shapes=[self.img_shape] * x.shape[0],
            guidance=None,
            return_dict=False,
        )[0]

    def decode(self, vae, x: Tensor) -> Tensor:
        """Images in [-1, 1], ``[B, 3, H, W]``: frame 0 of the VAE's one-frame video."""
        z = unpack(x, self.h, self.w) * self.std.to(x) + self.mean.to(x)
        return vae.decode(z.unsqueeze(2), return_dict=False)[0][:, :, 0]

    splits_text = True  # joint attention: sequence parallelism would split the text tokens too (not implemented)

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} takes no reference image")

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
        raise NotImplementedError(
            "Qwen-Image has no sequence parallelism yet: its joint attention masks padded text tokens "
            "(encoder_hidden_states_mask), which lean's Ulysses processors do not carry"
        )
