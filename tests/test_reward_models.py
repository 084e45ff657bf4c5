"""Model rewards (``lean.rewards.models``) on a tiny random CLIP folder saved here: each scores images and videos as
transformers' own CLIP forward does, preprocessing matches CLIPImageProcessor, a run builds them once, and a bad
folder is one config error line naming the key (``clip_folder``: tests/conftest.py)."""

import json
import shutil

import pytest
import torch
from helpers import CLIP_PROMPTS, tiny

from lean.cli import main
from lean.config import ConfigError
from lean.rewards import MODEL_REWARDS, Scorer
from lean.rewards.models import ClipModelReward, ImageTransform
from lean.rewards.options import RewardModelConfig


def images(seed: int, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def reference(name: str, folder, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """The score from transformers' CLIPModel.forward (logits_per_image = exp(logit_scale) * cos) and, for aesthetic,
    the head on the normalised get_image_features, on the same pixel values."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, CLIPModel

    from lean.rewards.models import aesthetic_head

    model = CLIPModel.from_pretrained(folder).eval()
    with torch.no_grad():
        if name == "aesthetic":
            embeds = model.get_image_features(pixel_values=pixels)
            embeds = getattr(embeds, "pooler_output", embeds)  # transformers 5 returns an output object
            head = aesthetic_head(embeds.shape[-1]).eval()
            head.load_state_dict(
                {k.removeprefix("layers."): v for k, v in load_file(folder / "aesthetic_head.safetensors").items()}
            )
            return head(embeds / embeds.norm(dim=-1, keepdim=True)).squeeze(1).double()
        tokens = AutoTokenizer.from_pretrained(folder)(prompts, padding=True, return_tensors="pt")
        logits = model(**tokens, pixel_values=pixels).logits_per_image.diagonal()
    scale = 1.0 if name in ("clip_score", "hps") else model.logit_scale.exp()
    return (logits / model.logit_scale.exp() * scale).double()


# the CLIP rewards (the others load other folders: their own tests); image_similarity scores edits: its own test
CLIP_REWARDS = [n for n in MODEL_REWARDS if issubclass(MODEL_REWARDS[n], ClipModelReward) and n != "image_similarity"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", CLIP_REWARDS)
def test_model_reward_scores_images_and_videos(name, clip_folder):
    reward = MODEL_REWARDS[name](RewardModelConfig(folder=str(clip_folder), batch_size=2), "cpu")
    batch, prompts = images(0, 4, 3, 32, 32), CLIP_PROMPTS
    scores = reward(batch, prompts)
    assert scores.dtype == torch.float64 and scores.shape == (4,) and torch.isfinite(scores).all()
    torch.testing.assert_close(
        scores, reference(name, clip_folder, reward.transform(batch), prompts), atol=1e-5, rtol=1e-5
    )
    assert scores.unique().numel() == 4  # the images (and prompts) tell apart
    torch.testing.assert_close(reward(batch[1:2], prompts[1:2]), scores[1:2], atol=1e-6, rtol=0)  # batch-independent
    video = images(1, 2, 3, 3, 40, 48)  # [B, 3, F, H, W], not square: resized and cropped
    per_frame = torch.stack([reward(video[:, :, f], prompts[:2]) for f in range(3)], dim=1)
    torch.testing.assert_close(reward(video, prompts[:2]), per_frame.mean(dim=1), atol=1e-6, rtol=0)


@pytest.mark.timeout(60)
def test_half_precision_and_a_device_of_its_own(clip_folder):
    full = MODEL_REWARDS["pickscore"](RewardModelConfig(folder=str(clip_folder)), "meta")  # settings.device wins
    half = MODEL_REWARDS["pickscore"](
        RewardModelConfig(folder=str(clip_folder), dtype="bfloat16", device="cpu"), "meta"
    )
    assert full.device == torch.device("meta") and half.device == torch.device("cpu")
    assert half.model.dtype == torch.bfloat16
    reference = MODEL_REWARDS["pickscore"](RewardModelConfig(folder=str(clip_folder)), "cpu")
    batch = images(2, 4, 3, 32, 32)
    torch.testing.assert_close(half(batch, CLIP_PROMPTS), reference(batch, CLIP_PROMPTS), atol=0.1, rtol=0.02)


def test_preprocessing_matches_clip_image_processor(clip_folder):
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor.from_pretrained(clip_folder)
    transform = ImageTransform(clip_folder, 32)
    on_grid = (images(3, 2, 3, 32, 32) * 255).round() / 255  # 8-bit values at the model's size: no resampling
    pil = processor(images=list((on_grid * 255).round().to(torch.uint8)), return_tensors="pt").pixel_values
    torch.testing.assert_close(transform(on_grid), pil, atol=1e-5, rtol=0)
    smooth = torch.nn.functional.interpolate(on_grid, size=(48, 64), mode="bilinear")  # resize + crop
    pil = processor(images=list((smooth * 255).round().to(torch.uint8)), return_tensors="pt").pixel_values
    assert transform(smooth).shape == pil.shape == (2, 3, 32, 32)
    assert (transform(smooth) - pil).abs().mean() < 0.03  # PIL's bicubic on 8 bits vs torch's on floats


@pytest.mark.timeout(60)
def test_scorer_sums_model_and_builtin_rewards(clip_folder):
    cfg = tiny(
        "reward.weights={clip_score: 2.0, color_match: 0.5}", f"reward.models.clip_score.folder={clip_folder}"
    ).reward
    scorer = Scorer(cfg, "cpu")
    batch = images(4, 4, 3, 32, 32)
    total, parts = scorer(batch, CLIP_PROMPTS)
    assert set(parts) == {"clip_score", "color_match"}
    torch.testing.assert_close(total, 2.0 * parts["clip_score"] + 0.5 * parts["color_match"])
    torch.testing.assert_close(
        parts["clip_score"], MODEL_REWARDS["clip_score"](cfg.models["clip_score"], "cpu")(batch, CLIP_PROMPTS)
    )


def broken(folder, tmp_path, change: str):
    bad = tmp_path / change
    shutil.copytree(folder, bad)
    if change == "no_config":
        (bad / "config.json").unlink()
    elif change == "no_weights":
        (bad / "model.safetensors").unlink()
    elif change == "no_tokenizer":
        (bad / "tokenizer.json").unlink()
    elif change == "wrong_architecture":
        (bad / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5EncoderModel"]}))
    elif change == "two_heads":
        (bad / "sac+logos+ava1-l14-linearMSE.pth").write_bytes(b"")
    return bad


@pytest.mark.parametrize(
    "reward,change,message",
    [
        ("pickscore", "missing", "is not a folder"),
        ("pickscore", "no_config", "has no config.json"),
        ("clip_score", "no_weights", "has no weights"),
        ("hps", "no_tokenizer", "has no tokenizer"),
        ("pickscore", "wrong_architecture", "config.json holds model_type='t5'.*need a CLIP model"),
        ("aesthetic", "two_heads", "needs one aesthetic head"),
    ],
)
def test_a_bad_folder_is_one_config_error_naming_the_key(reward, change, message, clip_folder, tmp_path):
    folder = tmp_path / "nowhere" if change == "missing" else broken(clip_folder, tmp_path, change)
    with pytest.raises(ConfigError, match=rf"^config error: reward.models.{reward}.folder='.*': {message}") as err:
        tiny(f"reward.weights={{{reward}: 1.0}}", f"reward.models.{reward}.folder={folder}")
    assert "\n" not in str(err.value)


def test_model_entries_are_checked(clip_folder):
    with pytest.raises(ConfigError, match="reward.models.pickscore.folder=None: set the local model folder"):
        tiny("reward.weights={pickscore: 1.0}")
    with pytest.raises(ConfigError, match="reward.models.aesthetic.batch_size=0: must be > 0"):
        tiny(f"reward.models.aesthetic.folder={clip_folder}", "reward.models.aesthetic.batch_size=0")
    with pytest.raises(ConfigError, match="reward.models.aesthetic.dtyp=.*unknown key.*did you mean 'dtype'"):
        tiny(f"reward.models.aesthetic.folder={clip_folder}", "reward.models.aesthetic.dtyp=float16")
    with pytest.raises(ConfigError, match="reward.models.color_match key='color_match': must be one of clip_score"):
        tiny(f"reward.models.color_match.folder={clip_folder}")


def test_lean_train_with_a_bad_folder_exits_2_with_one_line(tmp_path, capsys):
    code = main(
        ["train", "--params", "/dev/null", "--out", str(tmp_path)]
        + ["--set", "reward.weights={pickscore: 1.0}", "--set", f"reward.models.pickscore.folder={tmp_path}"]
    )
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"lean: config error: reward.models.pickscore.folder='{tmp_path}': has no config.json (a transformers CLIP "
        "folder, as CLIPModel.save_pretrained writes it)"
    ]


@pytest.mark.timeout(60)
def test_image_similarity_scores_an_edit_against_its_reference(clip_folder, tmp_path):
    """cos of the CLIP image embeddings of a sample and its prompt's reference: 1 for the reference itself, less for
    another image; a prompt without a reference is refused."""
    from PIL import Image

    from lean.config.prompts import ImagePrompt, reference_pixels

    prompts = []
    for k in range(2):
        path = tmp_path / f"{k}.png"
        pixels = (images(10 + k, 3, 32, 32).permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
        Image.fromarray(pixels).save(path)
        prompts.append(ImagePrompt("make it snowy", path))
    reward = MODEL_REWARDS["image_similarity"](RewardModelConfig(folder=str(clip_folder)), "cpu")
    references = torch.stack([reference_pixels(p, 32) for p in prompts])
    torch.testing.assert_close(reward(references, prompts), torch.ones(2, dtype=torch.float64), atol=1e-5, rtol=0)
    assert (reward(references.flip(0), prompts) < 1 - 1e-4).all()
    with pytest.raises(ValueError, match="no reference image"):
        reward(references, ["make it snowy", "make it snowy"])
