"""FLUX.2 [klein]'s runtime (:class:`Flux2Klein`): FLUX.2's latent geometry, rotary ids, transformer call and
decoding (:class:`lean.models.flux2.model.Flux2`), conditioned on Qwen3's hidden states 9, 18 and 27
(``Flux2KleinPipeline._get_qwen3_prompt_embeds``), without a guidance embedding.

Text conditioning, per prompt p: the chat template renders [user: p] with a generation prompt and thinking off
(``apply_chat_template(..., tokenize=False, add_generation_prompt=True, enable_thinking=False)``), the text is
tokenized padded / truncated to ``max_length`` tokens, and the encoder runs with that mask; tokens[l] =
concat(h_9[l], h_18[l], h_27[l]). Guidance: true CFG against the empty prompt (``sample.cfg``; the pipeline's
``guidance_scale`` > 1 on the undistilled "base" checkpoints), none on the step-distilled ones (``is_distilled``).
"""

from __future__ import annotations

import torch

from lean.models.flux2.model import Flux2
from lean.models.flux2.text import stacked_hidden_states
from lean.models.flux2_klein.sizes import HIDDEN_LAYERS
from lean.models.text import PromptEmbeds


class Flux2Klein(Flux2):
    """FLUX.2 [klein] for a fixed resolution: FLUX.2's runtime with the Qwen3 text encoder."""

    hidden_layers = HIDDEN_LAYERS

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        tokenizer = tokenizers["tokenizer"]
        ids, masks = [], []
        for prompt in prompts:  # one prompt at a time, as the pipeline formats them
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            batch = tokenizer(text, return_tensors="pt", padding="max_length", truncation=True, max_length=max_length)
            ids.append(batch["input_ids"])
            masks.append(batch["attention_mask"])
        ids, masks = torch.cat(ids).to(device), torch.cat(masks).to(device)
        return PromptEmbeds(stacked_hidden_states(encoders["text_encoder"], ids, masks, self.hidden_layers))
