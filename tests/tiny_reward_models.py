"""Tiny random ImageReward and HPSv3 folders, built offline (``lean.rewards.imagereward``, ``lean.rewards.hpsv3``):
ImageReward's as the official checkpoint lays it out (converted by lean's converter), HPSv3's as Qwen2-VL's
save_pretrained plus the ``rm_head.*`` tensors HPSv3.safetensors holds."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import CLIP_PROMPTS

VISION, TEXT, INNER, LAYERS, PATCH, IMAGE, MAX_POSITIONS = 32, 24, 48, 2, 8, 32, 40


def _random(generator: torch.Generator):
    return lambda *shape: 0.2 * torch.randn(*shape, generator=generator)


def official_imagereward_state(vocab: int) -> dict[str, torch.Tensor]:
    """A random state dict under the official ImageReward.pt's names (ImageReward.py's ``ImageReward``: BLIP's timm
    ViT ``blip.visual_encoder``, its med.py BERT ``blip.text_encoder``, the unused ``blip.vision_proj`` /
    ``blip.text_proj``, the ``mlp.layers``), at tiny sizes."""
    r = _random(torch.Generator().manual_seed(0))
    v = "blip.visual_encoder."
    state = {
        v + "cls_token": r(1, 1, VISION),
        v + "pos_embed": r(1, (IMAGE // PATCH) ** 2 + 1, VISION),
        v + "patch_embed.proj.weight": r(VISION, 3, PATCH, PATCH),
        v + "patch_embed.proj.bias": r(VISION),
        v + "norm.weight": 1 + r(VISION),
        v + "norm.bias": r(VISION),
        "blip.vision_proj.weight": r(16, VISION),
        "blip.vision_proj.bias": r(16),
        "blip.text_proj.weight": r(16, TEXT),
        "blip.text_proj.bias": r(16),
        "blip.text_encoder.embeddings.position_ids": torch.arange(MAX_POSITIONS).view(1, -1),
    }
    linear = {"attn.qkv": (3 * VISION, VISION), "attn.proj": (VISION, VISION), "mlp.fc1": (INNER, VISION)}
    linear["mlp.fc2"] = (VISION, INNER)
    for i in range(LAYERS):
        for name in ("norm1", "norm2"):
            state[f"{v}blocks.{i}.{name}.weight"], state[f"{v}blocks.{i}.{name}.bias"] = 1 + r(VISION), r(VISION)
        for name, shape in linear.items():
            state[f"{v}blocks.{i}.{name}.weight"], state[f"{v}blocks.{i}.{name}.bias"] = r(*shape), r(shape[0])
    state.update(_official_text(r, vocab))
    widths = [TEXT, 1024, 128, 64, 16, 1]
    for index, (n_in, n_out) in zip((0, 2, 4, 6, 7), zip(widths, widths[1:]), strict=True):
        state[f"mlp.layers.{index}.weight"], state[f"mlp.layers.{index}.bias"] = r(n_out, n_in), r(n_out)
    return state


def _official_text(r, vocab: int) -> dict[str, torch.Tensor]:
    """BLIP's med.py BertModel (add_pooling_layer=False, cross-attention to the ViT) under ``blip.text_encoder``."""
    t = "blip.text_encoder."
    state = {
        t + "embeddings.word_embeddings.weight": r(vocab, TEXT),
        t + "embeddings.position_embeddings.weight": r(MAX_POSITIONS, TEXT),
        t + "embeddings.LayerNorm.weight": 1 + r(TEXT),
        t + "embeddings.LayerNorm.bias": r(TEXT),
    }
    for i in range(LAYERS):
        layer = f"{t}encoder.layer.{i}."
        linear = {
            "attention.self.query": (TEXT, TEXT),
            "attention.self.key": (TEXT, TEXT),
            "attention.self.value": (TEXT, TEXT),
            "attention.output.dense": (TEXT, TEXT),
            "crossattention.self.query": (TEXT, TEXT),
            "crossattention.self.key": (TEXT, VISION),
            "crossattention.self.value": (TEXT, VISION),
            "crossattention.output.dense": (TEXT, TEXT),
            "intermediate.dense": (INNER, TEXT),
            "output.dense": (TEXT, INNER),
        }
        for name, shape in linear.items():
            state[f"{layer}{name}.weight"], state[f"{layer}{name}.bias"] = r(*shape), r(shape[0])
        for name in ("attention.output.LayerNorm", "crossattention.output.LayerNorm", "output.LayerNorm"):
            state[f"{layer}{name}.weight"], state[f"{layer}{name}.bias"] = 1 + r(TEXT), r(TEXT)
    return state


def save_bert_tokenizer(folder: Path) -> Path:
    """A BERT WordPiece tokenizer (as bert-base-uncased's) over the words of :data:`CLIP_PROMPTS`."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = sorted({w for p in CLIP_PROMPTS for w in p.lower().split()})
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    return folder


def save_official_imagereward(folder: Path) -> tuple[Path, Path, Path]:
    """``(ImageReward.pt, med_config.json, bert tokenizer folder)`` as the official release ships them, tiny."""
    bert = save_bert_tokenizer(folder / "bert")
    vocab = len((bert / "vocab.txt").read_text().split()) + 2  # + BLIP's [DEC] and [ENC]
    med = dict(vocab_size=vocab, hidden_size=TEXT, num_hidden_layers=LAYERS, num_attention_heads=2)
    med.update(intermediate_size=INNER, max_position_embeddings=MAX_POSITIONS, layer_norm_eps=1e-12, hidden_act="gelu")
    med.update(model_type="bert", pad_token_id=0, encoder_width=VISION, add_cross_attention=True)
    (folder / "med_config.json").write_text(json.dumps(med))
    torch.save(official_imagereward_state(vocab), folder / "ImageReward.pt")
    return folder / "ImageReward.pt", folder / "med_config.json", bert


def save_tiny_imagereward(folder: Path) -> Path:
    """lean's ImageReward folder converted from a tiny official release (``python -m lean.rewards.imagereward``)."""
    from lean.rewards.imagereward import main

    checkpoint, med, bert = save_official_imagereward(folder / "official")
    main([str(checkpoint), str(med), str(bert), str(folder / "imagereward"), "--vision-heads", "2"])
    return folder / "imagereward"


QWEN_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def save_tiny_hpsv3(folder: Path) -> Path:
    """The ``hpsv3`` folder ``python -m lean.rewards.hpsv3`` writes from a tiny release: a "Qwen2-VL" folder (a
    word-level tokenizer with Qwen's chat and vision tokens, a config of a larger vocabulary, as Qwen2-VL-7B's 152064
    rows against its 151657 tokens) and an "HPSv3.safetensors" (the model resized to the tokenizer plus
    ``<|Reward|>``, and HPSv3's ranknet ``rm_head.*``)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from lean.models.text import train_tokenizer
    from lean.rewards.hpsv3 import main

    tok = train_tokenizer(CLIP_PROMPTS, max_length=1024, special_tokens=QWEN_TOKENS)
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tok) + 1,  # + <|Reward|>: HPSv3 resized the embeddings to its tokenizer
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_scaling={"type": "mrope", "mrope_section": [4, 2, 2]},
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        ),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Qwen2VLForConditionalGeneration(config).save_pretrained(folder / "trained")
        head = torch.nn.Sequential(
            torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05), torch.nn.Linear(1024, 16)
        )
        head.append(torch.nn.ReLU()).append(torch.nn.Linear(16, 2))
    weights = load_file(folder / "trained" / "model.safetensors")
    weights.update({f"rm_head.{k}": v for k, v in head.state_dict().items()})
    save_file(weights, folder / "HPSv3.safetensors", metadata={"format": "pt"})
    config.text_config.vocab_size = len(tok) + 5
    config.save_pretrained(folder / "qwen2-vl")
    tok.save_pretrained(folder / "qwen2-vl")
    main([str(folder / "qwen2-vl"), str(folder / "HPSv3.safetensors"), str(folder / "hpsv3")])
    return folder / "hpsv3"
