"""Z-Image's runtime (:class:`ZImage`): a single-stream DiT (ZImageTransformer2DModel) over 2x2 patches of FLUX.1's
16-channel VAE latent, conditioned on the second-to-last hidden states of a Qwen3 language model, as diffusers'
``ZImagePipeline`` (diffusers 0.42.1, pipelines/z_image/pipeline_z_image.py) runs it.

Text conditioning (``encode_text``; ``ZImagePipeline._encode_prompt``, :202-251): each prompt p is the user turn of a
chat rendered with the tokenizer's own template (``add_generation_prompt=True, enable_thinking=True``), tokenized to
at most ``max_length`` tokens with its attention mask and run through the text encoder; with h the hidden states
``hidden_states[-2]`` ``[B, L, D]``:

    tokens_b = h_b[real positions of row b]                               [n_b, D]

The transformer takes that list of rows of their own lengths (it pads each to a multiple of 32 with a learned pad
token and masks the padding itself). lean holds the rows zero-padded to the longest with mask 0 (``PromptEmbeds``) and
hands the transformer each row's first n_b tokens, so the velocity does not depend on the batch's padding. A random
build's word-level tokenizer gets :data:`CHAT_TEMPLATE` (the user text alone: at the tiny sizes' 16 tokens the
Qwen3 markers would crowd the prompt out); a published folder's Qwen2Tokenizer carries Qwen3's own.

Latent layout seen by the policy: the VAE latent itself, ``x [B, 16, h, w]`` (the transformer patchifies 2x2 itself,
one frame). The network's time runs the other way and its output is the negated velocity: the pipeline feeds
``(1000 - t) / 1000 = 1 - sigma`` and steps with ``-out`` (:511, :568), so lean's velocity is
v = -net(x, 1 - sigma). The VAE latent is normalised as z = (z_vae - shift) * scale (FLUX.1's), decoded as
z_vae = z / scale + shift.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.latent_grid import LatentGrid, vae_scale
from lean.models.sequence_parallel import SequenceParallel
from lean.models.text import PromptEmbeds, real_tokens

HIDDEN_STATE = -2  # ZImagePipeline._encode_prompt reads hidden_states[-2] (pipeline_z_image.py:244)
# user turns' text only, for a random build's word-level tokenizer (the module docstring says why)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{{ message['content'] }}{{ ' ' }}"
    "{%- endif -%}{%- endfor -%}"
)


class ZImage(LatentGrid):
    """Z-Image geometry, conditioning and calls for a fixed resolution (``num_frames`` is ignored: images; its
    ``image_seq_len`` is the pipeline's, :471)."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int = 1):
        scale, patch = vae_scale(vae_config), transformer_config.all_patch_size[0]  # ZImagePipeline.vae_scale_factor
        if resolution % (scale * patch):  # the pipeline's "divisible by vae_scale_factor * 2" (:402-412)
            raise ValueError(
                f"resolution {resolution}: Z-Image patchifies {patch}x{patch} patches of its {scale}x VAE "
                f"latent: use a multiple of {scale * patch}"
            )
        self.set_grid(vae_config, resolution, patch)

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """The text encoder's hidden states ``[-2]`` of each chat-formatted prompt's real tokens (at most
        ``max_length``), zero-padded to the longest with their mask. Which positions are real is read from the
        tokenizer's mask on the host, so nothing is read back from the device."""
        if images is not None:
            raise ValueError("Z-Image's text-to-image encoder takes no image")
        tokenizer = tokenizers["tokenizer"]
        chats = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=True
            )
            for p in prompts
        ]
        batch = tokenizer(chats, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
        hidden = encoders["text_encoder"](
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            output_hidden_states=True,
            use_cache=False,
        ).hidden_states[HIDDEN_STATE]
        kept = [row.nonzero().squeeze(1) for row in batch.attention_mask.bool()]
        return real_tokens(hidden, kept, device)

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, 16, h, w]``: -net(x, 1 - sigma) on each row's real text tokens."""
        if guidance_embed is not None:
            raise ValueError("Z-Image has no distilled-guidance embedding; use CFG (sample.cfg)")
        full = emb.tokens.shape[1]
        meta = emb.mask is None or emb.mask.is_meta  # the meta device plans: every token counts
        lengths = [full] * len(x) if meta else emb.mask.sum(1).tolist()
        captions = [emb.tokens[b, :n] for b, n in enumerate(lengths)]
        out = transformer(list(x.unsqueeze(2).unbind(0)), 1 - sigma, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def decode(self, vae, x: Tensor) -> Tensor:
        """Images in [-1, 1], ``[B, 3, H, W]``."""
        return vae.decode(x / self.scaling + self.shift, return_dict=False)[0]

    splits_text = True  # one joint sequence: sequence parallelism would split the caption tokens too

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} takes no reference image")

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
        raise NotImplementedError(
            "Z-Image has no sequence parallelism yet: its transformer takes each row's caption and image as a list "
            "of their own lengths and pads them itself, which lean's Ulysses processors do not split"
        )
