"""Offline text conditioning: a word-level tokenizer trained on the prompt list, and cached prompt embeddings.

Nothing is downloaded: the tokenizer is trained locally with the ``tokenizers`` library and saved as an ordinary
Hugging Face tokenizer folder; the text encoders are built from ``transformers`` configs (the families'
``sizes.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# T5's special-token layout: pad=0, eos=1, unk=2. CLIP picks its pooled vector at the first eos, which it can only do
# when eos_token_id != 2 (id 2 triggers transformers' legacy "eos is the largest id" rule).
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")


def train_tokenizer(prompts: Sequence[str], max_length: int):
    """Word-level tokenizer over the lower-cased words of ``prompts``; every sequence ends with ``</s>``.

    Ids are a function of the prompt *set* only (words sorted by their count over the distinct prompts, ties
    alphabetically), so every process that sees the same prompts builds the same tokenizer. Unseen words map to
    ``<unk>``.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast  # local: transformers takes seconds to import

    pad, eos, unk = SPECIAL_TOKENS
    tok = Tokenizer(models.WordLevel(unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sorted(set(prompts)), trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS)))
    tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, tok.token_to_id(eos))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, eos_token=eos, unk_token=unk, model_max_length=max_length
    )


def tokenize(tokenizer, prompts: Sequence[str], max_length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)``, both ``[B, max_length]``: padded to and truncated at ``max_length``."""
    batch = tokenizer(list(prompts), padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    return batch.input_ids.to(device), batch.attention_mask.to(device)


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch: per-token embeddings ``tokens [B, L, D]`` and an optional pooled ``[B, P]``."""

    tokens: Tensor
    pooled: Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def index(self, i: int | slice | Sequence[int] | Tensor) -> PromptEmbeds:
        """Rows ``i`` of the batch; an int keeps the batch dimension (``[1, L, D]``)."""
        if isinstance(i, int):
            i = slice(i, i + 1)
        elif not isinstance(i, slice):
            i = torch.as_tensor(i, dtype=torch.long, device=self.tokens.device)
        return PromptEmbeds(self.tokens[i], None if self.pooled is None else self.pooled[i])

    def expand(self, batch_size: int) -> PromptEmbeds:
        """A single-row embedding broadcast (as a view) to ``batch_size`` rows."""
        assert len(self) == 1, "expand() broadcasts a single prompt"
        return PromptEmbeds(
            self.tokens.expand(batch_size, -1, -1), None if self.pooled is None else self.pooled.expand(batch_size, -1)
        )

    @staticmethod
    def cat(items: Sequence[PromptEmbeds]) -> PromptEmbeds:
        """Concatenate along the batch dimension."""
        pooled = None if items[0].pooled is None else torch.cat([e.pooled for e in items])
        return PromptEmbeds(torch.cat([e.tokens for e in items]), pooled)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> PromptEmbeds:
        pooled = None if self.pooled is None else self.pooled.to(device, dtype)
        return PromptEmbeds(self.tokens.to(device, dtype), pooled)
