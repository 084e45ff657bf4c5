"""ImageReward (Xu et al. 2023, THUDM/ImageReward) from a local folder: ``imagereward``, FlowGRPO's ``imagereward``.

The model (THUDM/ImageReward at c1392c6, ImageReward/ImageReward.py): BLIP's ViT-L/16 encodes the image (224 px,
CLIP's preprocessing: shortest side to 224 bicubic, centre crop, OpenAI mean/std, lines 30-37); BLIP's BERT text
encoder reads the prompt (padded to 35 tokens, line 141) with cross-attention to every image token; the first
token's output feature ``h [B, 768]`` goes through an MLP (``Linear(768, 1024) Dropout Linear(1024, 128) Dropout
Linear(128, 64) Dropout Linear(64, 16) Linear(16, 1)``, lines 40-58: LAION's aesthetic MLP, no activations), and
the score is standardised with the training set's constants (lines 80-81, 166-168)::

    r = (MLP(h) - 0.16717362830052426) / 1.0333394966054072

FlowGRPO calls ``inference_rank(prompt, [image])`` once per sample (flow_grpo/imagereward_scorer.py at ac4c86e, lines
16-21, on 8-bit PIL images: flow_grpo/rewards.py lines 62-75): the same ``r``, one image at a time.

lean builds it from transformers' BLIP parts: ``BlipVisionModel`` (timm's ViT with the fused qkv under other names)
and ``BlipTextModel`` with cross-attention (BLIP's ``med.py`` BertModel under the same names), plus the MLP. The folder
(:func:`convert` writes it from the official ``ImageReward.pt``)::

    config.json          a BlipConfig (model_type blip): vision_config, text_config (encoder_hidden_size = ViT width)
    model.safetensors    vision_model.*, text_encoder.*, mlp.{0,2,4,6,7}.*  (see :func:`from_official`)
    tokenizer files      bert-base-uncased's, with BLIP's [DEC] bos and [ENC] tokens (vocab 30524)

``python -m lean.rewards.imagereward ImageReward.pt med_config.json BERT_TOKENIZER_FOLDER OUT`` converts.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from lean.config.dtypes import DTYPES
from lean.rewards.base import ModelReward, register_model
from lean.rewards.models import FolderKind, ImageTransform, aesthetic_head, model_folder_problem, tokenizer_problem

if TYPE_CHECKING:
    from lean.rewards.options import RewardModelConfig

SCORE_MEAN = 0.16717362830052426  # ImageReward.py lines 80-81: the reward's mean and std over its training set
SCORE_STD = 1.0333394966054072
MAX_LENGTH = 35  # the prompt's padded length (ImageReward.py line 141)
VIT_LARGE_HEADS = 16  # BLIP's ViT-L (blip.py create_vit, line 35); not readable from the weights' shapes
FOLDER = FolderKind(
    "BLIP",
    "blip",
    "ImageReward",
    "lean's ImageReward folder: python -m lean.rewards.imagereward converts the official ImageReward.pt",
)
# the official keys (BLIP's timm ViT) -> BlipVisionModel's; BLIP's med.py BERT keeps its names under text_encoder.
VISION_KEYS = (
    (r"^blip\.visual_encoder\.cls_token$", "vision_model.embeddings.class_embedding"),
    (r"^blip\.visual_encoder\.pos_embed$", "vision_model.embeddings.position_embedding"),
    (r"^blip\.visual_encoder\.patch_embed\.proj\.", "vision_model.embeddings.patch_embedding."),
    (r"^blip\.visual_encoder\.blocks\.(\d+)\.norm1\.", r"vision_model.encoder.layers.\1.layer_norm1."),
    (r"^blip\.visual_encoder\.blocks\.(\d+)\.norm2\.", r"vision_model.encoder.layers.\1.layer_norm2."),
    (r"^blip\.visual_encoder\.blocks\.(\d+)\.attn\.qkv\.", r"vision_model.encoder.layers.\1.self_attn.qkv."),
    (r"^blip\.visual_encoder\.blocks\.(\d+)\.attn\.proj\.", r"vision_model.encoder.layers.\1.self_attn.projection."),
    (r"^blip\.visual_encoder\.blocks\.(\d+)\.mlp\.", r"vision_model.encoder.layers.\1.mlp."),
    (r"^blip\.visual_encoder\.norm\.", "vision_model.post_layernorm."),
    (r"^blip\.text_encoder\.", "text_encoder."),
    (r"^mlp\.layers\.", "mlp."),
)
# in the checkpoint, unused by the score: BLIP's contrastive projections and the text position ids buffer
UNUSED_KEYS = re.compile(r"^blip\.(vision_proj|text_proj)\.|position_ids$")


class ImageRewardNet(nn.Module):
    """BLIP's ViT, its cross-attending BERT and the MLP: pixels [B, 3, 224, 224] and tokens [B, L] -> r [B]
    (float32, standardised)."""

    def __init__(self, config):
        from transformers import BlipTextModel, BlipVisionModel  # local: transformers takes seconds to import

        super().__init__()
        self.vision_model = BlipVisionModel(config.vision_config)
        self.text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        self.mlp = aesthetic_head(config.text_config.hidden_size)

    def forward(self, pixels: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        image_tokens = self.vision_model(pixel_values=pixels).last_hidden_state  # [B, 1 + patches, D_v]
        text = self.text_encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_tokens,
            encoder_attention_mask=torch.ones(image_tokens.shape[:2], dtype=torch.long, device=pixels.device),
        ).last_hidden_state
        first = text[:, 0].float()  # the [CLS] feature, in float32 as inference_rank (line 166)
        return (self.mlp(first).squeeze(1) - SCORE_MEAN) / SCORE_STD


@register_model("imagereward")
class ImageReward(ModelReward):
    """ImageReward's standardised preference score of an image for its prompt (see the module docstring)."""

    @classmethod
    def folder_problem(cls, folder: Path) -> str | None:
        problem = model_folder_problem(folder, FOLDER)
        if problem is None and not (folder / "model.safetensors").is_file():
            return "has no model.safetensors (python -m lean.rewards.imagereward writes it from ImageReward.pt)"
        return problem or tokenizer_problem(folder, ("tokenizer.json",), ("vocab.txt",))

    def __init__(self, settings: RewardModelConfig, device: torch.device | str):
        from safetensors.torch import load_file
        from transformers import AutoTokenizer, BlipConfig

        super().__init__(settings, device)
        folder = Path(settings.folder)
        self.device, self.dtype = torch.device(settings.device or device), DTYPES[settings.dtype]
        config = BlipConfig.from_pretrained(folder)
        self.model = ImageRewardNet(config)
        self.model.load_state_dict(load_file(folder / "model.safetensors"))
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.model.mlp.float()
        self.transform = ImageTransform(folder, config.vision_config.image_size)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)

    @torch.no_grad()
    def score_images(self, images: Tensor, prompts: list[str]) -> Tensor:
        n, scores = self.settings.batch_size, []
        for i in range(0, len(prompts), n):
            pixels = self.transform(images[i : i + n].to(self.device)).to(self.dtype)
            tokens = self.tokenizer(
                prompts[i : i + n], padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
            ).to(self.device)
            scores.append(self.model(pixels, tokens.input_ids, tokens.attention_mask).cpu())
        return torch.cat(scores).to(torch.float64)


def from_official(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The official ``ImageReward.pt`` state dict (``ImageReward`` of ImageReward.py: ``blip.visual_encoder.*``,
    ``blip.text_encoder.*``, ``mlp.layers.*``) -> :class:`ImageRewardNet`'s keys; BLIP's unused projections dropped.
    ``ValueError`` naming a key it does not know."""
    out = {}
    for key, value in state.items():
        if UNUSED_KEYS.search(key):
            continue
        for pattern, target in VISION_KEYS:
            if re.match(pattern, key):
                out[re.sub(pattern, target, key)] = value
                break
        else:
            raise ValueError(
                f"{key}: not a key of ImageReward's checkpoint (blip.visual_encoder, blip.text_encoder, mlp)"
            )
    return out


def blip_config(state: dict[str, Tensor], med_config: dict, tokenizer, vision_heads: int = VIT_LARGE_HEADS):
    """The BlipConfig of :class:`ImageRewardNet` for ``state`` (lean's keys): the ViT's sizes read from the weights
    (ImageReward's is ViT-L/16 at 224, layer norm eps 1e-6 as BLIP's vit.py), the text encoder's from
    ``med_config`` (ImageReward's med_config.json) with cross-attention to the ViT's width, its special token ids
    from ``tokenizer``'s."""
    from transformers import BlipConfig

    patch = state["vision_model.embeddings.patch_embedding.weight"]
    positions = state["vision_model.embeddings.position_embedding"].shape[1] - 1
    layers = {int(k.split(".")[3]) for k in state if k.startswith("vision_model.encoder.layers.")}
    vision = dict(
        hidden_size=patch.shape[0],
        intermediate_size=state["vision_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=len(layers),
        num_attention_heads=vision_heads,
        patch_size=patch.shape[-1],
        image_size=round(positions**0.5) * patch.shape[-1],
        layer_norm_eps=1e-6,
    )
    names = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    text = {k: med_config[k] for k in (*names, "max_position_embeddings", "layer_norm_eps", "hidden_act")}
    text.update(encoder_hidden_size=patch.shape[0], is_decoder=True, pad_token_id=tokenizer.pad_token_id)
    text.update(bos_token_id=tokenizer.bos_token_id, sep_token_id=tokenizer.sep_token_id)
    return BlipConfig(vision_config=vision, text_config=text)


def convert(checkpoint: Path, med_config: Path, tokenizer: Path, out: Path, vision_heads: int = VIT_LARGE_HEADS):
    """Write lean's ImageReward folder ``out`` from the official ``checkpoint`` (ImageReward.pt), its
    ``med_config`` (med_config.json) and a bert-base-uncased ``tokenizer`` folder, to which BLIP's special tokens
    are added as BLIP's init_tokenizer does (blip.py lines 16-21)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)  # a plain state dict of tensors
    state = from_official(state.get("model", state))
    config = blip_config(state, json.loads(Path(med_config).read_text()), tok, vision_heads)
    ImageRewardNet(config).load_state_dict(state)  # every weight present, every shape right
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.architectures = [FOLDER.architecture]
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    tok.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lean.rewards.imagereward", description=convert.__doc__)
    parser.add_argument("checkpoint", type=Path, help="ImageReward.pt (huggingface.co/THUDM/ImageReward)")
    parser.add_argument("med_config", type=Path, help="med_config.json (the same repository)")
    parser.add_argument("tokenizer", type=Path, help="a bert-base-uncased tokenizer folder")
    parser.add_argument("out", type=Path, help="the folder to write (reward.models.imagereward.folder)")
    parser.add_argument("--vision-heads", type=int, default=VIT_LARGE_HEADS)
    args = parser.parse_args(argv)
    convert(args.checkpoint, args.med_config, args.tokenizer, args.out, args.vision_heads)


if __name__ == "__main__":
    main()
