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


def train_tokenizer(prompts: Sequence[str], max_length: int, special_tokens: Sequence[str] = ()):
    """Word-level tokenizer over the lower-cased words of ``prompts``; every sequence ends with ``</s>``.

    Ids are a function of the prompt *set* only (words sorted by their count over the distinct prompts, ties
    alphabetically), so every process that sees the same prompts builds the same tokenizer. Unseen words map to
    ``<unk>``. ``special_tokens`` (a family's ``FamilySpec.special_tokens``: Qwen2.5-VL's ``<|image_pad|>``, ...) are
    appended after the trained vocabulary, matched verbatim and never split, so the other ids do not move.
    """
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast  # local: transformers takes seconds to import

    pad, eos, unk = SPECIAL_TOKENS
    tok = Tokenizer(models.WordLevel(unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sorted(set(prompts)), trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS)))
    tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, tok.token_to_id(eos))])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, eos_token=eos, unk_token=unk, model_max_length=max_length
    )


def tokenize(tokenizer, prompts: Sequence[str], max_length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)``, both ``[B, max_length]``: padded to and truncated at ``max_length``."""
    batch = tokenizer(list(prompts), padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    return batch.input_ids.to(device), batch.attention_mask.to(device)


@dataclass
class PromptEmbeds:
    """The conditioning of a batch of prompts.

    * ``tokens [B, L, D]``: per-token text embeddings;
    * ``pooled [B, P]``: a pooled text vector (FLUX.1, SD3), or None;
    * ``mask [B, L]``: which text tokens are real (Qwen-Image attends to the unpadded ones only), or None: all are.
      Rows encoded alone have their own lengths; :meth:`cat` pads them to the longest with masked zeros, as the
      pipelines pad a batch;
    * ``reference [B, R, C]``: a reference image's latent tokens in the policy's layout (editing models: FLUX.1
      Kontext, Qwen-Image-Edit), which the family appends to the image tokens; None for text-only prompts;
    * ``negative``: the unconditional conditioning of each row when it depends on the row (an edit's CFG keeps the
      reference image and drops the text), else None: the empty prompt's;
    * ``image [B, I, E]``: an image encoder's states of the row's conditioning image, which the transformer reads
      beside the text (Wan2.1 image-to-video's CLIP ViT-H/14), or None.
    """

    tokens: Tensor
    pooled: Tensor | None = None
    mask: Tensor | None = None
    reference: Tensor | None = None
    negative: PromptEmbeds | None = None
    image: Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def _map(self, fn) -> PromptEmbeds:
        """``fn`` on every tensor (and on the negative's)."""
        return PromptEmbeds(
            fn(self.tokens),
            None if self.pooled is None else fn(self.pooled),
            None if self.mask is None else fn(self.mask),
            None if self.reference is None else fn(self.reference),
            None if self.negative is None else self.negative._map(fn),
            None if self.image is None else fn(self.image),
        )

    def index(self, i: int | slice | Sequence[int] | Tensor) -> PromptEmbeds:
        """Rows ``i`` of the batch; an int keeps the batch dimension (``[1, L, D]``)."""
        if isinstance(i, int):
            i = slice(i, i + 1)
        elif not isinstance(i, slice):
            i = torch.as_tensor(i, dtype=torch.long, device=self.tokens.device)
        return self._map(lambda t: t[i])

    def expand(self, batch_size: int) -> PromptEmbeds:
        """A single-row embedding broadcast (as a view) to ``batch_size`` rows."""
        assert len(self) == 1, "expand() broadcasts a single prompt"
        return self._map(lambda t: t.expand(batch_size, *t.shape[1:]))

    @staticmethod
    def cat(items: Sequence[PromptEmbeds]) -> PromptEmbeds:
        """Concatenate along the batch dimension; masked rows of different lengths are zero-padded to the longest."""
        first = items[0]
        if first.mask is not None:
            length = max(e.tokens.shape[1] for e in items)
            items = [e.padded(length) for e in items]
        pooled = None if first.pooled is None else torch.cat([e.pooled for e in items])
        mask = None if first.mask is None else torch.cat([e.mask for e in items])
        reference = None if first.reference is None else torch.cat([e.reference for e in items])
        negative = None if first.negative is None else PromptEmbeds.cat([e.negative for e in items])
        image = None if first.image is None else torch.cat([e.image for e in items])
        return PromptEmbeds(torch.cat([e.tokens for e in items]), pooled, mask, reference, negative, image)

    def padded(self, length: int) -> PromptEmbeds:
        """Text tokens zero-padded (and masked) to ``length``."""
        extra = length - self.tokens.shape[1]
        if extra == 0:
            return self
        tokens = torch.nn.functional.pad(self.tokens, (0, 0, 0, extra))
        mask = torch.nn.functional.pad(self.mask, (0, extra))
        return PromptEmbeds(tokens, self.pooled, mask, self.reference, self.negative, self.image)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> PromptEmbeds:
        """Moved to ``device``; floating tensors cast to ``dtype`` (the mask keeps its integer type)."""
        return self._map(lambda t: t.to(device, dtype if t.is_floating_point() else None))


def real_tokens(hidden: Tensor, kept: Sequence[Tensor], device: torch.device) -> PromptEmbeds:
    """Each row's real tokens of ``hidden [B, L, D]`` (``kept[b]``: host positions, read off the tokenizer's mask so
    nothing is read back from the device), zero-padded to the longest with their mask (Qwen-Image, Z-Image: the
    transformer attends to the real text tokens only)."""
    length = max(len(k) for k in kept)
    tokens = hidden.new_zeros(len(kept), length, hidden.shape[-1])
    mask = torch.zeros(len(kept), length, dtype=torch.long)
    for b, positions in enumerate(kept):
        tokens[b, : len(positions)] = hidden[b].index_select(0, positions.to(hidden.device))
        mask[b, : len(positions)] = 1
    return PromptEmbeds(tokens, mask=mask.to(device))
