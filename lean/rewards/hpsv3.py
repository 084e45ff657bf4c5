"""HPSv3 (Ma et al. 2025, MizzenAI/HPSv3) from a local folder: ``hpsv3``, the Human Preference Score v3.

The model (hpsv3/model/qwen2vl_trainer.py at MizzenAI/HPSv3 d232ff8, ``Qwen2VLRewardModelBT``; its config
hpsv3/config/HPSv3_7B.yaml: ``rm_head_type: ranknet``, ``output_dim: 2``, ``reward_token: special``,
``use_special_tokens: true``): Qwen2-VL-7B-Instruct reads a chat with the image and an instruction that ends in the
added token ``<|Reward|>``; the last hidden state ``h [B, 3584]`` at that token goes through the float32 head
``Linear(3584, 1024) ReLU Dropout(0.05) Linear(1024, 16) ReLU Linear(16, 2)`` (``rm_head``, keys ``rm_head.{0,3,5}``),
which gives ``(mu, sigma)`` of the preference distribution; the reward is ``mu`` (hpsv3/inference.py at 72b7eba:
``rewards[i][0]``, "miu and sigma. we select miu as the final output").

The message (``HPSv3RewardInferencer.prepare_batch``, inference.py): one user turn of the image, resized to
``256 * 28 * 28`` pixels (min = max pixels: qwen-vl-utils' smart_resize to multiples of 28), then
``INSTRUCTION.format(text_prompt=prompt) + prompt_with_special_token`` (hpsv3/dataset/data_collator_qwen.py; read
through its copy in sitatec/turbogen at 307aa74, core/services/media_scoring/image_scorer/utils.py: the official
file is not in the stored snapshot), rendered by Qwen2-VL's chat template with the generation prompt, padded on the
right. lean renders the same text (:data:`CHAT`) and patches the image in torch as Qwen2VLImageProcessor does
(:func:`image_patches`), from the float image (no 8-bit rounding).

The folder: Qwen2-VL-7B-Instruct's files (config.json with ``vocab_size`` set to the checkpoint's embedding rows,
151658: HPSv3 resized them to its tokenizer; tokenizer files with ``<|Reward|>`` added as a special token;
``preprocessor_config.json`` for the mean/std) and HPSv3's ``HPSv3.safetensors`` as ``model.safetensors`` (its
``rm_head.*`` tensors beside the model's; transformers renames the older ``model.*``/``visual.*`` keys on load).
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from lean.config.dtypes import DTYPES
from lean.rewards.base import ModelReward, register_model
from lean.rewards.models import CLIP_MEAN, CLIP_STD, FolderKind, model_folder_problem, resize_bicubic, tokenizer_problem

if TYPE_CHECKING:
    from lean.rewards.options import RewardModelConfig

REWARD_TOKEN = "<|Reward|>"
HEAD_PREFIX = "rm_head."
IMAGE_PIXELS = 256 * 28 * 28  # inference.py prepare_batch: min_pixels = max_pixels = 200704 (448 x 448 for a square)
FOLDER = FolderKind(
    "Qwen2-VL",
    "qwen2_vl",
    "Qwen2VLForConditionalGeneration",
    "Qwen2-VL-7B-Instruct's files with HPSv3.safetensors as model.safetensors (docs/rewards.md)",
)
# Qwen2-VL's chat template rendered for one user turn (an image, then text) and the generation prompt
CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|>{image}<|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n"
)
RATING_REQUEST = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"  # prompt_with_special_token
INSTRUCTION = (  # data_collator_qwen.py INSTRUCTION: what the rater weighs, then the prompt
    "\n"
    "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and "
    "give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 "
    "being the worst and 10 being the best. \n"
    "\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be "
    "considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, "
    "such as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and "
    "easy to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other "
    "visual elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color "
    "scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should "
    "convey a sense of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, "
    "violent, or adult material. If such content is present, the image quality and satisfaction score "
    "should be the lowest possible. \n"
    "\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, "
    "object) align with the textual description. The subject should match the description in terms of "
    "number, appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate "
    "how well the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in "
    "the image logically fit the scenario described in the prompt. The environment should support and "
    "enhance the subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, "
    "clothing, accessories, expressions, actions) are faithfully represented in the image. Minor "
    "deviations may be acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are "
    "captured in the image. The generated content should not introduce elements that conflict with or "
    "distort the original description.\n"
    "Textual prompt - {text_prompt}\n"
    "\n"
    "\n"
)


def hpsv3_text(prompt: str, image_tokens: int) -> str:
    """The chat HPSv3 scores: the image's ``image_tokens`` pads, the instruction with ``prompt``, the rating request."""
    return CHAT.format(
        image="<|image_pad|>" * image_tokens, text=INSTRUCTION.format(text_prompt=prompt) + RATING_REQUEST
    )


def smart_resize(height: int, width: int, factor: int, pixels: int) -> tuple[int, int]:
    """qwen-vl-utils' (and Qwen2VLImageProcessor's) ``smart_resize`` with min_pixels = max_pixels = ``pixels``: the
    size, in multiples of ``factor``, nearest ``pixels`` in area at the image's aspect ratio."""
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        h, w = (
            max(factor, math.floor(height / beta / factor) * factor),
            max(factor, math.floor(width / beta / factor) * factor),
        )
    elif h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def image_patches(images: Tensor, mean: Tensor, std: Tensor, vision) -> tuple[Tensor, Tensor]:
    """Qwen2VLImageProcessor's output for images [B, 3, H, W] in [0, 1], in torch: ``pixel_values [B·N, 3·T·P·P]``
    (each image resized by :func:`smart_resize`, normalised, repeated over the T = ``temporal_patch_size`` frames
    of a patch, cut into P x P patches ordered by merged M x M groups) and ``image_grid_thw [B, 3]`` = (1, h/P, w/P)."""
    p, m, t = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    b = images.shape[0]
    h, w = smart_resize(*images.shape[-2:], factor=p * m, pixels=IMAGE_PIXELS)
    x = (resize_bicubic(images.float(), (h, w)) - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    x = x.unsqueeze(1).expand(b, t, 3, h, w).reshape(b, t, 3, h // p // m, m, p, w // p // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(b * (h // p) * (w // p), 3 * t * p * p)
    grid = torch.tensor([[1, h // p, w // p]] * b, device=images.device)
    return x, grid


def head_files(folder: Path) -> dict[str, Path]:
    """``rm_head.*`` key -> the safetensors file holding it (the index's weight map, or model.safetensors' header)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weights = json.loads(index.read_text())["weight_map"]
        return {k: folder / f for k, f in weights.items() if k.startswith(HEAD_PREFIX)}
    path = folder / "model.safetensors"
    if not path.is_file():
        return {}
    with safe_open(path, "pt") as f:
        return {k: path for k in f.keys() if k.startswith(HEAD_PREFIX)}


def reward_head(folder: Path) -> nn.Sequential:
    """HPSv3's ``rm_head`` (ranknet) with its weights from the folder, sized by them; float32, eval mode."""
    from safetensors import safe_open

    state = {}
    for key, path in head_files(folder).items():
        with safe_open(path, "pt") as f:
            state[key.removeprefix(HEAD_PREFIX)] = f.get_tensor(key)
    hidden, width = state["0.weight"].shape[1], state["0.weight"].shape[0]
    narrow, out = state["3.weight"].shape[0], state["5.weight"].shape[0]
    head = nn.Sequential(
        nn.Linear(hidden, width),
        nn.ReLU(),
        nn.Dropout(0.05),
        nn.Linear(width, narrow),
        nn.ReLU(),
        nn.Linear(narrow, out),
    )
    head.load_state_dict(state)
    return head.float().eval().requires_grad_(False)


@register_model("hpsv3")
class HPSv3(ModelReward):
    """HPSv3's preference score ``mu`` of an image for its prompt (see the module docstring)."""

    @classmethod
    def folder_problem(cls, folder: Path) -> str | None:
        problem = model_folder_problem(folder, FOLDER) or tokenizer_problem(
            folder, ("tokenizer.json",), ("vocab.json", "merges.txt")
        )
        if problem is not None:
            return problem
        files = [folder / n for n in ("tokenizer.json", "tokenizer_config.json", "added_tokens.json")]
        if not any(REWARD_TOKEN in p.read_text() for p in files if p.is_file()):
            return f"its tokenizer has no {REWARD_TOKEN} token (HPSv3 adds it to Qwen2-VL's as a special token)"
        if not {f"{HEAD_PREFIX}{i}.weight" for i in (0, 3, 5)} <= set(head_files(folder)):
            return "has no rm_head.* tensors in model.safetensors (HPSv3.safetensors holds them)"
        return None

    def __init__(self, settings: RewardModelConfig, device: torch.device | str):
        from transformers import AutoTokenizer, Qwen2VLModel  # local: transformers takes seconds to import

        super().__init__(settings, device)
        folder = Path(settings.folder)
        self.device, self.dtype = torch.device(settings.device or device), DTYPES[settings.dtype]
        self.model = Qwen2VLModel.from_pretrained(folder, dtype=self.dtype).to(self.device).eval().requires_grad_(False)
        self.head = reward_head(folder).to(self.device)
        self.token_types = "mm_token_type_ids" in inspect.signature(self.model.forward).parameters
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.tokenizer.padding_side = "right"  # as HPSv3's processor (train.py create_model_and_processor)
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        path = folder / "preprocessor_config.json"
        spec = json.loads(path.read_text()) if path.is_file() else {}
        self.mean = torch.tensor(spec.get("image_mean", CLIP_MEAN), device=self.device)
        self.std = torch.tensor(spec.get("image_std", CLIP_STD), device=self.device)

    def score_images(self, images: Tensor, prompts: list[str]) -> Tensor:
        n = self.settings.batch_size
        return torch.cat([self.score_batch(images[i : i + n], prompts[i : i + n]) for i in range(0, len(prompts), n)])

    @torch.no_grad()
    def score_batch(self, images: Tensor, prompts: list[str]) -> Tensor:
        """``mu [B]`` (float64, on the CPU)."""
        vision = self.model.config.vision_config
        pixels, grid = image_patches(images.to(self.device), self.mean, self.std, vision)
        pads = int(grid[0].prod()) // vision.spatial_merge_size**2  # one token per merged M x M group
        tokens = self.tokenizer([hpsv3_text(p, pads) for p in prompts], padding=True, return_tensors="pt")
        ids = tokens.input_ids.to(self.device)
        if not bool(((ids == self.reward_id).sum(dim=1) == 1).all()):
            raise ValueError(f"hpsv3: every prompt must hold no {REWARD_TOKEN} of its own")
        inputs = dict(input_ids=ids, attention_mask=tokens.attention_mask.to(self.device), image_grid_thw=grid)
        if self.token_types:  # transformers 5 places the M-RoPE positions by them: 1 marks an image token
            inputs["mm_token_type_ids"] = (ids == self.model.config.image_token_id).int()
        hidden = self.model(pixel_values=pixels.to(self.dtype), **inputs).last_hidden_state
        return self.head(hidden[ids == self.reward_id].float())[:, 0].double().cpu()


def embedding_rows(checkpoint: Path) -> int:
    """The rows of the language model's token embedding in a safetensors ``checkpoint`` (header only)."""
    from safetensors import safe_open

    with safe_open(checkpoint, "pt") as f:
        key = next((k for k in f.keys() if k.endswith("embed_tokens.weight")), None)
        if key is None:
            raise ValueError(
                f"{checkpoint}: no *embed_tokens.weight (not a Qwen2-VL checkpoint such as HPSv3.safetensors)"
            )
        return f.get_slice(key).get_shape()[0]


def prepare(qwen_folder: Path, checkpoint: Path, out: Path) -> None:
    """Write the ``hpsv3`` folder ``out``: ``qwen_folder``'s files but its weights (Qwen2-VL-7B-Instruct's config,
    tokenizer, preprocessor), the tokenizer with ``<|Reward|>`` added as HPSv3's train.py adds it, config.json's
    vocab_size set to the ``checkpoint``'s embedding rows (HPSv3 resized them to its tokenizer), and ``checkpoint``
    (HPSv3.safetensors) linked as model.safetensors."""
    import shutil

    from transformers import AutoTokenizer

    qwen_folder, out = Path(qwen_folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for path in qwen_folder.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".bin", ".index.json")):
            shutil.copy2(path, out / path.name)
    tokenizer = AutoTokenizer.from_pretrained(qwen_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    rows = embedding_rows(checkpoint)
    for section in (config, config.get("text_config")):
        if section is not None:
            section["vocab_size"] = rows
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "model.safetensors").unlink(missing_ok=True)
    (out / "model.safetensors").symlink_to(Path(checkpoint).resolve())
    problem = HPSv3.folder_problem(out)
    if problem is not None:
        raise ValueError(f"{out}: {problem}")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lean.rewards.hpsv3", description=prepare.__doc__)
    parser.add_argument("qwen_folder", type=Path, help="Qwen/Qwen2-VL-7B-Instruct's folder")
    parser.add_argument("checkpoint", type=Path, help="HPSv3.safetensors (huggingface.co/MizzenAI/HPSv3)")
    parser.add_argument("out", type=Path, help="the folder to write (reward.models.hpsv3.folder)")
    args = parser.parse_args(argv)
    prepare(args.qwen_folder, args.checkpoint, args.out)


if __name__ == "__main__":
    main()
