"""Rewards that load a CLIP model from a local folder (no hub): ``clip_score``, ``pickscore``, ``hps``, ``aesthetic``,
``image_similarity`` (an edit against its reference image).

Each folder is a transformers CLIP folder as ``CLIPModel.save_pretrained`` writes it: ``config.json`` (model_type
``clip``), the weights (``model.safetensors`` or ``pytorch_model.bin``, or a sharded index), the tokenizer
(``tokenizer.json``, or ``vocab.json`` + ``merges.txt``; not needed by ``aesthetic``) and, optionally,
``preprocessor_config.json`` (the image size, crop, mean and std; without it: the vision tower's image size and
CLIP's OpenAI mean/std). With ``e_i``, ``e_t`` the L2-normalised projected image and text embeddings:

* ``clip_score``: ``cos = e_i · e_t`` (in [-1, 1]). Other conventions are multiples of it: torchmetrics' CLIPScore
  ``100 · max(cos, 0)``, Hessel et al.'s CLIP-S ``2.5 · max(cos, 0)``; FlowGRPO forks' ``ClipScorer``
  (flow_grpo/clip_scorer.py, e.g. Ren-creater/flow_grpo at edab61f, ``__call__``: ``logits_per_image.diagonal()/30``)
  is ``logit_scale · cos / 30`` = ``cos · 100/30`` for OpenAI's CLIP: set the weight to 3.33 to match it.
* ``pickscore``: ``exp(logit_scale) · cos``, PickScore's published score (the scaled logits of its CLIP-H,
  yuvalkirstain/PickScore_v1, about 18-23). FlowGRPO divides it by 26 (flow_grpo/pickscore_scorer.py at ac4c86e,
  lines 45-49: ``scores = logit_scale * (text_embs @ image_embs.T)``, ``scores.diag()``, ``scores/26``): use the
  weight 1/26 = 0.0385 to match. The folder is PickScore's model folder with the processor files of
  laion/CLIP-ViT-H-14-laion2B-s32B-b79K (PickScore's processor) copied in.
* ``hps``: ``cos``, HPSv2's score (the diagonal of ``image_features @ text_features.T`` of normalised open_clip
  features; FlowGRPO's flow_grpo/hpsv2_scorer.py at 94e23ee, ``HPSv2RewardInferencer.reward``). HPSv2 ships open_clip
  checkpoints (``HPS_v2.1_compressed.pt``, a ViT-H-14): lean loads a transformers CLIP folder, so convert the
  checkpoint first (open_clip ViT-H-14 -> ``CLIPModel``, e.g. with transformers' CLIP conversion script); open_clip's
  validation transform (shortest side to 224, bicubic, centre crop, OpenAI mean/std) is what
  ``preprocessor_config.json`` of CLIP-H describes. HPS v1 scaled the cosine by 100: use the weight 100 for it.
* ``image_similarity``: ``cos(e_i, e_ref)``, the sample's image embedding against its reference image's (edits:
  :class:`lean.config.prompts.ImagePrompt`), as FlowGRPO's edit scripts reward fidelity to the input image.
* ``aesthetic``: LAION's improved aesthetic predictor: ``MLP(e_i)`` with the MLP
  ``Linear(D, 1024) Dropout Linear(1024, 128) Dropout Linear(128, 64) Dropout Linear(64, 16) Linear(16, 1)`` on the
  normalised CLIP image embedding (FlowGRPO: flow_grpo/aesthetic_scorer.py at ac4c86e, lines 13-25 the MLP, 50-53
  the normalised embedding; it uses openai/clip-vit-large-patch14, D = 768). D is the folder's CLIP projection dim.
  The head's state dict (keys ``layers.0.weight`` ... ``layers.7.bias``, as in LAION's
  ``sac+logos+ava1-l14-linearMSE.pth``) is the folder's ``aesthetic_head.safetensors`` or its one ``*.pth`` file,
  next to the CLIP files.

Images are preprocessed in torch on the reward's device (no PIL round trip): resize (shortest side, bicubic,
antialiased, clamped to [0, 1]), centre crop, normalise; the same steps as ``CLIPImageProcessor`` up to its 8-bit
rounding. Text embeddings are computed once per distinct prompt of a batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lean.config.dtypes import DTYPES
from lean.rewards.base import ModelReward, register_model

if TYPE_CHECKING:
    from lean.rewards.options import RewardModelConfig

WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIPImageProcessor's defaults (OpenAI's CLIP)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HEAD_FILE = "aesthetic_head.safetensors"


@dataclass(frozen=True)
class FolderKind:
    """What a model reward's folder holds: config.json's ``model_type`` or ``architecture``, and how it is written
    (``layout``, quoted in the errors)."""

    display: str  # in messages: "CLIP"
    model_type: str
    architecture: str
    layout: str


CLIP_FOLDER = FolderKind(
    "CLIP", "clip", "CLIPModel", "a transformers CLIP folder, as CLIPModel.save_pretrained writes it"
)


def model_folder_problem(folder: Path, kind: FolderKind) -> str | None:
    """What keeps ``folder`` from loading as a transformers model of ``kind`` (config.json, weights), one line; or
    None. Reads config.json and lists files: no model is built."""
    if not folder.is_dir():
        return f"is not a folder ({kind.layout})"
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        return f"has no config.json ({kind.layout})"
    except (OSError, ValueError) as err:
        return f"config.json is not readable JSON ({str(err).splitlines()[0]})"
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    if model_type != kind.model_type and kind.architecture not in architectures:
        return (
            f"config.json holds model_type={model_type!r}, architectures={architectures}; "
            f"need a {kind.display} model ({kind.model_type}, {kind.architecture})"
        )
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        return f"has no weights ({', '.join(WEIGHT_FILES)})"
    return None


def tokenizer_problem(folder: Path, *layouts: tuple[str, ...]) -> str | None:
    """None when ``folder`` holds every file of one of the tokenizer ``layouts``; else the one-line problem."""
    if any(all((folder / name).is_file() for name in files) for files in layouts):
        return None
    return f"has no tokenizer ({', or '.join(' + '.join(files) for files in layouts)})"


def clip_folder_problem(folder: Path, tokenizer: bool) -> str | None:
    """What keeps ``folder`` from loading as a transformers CLIP model (+ its tokenizer), one line; or None."""
    problem = model_folder_problem(folder, CLIP_FOLDER)
    if problem is None and tokenizer:
        return tokenizer_problem(folder, ("tokenizer.json",), ("vocab.json", "merges.txt"))
    return problem


def resize_bicubic(images: Tensor, size) -> Tensor:
    """[B, 3, H, W] in [0, 1] -> [B, 3, *size]: bicubic, antialiased (as PIL's resize), clamped to [0, 1]."""
    return F.interpolate(images, size=tuple(size), mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)


class ImageTransform:
    """CLIP's image preprocessing in torch: [B, 3, H, W] in [0, 1] -> normalised pixel values [B, 3, h, w]."""

    def __init__(self, folder: Path, image_size: int):
        path = folder / "preprocessor_config.json"
        spec = json.loads(path.read_text()) if path.is_file() else {}
        self.resize = _size(spec.get("size"), image_size) if spec.get("do_resize", True) else None
        self.crop = _size(spec.get("crop_size"), image_size) if spec.get("do_center_crop", True) else None
        self.normalize = spec.get("do_normalize", True)
        self.mean = torch.tensor(spec.get("image_mean", CLIP_MEAN)).view(1, 3, 1, 1)
        self.std = torch.tensor(spec.get("image_std", CLIP_STD)).view(1, 3, 1, 1)

    def __call__(self, images: Tensor) -> Tensor:
        x = images.float()
        h, w = x.shape[-2:]
        if self.resize is not None:
            if isinstance(self.resize, int):  # the shortest side to ``resize``, the aspect ratio kept
                short, long = min(h, w), max(h, w)
                size = (self.resize, int(self.resize * long / short))
                size = size if h <= w else size[::-1]
            else:
                size = self.resize
            if (h, w) != tuple(size):
                x = resize_bicubic(x, size)
        if self.crop is not None:
            ch, cw = (self.crop, self.crop) if isinstance(self.crop, int) else self.crop
            top, left = max(0, (x.shape[-2] - ch) // 2), max(0, (x.shape[-1] - cw) // 2)
            x = x[..., top : top + ch, left : left + cw]
        if self.normalize:
            x = (x - self.mean.to(x.device)) / self.std.to(x.device)
        return x


def _size(spec, default: int) -> int | tuple[int, int]:
    """A preprocessor size entry: ``{"shortest_edge": s}`` -> s; ``{"height": h, "width": w}`` -> (h, w); an int."""
    if spec is None:
        return default
    if isinstance(spec, int):
        return spec
    if "shortest_edge" in spec:
        return spec["shortest_edge"]
    return (spec["height"], spec["width"])


class ClipModelReward(ModelReward):
    """A CLIP model (and its tokenizer when :attr:`uses_prompts`) from ``settings.folder`` on the reward's device and
    dtype; batches of ``settings.batch_size`` images."""

    @classmethod
    def folder_problem(cls, folder: Path) -> str | None:
        return clip_folder_problem(folder, tokenizer=cls.uses_prompts)

    def __init__(self, settings: RewardModelConfig, device: torch.device | str):
        from transformers import AutoTokenizer, CLIPModel  # local: transformers takes seconds to import

        super().__init__(settings, device)
        folder = Path(settings.folder)
        self.device, self.dtype = torch.device(settings.device or device), DTYPES[settings.dtype]
        self.model = CLIPModel.from_pretrained(folder).to(self.device, self.dtype).eval().requires_grad_(False)
        self.transform = ImageTransform(folder, self.model.config.vision_config.image_size)
        self.tokenizer = AutoTokenizer.from_pretrained(folder) if self.uses_prompts else None
        self.max_length = self.model.config.text_config.max_position_embeddings

    @torch.no_grad()
    def image_embeds(self, images: Tensor) -> Tensor:
        """L2-normalised projected image embeddings [B, D] (float32)."""
        pixels = self.transform(images.to(self.device)).to(self.dtype)
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        return F.normalize(self.model.visual_projection(pooled).float(), dim=-1)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> Tensor:
        """L2-normalised projected text embeddings [B, D] (float32), each distinct prompt encoded once."""
        distinct = list(dict.fromkeys(prompts))
        tokens = self.tokenizer(
            distinct, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        pooled = self.model.text_model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).pooler_output
        embeds = F.normalize(self.model.text_projection(pooled).float(), dim=-1)
        return embeds[[distinct.index(p) for p in prompts]]

    def score_images(self, images: Tensor, prompts: list[str]) -> Tensor:
        n = self.settings.batch_size
        return torch.cat(
            [self.score_batch(images[i : i + n], prompts[i : i + n]).cpu() for i in range(0, len(prompts), n)]
        ).to(torch.float64)

    def score_batch(self, images: Tensor, prompts: list[str]) -> Tensor:
        raise NotImplementedError


class ClipSimilarity(ClipModelReward):
    """``scale · cos(e_i, e_t)`` with :meth:`scale` 1 (see the module docstring)."""

    def scale(self) -> float:
        return 1.0

    def score_batch(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.scale() * (self.image_embeds(images) * self.text_embeds(prompts)).sum(dim=-1)


@register_model("clip_score")
class ClipScore(ClipSimilarity):
    """CLIP score: the cosine similarity of the image and the prompt, in [-1, 1]."""


@register_model("pickscore")
class PickScore(ClipSimilarity):
    """PickScore: ``exp(logit_scale) · cos`` of PickScore's CLIP (its published scaled logits)."""

    def scale(self) -> float:
        return self.model.logit_scale.exp().item()


@register_model("image_similarity")
class ImageSimilarity(ClipModelReward):
    """An edit's fidelity to its reference: ``cos(e_i, e_ref)`` of the L2-normalised CLIP image embeddings of the
    sample and of its prompt's reference image (:class:`lean.config.prompts.ImagePrompt`), resized to the sample's size.
    FlowGRPO's ``image_similarity`` (flow_grpo/clip_scorer.py ``ClipScorer.image_similarity``, lines 56-68, with
    openai/clip-vit-large-patch14; flow_grpo/rewards.py ``multi_score``; yifan123/flow_grpo 9745241, read through
    its zhtmike mirror: the yifan123 snapshot ac4c86e predates the edit scripts)."""

    uses_prompts = False

    def score_batch(self, images: Tensor, prompts: list[str]) -> Tensor:
        from lean.config.prompts import reference_pixels  # local: a leaf module, but only edits need it

        references = torch.stack([reference_pixels(p, images.shape[-1]) for p in prompts])
        if references.shape[-2:] != images.shape[-2:]:  # a non-square sample: the reference at its size
            references = resize_bicubic(references, images.shape[-2:])
        return (self.image_embeds(images) * self.image_embeds(references)).sum(dim=-1)


@register_model("hps")
class HumanPreferenceScore(ClipSimilarity):
    """HPSv2: the cosine of the image and prompt embeddings of HPS's fine-tuned CLIP (a transformers folder)."""


def aesthetic_head(width: int) -> nn.Sequential:
    """LAION's aesthetic MLP on a ``width``-dim embedding (768 for CLIP ViT-L/14); keys ``layers.N.*`` as LAION's
    state dicts (the module is its ``layers``)."""
    return nn.Sequential(
        nn.Linear(width, 1024),
        nn.Dropout(0.2),
        nn.Linear(1024, 128),
        nn.Dropout(0.2),
        nn.Linear(128, 64),
        nn.Dropout(0.1),
        nn.Linear(64, 16),
        nn.Linear(16, 1),
    )


def head_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name == HEAD_FILE or p.suffix == ".pth")


@register_model("aesthetic")
class Aesthetic(ClipModelReward):
    """LAION's aesthetic predictor: the MLP head on the normalised CLIP image embedding (a score near 1-10)."""

    uses_prompts = False

    @classmethod
    def folder_problem(cls, folder: Path) -> str | None:
        problem = super().folder_problem(folder)
        if problem is None and len(head_files(folder)) != 1:
            found = [p.name for p in head_files(folder)]
            return f"needs one aesthetic head ({HEAD_FILE} or a .pth state dict, as LAION's), found {found or 'none'}"
        return problem

    def __init__(self, settings: RewardModelConfig, device: torch.device | str):
        super().__init__(settings, device)
        (path,) = head_files(Path(settings.folder))
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(path)
        else:  # a plain state dict of tensors: weights_only refuses anything else
            state = torch.load(path, map_location="cpu", weights_only=True)
        width = self.model.config.projection_dim
        self.head = aesthetic_head(width)
        first = state.get("layers.0.weight", state.get("0.weight"))
        if first is None or tuple(first.shape) != (1024, width):
            shape = None if first is None else tuple(first.shape)
            raise ValueError(f"{path}: layers.0.weight is {shape}, need (1024, {width}) (the CLIP projection dim)")
        self.head.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
        self.head.to(self.device, torch.float32).eval().requires_grad_(False)

    @torch.no_grad()
    def score_batch(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.head(self.image_embeds(images)).squeeze(1)
