"""FLUX.2 [dev]'s text conditioning: Mistral Small 3.1's hidden states 10, 20 and 30 of the chat-formatted prompt,
stacked per token (``Flux2Pipeline._get_mistral_3_small_prompt_embeds``).

For a prompt p the pipeline builds the conversation [system: SYSTEM_MESSAGE, user: p] (``format_input``), renders
it with the tokenizer's chat template, pads / truncates it to ``max_length`` tokens, runs the encoder with that
attention mask, and for the hidden states h_10, h_20, h_30 ``[L, D]`` returns

    tokens[l] = concat(h_10[l], h_20[l], h_30[l])      [L, 3D]

(``out.permute(0, 2, 1, 3).reshape(B, L, 3D)``). The transformer then attends to all L text tokens, padding included
(no mask reaches it).

Chat template: a published tokenizer folder carries its own (Mistral's ``[SYSTEM_PROMPT]...[INST]...[/INST]``). A
random build's word-level tokenizer gets :data:`CHAT_TEMPLATE` (``FamilySpec.chat_template``, saved with the folder),
so that lean and the diffusers pipelines run the same ``apply_chat_template`` code on both. It renders the user
turns' text only: with a vocabulary trained on the prompts, the system message's words are all ``<unk>``, and at the
tiny sizes' 16 tokens it would truncate the prompt away.
"""

from __future__ import annotations

import torch
from torch import Tensor

# user turns' text, space-separated; a message's content is a string (Flux2KleinPipeline) or a list of
# {"type": "text", "text": ...} parts (Flux2Pipeline's format_input)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{{ ' ' }}{%- endif -%}{%- endfor -%}"
)


def stacked_hidden_states(encoder, ids: Tensor, mask: Tensor, layers: tuple[int, ...]) -> Tensor:
    """``[B, L, len(layers) D]``: the encoder's hidden states ``layers`` side by side per token, as both FLUX.2
    pipelines stack them (hidden state 0 is the embedding output)."""
    out = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    stacked = torch.stack([out.hidden_states[k] for k in layers], dim=1)  # [B, K, L, D]
    b, k, length, d = stacked.shape
    return stacked.permute(0, 2, 1, 3).reshape(b, length, k * d)


def mistral_prompt_embeds(encoder, tokenizer, prompts: list[str], max_length: int, device, layers) -> Tensor:
    """Flux2Pipeline's prompt embeddings of ``prompts`` (its system message, its chat formatting)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input  # local: diffusers takes seconds to import
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    inputs = tokenizer.apply_chat_template(
        format_input(prompts=prompts, system_message=SYSTEM_MESSAGE),
        add_generation_prompt=False,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        padding="max_length",
        truncation=True,
        max_length=max_length,
    )
    return stacked_hidden_states(encoder, inputs["input_ids"].to(device), inputs["attention_mask"].to(device), layers)
