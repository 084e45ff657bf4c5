"""The ``ocr`` reward (lean/rewards/ocr.py): FlowGRPO's formula (flow_grpo/ocr.py at ac4c86e) without the engine, then
PP-OCRv5 (the extra ``ocr``) reading rendered text: the matching prompts score >= 0.95, shuffled ones <= 0.3."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from lean.config import ConfigError
from lean.configure import load_config
from lean.rewards import REWARDS
from lean.rewards import ocr as ocr_module
from lean.rewards.ocr import OcrEngine, edit_distance, quoted_text, text_reward

# 20 texts, each rendered in an image; the prompts name them as FlowGRPO's dataset/ocr does (the text in quotes)
TEXTS = [
    "Hello World",
    "Spring Sale",
    "Open 24 Hours",
    "Good Morning",
    "Forever Yours",
    "Lost City",
    "Step Goal",
    "Try Our Burger",
    "Welcome Home",
    "Happy Birthday",
    "Exit 42",
    "Fresh Coffee",
    "Keep Calm",
    "Night Market",
    "Gate B7",
    "Mountain View",
    "Blue Moon Cafe",
    "Stop",
    "Vote 2026",
    "Big Sale Today",
]


def prompt(text: str) -> str:
    return f'A shop sign at dusk that reads "{text}", photographed from across the street'


@pytest.mark.parametrize(
    "target, recognized, reward",
    [
        ("Hello World", "HELLO WORLD", 1.0),  # case and spaces do not count (ocr.py:46-47)
        ("Hello World", "helloworld", 1.0),
        ("Sale", "BIG SALE TODAY", 1.0),  # the target inside more text: distance 0 (:48-49)
        ("Hello", "Hallo", 0.8),  # one substitution in 5 characters
        ("Hello", "Hell", 0.8),  # one deletion
        ("Hello", "", 0.0),  # nothing read: distance |t| (:51), reward 0
        ("Hi", "completely unrelated", 0.0),  # the distance clipped at |t| (:53-54), not below 0
        ("ab c", "abd", 2 / 3),  # |t| counts without spaces: "abc", one substitution
        ("Exit 42", "exit 4z", 5 / 6),
    ],
)
def test_the_formula_is_flowgrpos(target, recognized, reward):
    assert text_reward(target, recognized) == pytest.approx(reward, abs=1e-12)


def test_edit_distance_and_quoted_text():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3 and edit_distance("abc", "") == 3
    assert edit_distance("flaw", "lawn") == 2 and edit_distance("same", "same") == 0
    assert quoted_text('a sign "Open" and "Closed"') == "Open"  # the first quoted text: split('"')[1]
    assert quoted_text('an unclosed "Open late') == "Open late"  # after a lone quote: the rest, as split('"')[1]
    for bad in ("a sign without quotes", 'an empty "" quote', 'spaces "   " only'):
        with pytest.raises(ValueError, match="quotes no text"):
            quoted_text(bad)


def test_a_run_refuses_prompts_without_quotes_and_a_missing_extra(monkeypatch):
    cfg = load_config(None, [], preset="flowgrpo-ocr-sd3")  # its prompts quote their text
    assert cfg.reward.weights == {"ocr": 1.0} and all('"' in p for p in cfg.train.prompts)
    with pytest.raises(ConfigError, match=r"train\.prompts=.*scores text in quotes"):
        load_config(None, ['train.prompts=["a cat on a mat"]'], preset="flowgrpo-ocr-sd3")
    with pytest.raises(ConfigError, match=r"eval\.prompts=.*scores text in quotes"):
        load_config(None, ['eval.prompts=["a cat on a mat"]'], preset="flowgrpo-ocr-sd3")
    monkeypatch.setattr(ocr_module, "installed", lambda: False)
    with pytest.raises(ConfigError, match=r"needs the extra 'ocr': pip install 'lean\[ocr\]'") as err:
        load_config(None, [], preset="flowgrpo-ocr-sd3")
    assert "\n" not in str(err.value)
    served = load_config(None, ["reward.remote.ocr.url=http://127.0.0.1:8100"], preset="flowgrpo-ocr-sd3")
    assert "ocr" in served.reward.remote  # a served "ocr" is the server's (its extra, its prompt format)
    with pytest.raises(ImportError, match="needs the extra 'ocr'"):
        OcrEngine()


def font(size: int) -> ImageFont.ImageFont:
    """A system TrueType font (DejaVu Sans, found by name), else PIL's own scalable default."""
    try:
        return ImageFont.truetype("DejaVuSans.ttf", size)
    except OSError:
        return ImageFont.load_default(size=size)


def rendered(texts: list[str], size: tuple[int, int] = (320, 96)) -> torch.Tensor:
    """Dark text centred on a light background: float [B, 3, H, W] in [0, 1]."""
    face, images = font(28), []
    for text in texts:
        image = Image.new("RGB", size, (250, 245, 235))
        draw = ImageDraw.Draw(image)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=face)
        position = ((size[0] - (right - left)) // 2 - left, (size[1] - (bottom - top)) // 2 - top)
        draw.text(position, text, fill=(20, 20, 40), font=face)
        images.append(torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255)
    return torch.stack(images)


@pytest.mark.timeout(120)
def test_pp_ocr_reads_rendered_text_and_scores_the_matching_prompts(tmp_path):
    images = rendered(TEXTS)
    matching = REWARDS["ocr"](images, [prompt(t) for t in TEXTS])
    shuffled = REWARDS["ocr"](images, [prompt(t) for t in TEXTS[1:] + TEXTS[:1]])  # each image, another's text
    assert matching.dtype == torch.float64 and matching.shape == (20,)
    assert matching.mean() >= 0.95, matching.tolist()
    assert shuffled.mean() <= 0.3, shuffled.tolist()
    assert ((matching >= 0) & (matching <= 1)).all() and ((shuffled >= 0) & (shuffled <= 1)).all()


def test_the_engine_writes_nothing_in_the_working_folder(tmp_path):
    engine = OcrEngine()  # the conftest runs each test in tmp_path: the wheel would write ./cache/onnxruntime there
    assert engine.read(np.full((64, 64, 3), 128, dtype=np.uint8)) == ""  # nothing to read
    assert list(tmp_path.iterdir()) == []
