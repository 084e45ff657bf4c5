"""ImageReward and HPSv3 (``lean.rewards.imagereward``, ``lean.rewards.hpsv3``) on tiny random folders built here:
ImageReward's converted from a checkpoint under the official key names and scored as BLIP's own ViT and
ImageReward's formula compute it; HPSv3's image patches as transformers' Qwen2-VL image processor cuts them; both
deterministic, batch-size invariant, float64 [B]; a bad folder is one config error line naming the key."""

import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny
from tiny_reward_models import official_imagereward_state, save_tiny_hpsv3, save_tiny_imagereward

from lean.config import ConfigError
from lean.rewards import MODEL_REWARDS
from lean.rewards.options import RewardModelConfig

PROMPTS = ["a cat", "a photo", "a red circle on a white background"]


@pytest.fixture(scope="module")
def imagereward_folder(tmp_path_factory):
    return save_tiny_imagereward(tmp_path_factory.mktemp("imagereward"))


@pytest.fixture(scope="module")
def hpsv3_folder(tmp_path_factory):
    return save_tiny_hpsv3(tmp_path_factory.mktemp("hpsv3"))


def build(name: str, folder):
    return MODEL_REWARDS[name](RewardModelConfig(folder=str(folder), dtype="float32"), "cpu")


def images(n: int, seed: int = 1) -> torch.Tensor:
    return torch.rand(n, 3, 40, 48, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["imagereward", "hpsv3"])
def test_scores_are_float64_deterministic_and_batch_invariant(name, imagereward_folder, hpsv3_folder):
    folder = imagereward_folder if name == "imagereward" else hpsv3_folder
    x, reward = images(3), build(name, folder)
    scores = reward(x, PROMPTS)
    assert scores.dtype == torch.float64 and scores.shape == (3,) and torch.isfinite(scores).all()
    assert torch.equal(scores, reward(x, PROMPTS))
    reward.settings = replace(reward.settings, batch_size=2)  # batches of 2 and 1: padded otherwise
    torch.testing.assert_close(reward(x, PROMPTS), scores, rtol=1e-5, atol=1e-6)
    assert not torch.equal(scores, reward(x.flip(0), PROMPTS))  # the image counts


def blip_vit(state: dict, pixels: torch.Tensor, heads: int = 2) -> torch.Tensor:
    """BLIP's timm ViT (ImageReward's models/BLIP/vit.py) on the official tensors: pre-norm blocks, final norm."""
    v = "blip.visual_encoder."
    patch = state[v + "patch_embed.proj.weight"]
    x = F.conv2d(pixels, patch, state[v + "patch_embed.proj.bias"], stride=patch.shape[-1]).flatten(2).mT
    x = torch.cat([state[v + "cls_token"].expand(len(x), -1, -1), x], dim=1) + state[v + "pos_embed"]
    width = x.shape[-1]

    def ln(y, name):
        return F.layer_norm(y, (width,), state[name + ".weight"], state[name + ".bias"], eps=1e-6)

    def lin(y, name):
        return F.linear(y, state[name + ".weight"], state[name + ".bias"])

    for i in range(len({k.split(".")[3] for k in state if k.startswith(v + "blocks.")})):
        b = f"{v}blocks.{i}."
        q, k, val = lin(ln(x, b + "norm1"), b + "attn.qkv").view(*x.shape[:2], 3, heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, val).transpose(1, 2).reshape(x.shape)
        x = x + lin(attended, b + "attn.proj")
        x = x + lin(F.gelu(lin(ln(x, b + "norm2"), b + "mlp.fc1")), b + "mlp.fc2")
    return ln(x, v + "norm")


def test_imagereward_is_blips_vit_bert_and_the_standardised_mlp(imagereward_folder):
    """r = (MLP(h_[CLS]) - 0.16717) / 1.03334 with the image tokens of BLIP's own ViT (ImageReward.py lines 80-81,
    139-168), on the official tensors the converter read."""
    from lean.rewards.imagereward import SCORE_MEAN, SCORE_STD

    reward, x = build("imagereward", imagereward_folder), images(2)
    vocab = reward.model.text_encoder.config.vocab_size
    state = official_imagereward_state(vocab)
    pixels = reward.transform(x)
    image_tokens = blip_vit(state, pixels)
    torch.testing.assert_close(reward.model.vision_model(pixel_values=pixels).last_hidden_state, image_tokens)
    tokens = reward.tokenizer(PROMPTS[:2], padding="max_length", max_length=35, return_tensors="pt")
    assert tokens.input_ids.shape == (2, 35)  # ImageReward pads every prompt to 35 tokens
    h = reward.model.text_encoder(
        input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, encoder_hidden_states=image_tokens
    ).last_hidden_state[:, 0]
    for index in (0, 2, 4, 6, 7):
        h = F.linear(h, state[f"mlp.layers.{index}.weight"], state[f"mlp.layers.{index}.bias"])
    expected = ((h.squeeze(1) - SCORE_MEAN) / SCORE_STD).double()
    torch.testing.assert_close(reward(x, PROMPTS[:2]), expected, rtol=1e-5, atol=1e-5)


def test_the_converter_names_a_key_it_does_not_know():
    from lean.rewards.imagereward import from_official

    with pytest.raises(ValueError, match=r"^blip\.itm_head\.weight: not a key of ImageReward's checkpoint"):
        from_official({"blip.itm_head.weight": torch.zeros(1)})


def test_hpsv3_patches_the_image_as_qwen2vl_image_processor():
    """448 x 448 pixels for a square (min = max = 256·28² as HPSv3's inference), then the processor's patches."""
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from transformers import Qwen2VLVisionConfig

    from lean.rewards.hpsv3 import image_patches, smart_resize
    from lean.rewards.models import CLIP_MEAN, CLIP_STD, resize_bicubic

    assert smart_resize(512, 512, 28, 256 * 28 * 28) == (448, 448)
    x = torch.rand(2, 3, 60, 40, generator=torch.Generator().manual_seed(0))
    pixels, grid = image_patches(x, torch.tensor(CLIP_MEAN), torch.tensor(CLIP_STD), Qwen2VLVisionConfig())
    resized = resize_bicubic(x, smart_resize(60, 40, 28, 256 * 28 * 28))
    processor = pil.Qwen2VLImageProcessorPil(image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD))
    expected = processor(
        images=[i.permute(1, 2, 0).numpy() for i in resized], do_resize=False, do_rescale=False, return_tensors="pt"
    )
    assert torch.equal(grid, expected["image_grid_thw"])
    torch.testing.assert_close(pixels, expected["pixel_values"])


def test_hpsv3_text_is_the_instruction_and_one_reward_token():
    from lean.rewards.hpsv3 import hpsv3_text

    text = hpsv3_text("a cat", 3)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert "<|vision_start|><|image_pad|><|image_pad|><|image_pad|><|vision_end|>\nYou are tasked" in text
    assert "Textual prompt - a cat\n\n\n\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n") and text.count("<|Reward|>") == 1


def _broken(folder, tmp_path, remove: str):
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    if remove == "rm_head":
        from safetensors.torch import load_file, save_file

        weights = {k: v for k, v in load_file(bad / "model.safetensors").items() if not k.startswith("rm_head.")}
        save_file(weights, bad / "model.safetensors")
    else:
        (bad / remove).unlink()
    return bad


@pytest.mark.parametrize(
    "name,remove,message",
    [
        ("imagereward", "tokenizer.json", "has no tokenizer"),
        ("imagereward", "clip", r"config.json holds model_type='clip'.*need a BLIP model"),
        ("hpsv3", "rm_head", "has no rm_head.* tensors"),
        ("hpsv3", "config.json", "has no config.json"),
    ],
)
def test_a_bad_folder_is_one_config_error(
    name, remove, message, imagereward_folder, hpsv3_folder, clip_folder, tmp_path
):
    folder = imagereward_folder if name == "imagereward" else hpsv3_folder
    bad = clip_folder if remove == "clip" else _broken(folder, tmp_path, remove)
    tiny(f"reward.weights={{{name}: 1.0}}", f"reward.models.{name}.folder={folder}")  # the good one passes
    with pytest.raises(ConfigError, match=rf"^config error: reward.models.{name}.folder='.*': {message}") as err:
        tiny(f"reward.weights={{{name}: 1.0}}", f"reward.models.{name}.folder={bad}")
    assert "\n" not in str(err.value)
