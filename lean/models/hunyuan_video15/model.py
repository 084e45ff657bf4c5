"""HunyuanVideo-1.5's runtime (:class:`HunyuanVideo15`): a dual-stream DiT (HunyuanVideo15Transformer3DModel) over
the latents ``[C, F', h, w]`` of a causal 3-D VAE, conditioned on Qwen2.5-VL hidden states and byT5 glyph states, as
diffusers' text-to-video ``HunyuanVideo15Pipeline`` runs it.

Text conditioning (``encode_text``), the pipeline's two encoders:

* Qwen2.5-VL (``_get_mllm_prompt_embeds``): each prompt p (" " when empty) becomes the conversation [system:
  :data:`SYSTEM_MESSAGE`, user: p] rendered by the tokenizer's chat template with the generation prompt, truncated at
  d + ``max_length`` tokens, where d counts the template's tokens before p; the states are the hidden states of the
  third-last entry (``hidden_states[-3]``: two layers skipped) at positions d onwards, with the tokenizer's mask. The
  pipeline pads every row to d + 1000 (its ``tokenizer_max_length``) and hard-codes d = 108 (the real Qwen2
  tokenizer's count, which cannot be checked offline); lean counts d with the tokenizer in use, as for Qwen-Image, caps
  the prompt with ``model.text_max_length`` and pads a batch to its longest row only. The template keeps its suffix
  ("<|im_end|>", the assistant turn): those tokens are real and attended to, as in the pipeline.
* byT5 (``_get_byt5_prompt_embeds``): the quoted text of the prompt (``extract_glyph_texts``: 'Text "..."' of each
  quoted span), tokenized to at most :data:`GLYPH_MAX_LENGTH` tokens and encoded with its mask; a prompt without quotes
  has no glyph tokens (the pipeline passes 256 zero rows, all masked out).

Both streams travel in one :class:`~lean.models.text.PromptEmbeds`: ``tokens [B, L, D1 + D2]`` holds the Qwen states
in its first D1 features and the byT5 states in the last D2 (L the longer stream; the other zero-padded), and ``mask``
holds 1 for a real Qwen token plus 2 for a real byT5 token at each position, so that rows of different lengths pad
together (``PromptEmbeds.cat``: zeros, mask 0). Padding changes nothing: the transformer moves each row's real tokens
first ([byT5, Qwen], then the padding, zeroed) and masks the padding as queries and keys; its token refiner pools the
Qwen states with the mask. T2V has no image: the transformer gets no SigLIP tokens (the pipeline passes 729 zero rows,
which the transformer masks out when they are all zero).

The transformer call: ``hidden_states`` is x with T2V's condition channels appended (a zero latent and a zero mask,
``prepare_cond_latents_and_mask``: 2C + 1 channels), ``timestep`` 1000 sigma in x's dtype (the scheduler's timestep,
which the pipeline casts to the latents' dtype). Guidance is CFG (the pipeline's ``ClassifierFreeGuidance`` guider:
v_u + s (v_c - v_u) against the empty prompt, no rescale), which ``Policy.velocity`` computes. Latents are the VAE's
scaled: z = (z_vae - shift) scale, decoded as z_vae = z / scale + shift, with the VAE config's ``scaling_factor`` and
no shift unless the config has a ``shift_factor`` (the published VAE has none; the pipeline divides by the scale).

Decoding runs the VAE one video at a time: AutoencoderKLHunyuanVideo15's mid-block attention builds its causal mask as
``[B, L, L]`` against queries ``[B, 1, L, C]``, which broadcasts wrongly for B > 1 in diffusers 0.42.1 (the pipeline
decodes the videos of a call together, and so only works for one).

The meta device cannot run the transformer: its forward reads tensor values (``torch.all(image_embeds == 0)`` decides
T2V, boolean masks reorder the text tokens), so :meth:`HunyuanVideo15.forward` refuses it in one config line, which is
what ``lean plan`` at the published size on a CPU (``lean.plan.meta``) then prints.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.config import ConfigError
from lean.models.sequence_parallel import SequenceParallel
from lean.models.spec import VideoLatents
from lean.models.text import PromptEmbeds

# HunyuanVideo15Pipeline.system_message (diffusers 0.42, pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py): its
# source continues the string over lines with backslashes, so each numbered point follows 8 spaces of indentation
SYSTEM_MESSAGE = (
    "You are a helpful assistant. Describe the video by detailing the following aspects:         "
    "1. The main content and theme of the video.         "
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.         "
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.         "
    "4. background environment, light, style and atmosphere.         "
    "5. camera angles, movements, and transitions used in the video."
)
PIPELINE_PREFIX_TOKENS = 108  # HunyuanVideo15Pipeline.prompt_template_encode_start_idx, for the real Qwen2 tokenizer
SKIPPED_LAYERS = 2  # _get_mllm_prompt_embeds(num_hidden_layers_to_skip=2): hidden_states[-3]
GLYPH_MAX_LENGTH = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length
# Qwen2.5-VL-7B-Instruct's chat template on text-only conversations (written from memory): each message as
# "<|im_start|>{role}\n{content}<|im_end|>\n", then "<|im_start|>assistant\n" for the generation prompt. A random
# build's word-level tokenizer gets it (FamilySpec.chat_template) with the two markers as special tokens.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")
_SENTINEL = "{prompt}"
META_REFUSAL = (
    "the meta device cannot run HunyuanVideo15Transformer3DModel, whose forward reads tensor values (its T2V check, "
    "the reordering of the text tokens): lean plan counts this family on a GPU only"
)


def conversations(prompts: list[str]) -> list:
    """The pipeline's chat input (``format_text_input``): [system, user] per prompt, " " for an empty prompt."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input  # local: heavy

    return format_text_input(prompts, SYSTEM_MESSAGE)


def prefix_tokens(tokenizer) -> int:
    """Tokens of the rendered template before the prompt, for ``tokenizer`` (what the pipeline crops:
    ``prompt_template_encode_start_idx``, 108 for the real Qwen2 tokenizer)."""
    rendered = tokenizer.apply_chat_template(conversations([_SENTINEL]), add_generation_prompt=True, tokenize=False)
    rendered = rendered[0] if isinstance(rendered, list) else rendered
    return len(tokenizer(rendered.split(_SENTINEL)[0], add_special_tokens=False, verbose=False).input_ids)


def glyph_text(prompt: str) -> str | None:
    """The byT5 input of ``prompt``: 'Text "q". ' for each quoted span q, or None (the pipeline's
    ``extract_glyph_texts``)."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts  # local: heavy

    return extract_glyph_texts(prompt)


class HunyuanVideo15(VideoLatents):
    """HunyuanVideo-1.5 geometry, conditioning and calls for a fixed resolution and frame count (4k + 1 frames)."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int, width: int | None = None):
        t, s = vae_config.temporal_compression_ratio, vae_config.spatial_compression_ratio
        width = width or resolution  # model.width: frames of another width than height
        if (num_frames - 1) % t:
            raise ValueError(f"num_frames={num_frames}: HunyuanVideo-1.5's VAE needs {t}k + 1 frames")
        if resolution % s or width % s:
            raise ValueError(f"{resolution} x {width}: HunyuanVideo-1.5's VAE compresses {s}x, use multiples of {s}")
        self.frames, self.h, self.w = (num_frames - 1) // t + 1, resolution // s, width // s
        self.patch = (transformer_config.patch_size_t, transformer_config.patch_size, transformer_config.patch_size)
        self.channels = vae_config.latent_channels
        self.scale = float(vae_config.scaling_factor)
        self.shift = float(vae_config.get("shift_factor") or 0.0)  # none in the published VAE
        self.text_dim = transformer_config.text_embed_dim  # Qwen2.5-VL's width
        self.glyph_dim = transformer_config.text_embed_2_dim  # byT5's
        self.image_dim = transformer_config.image_embed_dim  # SigLIP's (no image in T2V)

    def latents_from_vae(self, z: Tensor) -> Tensor:
        return (z - self.shift) * self.scale

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """Both streams of the module docstring, packed: ``tokens [B, L, D1 + D2]``, ``mask`` 1 (Qwen) + 2 (byT5).
        Which positions are real is read from the tokenizers' masks on the host: nothing is read back from the
        device."""
        if images is not None:
            raise ValueError("HunyuanVideo-1.5's text-to-video encoder takes no image")
        text, text_mask = self._qwen_states(
            encoders["text_encoder"], tokenizers["tokenizer"], prompts, max_length, device
        )
        glyphs = [self._glyph_states(encoders["text_encoder_2"], tokenizers["tokenizer_2"], p, device) for p in prompts]
        length = max(text.shape[1], *(g.shape[1] for g, _ in glyphs))
        tokens = text.new_zeros(len(prompts), length, self.text_dim + self.glyph_dim)
        mask = torch.zeros(len(prompts), length, dtype=torch.long)
        n = text.shape[1]
        tokens[:, :n, : self.text_dim] = text * text_mask[..., None].to(text)
        mask[:, :n] = text_mask
        for b, (glyph, glyph_mask) in enumerate(glyphs):
            tokens[b, : glyph.shape[1], self.text_dim :] = glyph[0].to(tokens.dtype)
            mask[b, : glyph.shape[1]] += 2 * glyph_mask[0]
        return PromptEmbeds(tokens, mask=mask.to(device))

    @staticmethod
    def _qwen_states(encoder, tokenizer, prompts: list[str], max_length: int, device) -> tuple[Tensor, Tensor]:
        """Qwen2.5-VL's ``hidden_states[-3]`` after the template's prefix ``[B, n, D1]`` and the host mask ``[B, n]``
        (at most ``max_length`` prompt and suffix tokens per row; a batch padded to its longest row on the right)."""
        drop = prefix_tokens(tokenizer)
        batch = tokenizer.apply_chat_template(
            conversations(prompts),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            padding=True,
            max_length=max_length + drop,
            truncation=True,
            return_tensors="pt",
        )
        out = encoder(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            output_hidden_states=True,
            use_cache=False,
        )
        return out.hidden_states[-(SKIPPED_LAYERS + 1)][:, drop:], batch["attention_mask"][:, drop:]

    @staticmethod
    def _glyph_states(encoder, tokenizer, prompt: str, device) -> tuple[Tensor, Tensor]:
        """byT5's last hidden states of the prompt's glyph text ``[1, n, D2]`` and its host mask ``[1, n]``; n = 0
        without quoted text."""
        text = glyph_text(prompt)
        if text is None:
            width = encoder.config.d_model
            return torch.zeros(1, 0, width, device=device, dtype=encoder.dtype), torch.zeros(1, 0, dtype=torch.long)
        batch = tokenizer(
            text, max_length=GLYPH_MAX_LENGTH, truncation=True, add_special_tokens=True, return_tensors="pt"
        )
        states = encoder(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.float().to(device))[
            0
        ]
        return states, batch.attention_mask

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, C, F', h, w]``."""
        if guidance_embed is not None:
            raise ValueError("HunyuanVideo-1.5 has no distilled-guidance embedding; use CFG (sample.cfg)")
        if x.device.type == "meta":  # lean plan's count of a published size (lean.plan.meta)
            raise ConfigError("device", "meta", META_REFUSAL)
        text, glyph = emb.tokens.split([self.text_dim, self.glyph_dim], dim=-1)
        condition = x.new_zeros(x.shape[0], self.channels + 1, *x.shape[2:])  # T2V: zero image latent and mask
        return transformer(
            hidden_states=torch.cat([x, condition], dim=1),
            timestep=(sigma * 1000).to(x.dtype),
            encoder_hidden_states=text,
            encoder_attention_mask=emb.mask % 2,
            encoder_hidden_states_2=glyph,
            encoder_attention_mask_2=emb.mask // 2,
            image_embeds=x.new_zeros(x.shape[0], 0, self.image_dim),
            return_dict=False,
        )[0]

    def decode(self, vae, x: Tensor) -> Tensor:
        """Videos in [-1, 1], ``[B, 3, F, H, W]``, one VAE call per video (module docstring)."""
        z = x / self.scale + self.shift
        return torch.cat([vae.decode(one, return_dict=False)[0] for one in z.split(1)])

    splits_text = True  # joint attention: sequence parallelism would split the text tokens too (not implemented)

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} takes no reference image")

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
        raise NotImplementedError(
            "HunyuanVideo-1.5 has no sequence parallelism yet: its transformer reorders each row's text tokens (real "
            "ones first) and masks the rest in its joint attention, which lean's Ulysses processors do not carry"
        )
