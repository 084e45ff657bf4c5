"""Reward registry: determinism, JPEG sign, colour/position preferences, video reduction, weighted sums."""

import pytest
import torch

from lean.rewards import COLORS, REWARDS, compute_rewards, parse_colors

PROMPT = "a red circle on a white background"


def solid(color: str, size: int = 32) -> torch.Tensor:
    return torch.tensor(COLORS[color]).view(3, 1, 1).expand(3, size, size).clone()


def noisy(seed: int, batch: int = 2, size: int = 32) -> torch.Tensor:
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_registry_names():
    assert {"jpeg_compressibility", "jpeg_incompressibility", "color_match", "position_match"} <= set(REWARDS)


@pytest.mark.parametrize("name", sorted(REWARDS))
def test_deterministic_float64_batch(name):
    images, prompts = noisy(0, batch=3), [PROMPT, "a blue square on the left", "a photo"]
    if name == "ocr":  # it scores the text a prompt quotes (FlowGRPO's format), and refuses a prompt without
        prompts = [f'{p} reading "{p[:9]}"' for p in prompts]
    first, second = REWARDS[name](images, prompts), REWARDS[name](images.clone(), prompts)
    assert first.dtype == torch.float64 and first.shape == (3,)
    assert torch.equal(first, second)
    # each sample's score does not depend on its batch neighbours
    torch.testing.assert_close(REWARDS[name](images[1:2], prompts[1:2]), first[1:2], rtol=0, atol=0)


def test_jpeg_sign():
    flat = torch.full((1, 3, 32, 32), 0.5)
    images = (torch.cat([flat, noisy(1, batch=1)]) * 255).round() / 255  # on the uint8 grid
    small = REWARDS["jpeg_compressibility"](images, ["", ""])
    large = REWARDS["jpeg_incompressibility"](images, ["", ""])
    assert small[0] > small[1] and large[1] > large[0] and (large > 0).all()
    torch.testing.assert_close(small, -large / 500)  # FlowGRPO: -kB / 500 (flow_grpo/rewards.py)
    # images are quantised to uint8 first: an offset under half a level changes nothing
    torch.testing.assert_close(REWARDS["jpeg_incompressibility"](images + 0.3 / 255, ["", ""]), large, rtol=0, atol=0)


def test_parse_colors():
    assert parse_colors(PROMPT) == ("red", "white")
    assert parse_colors("A Black triangle on a GREEN background") == ("black", "green")
    assert parse_colors("a purple cat") == ("purple", None)
    assert parse_colors("something on a grey background") == (None, "grey")
    assert parse_colors("a cat on a mat") == (None, None)
    assert parse_colors("credited redwood") == (None, None)  # whole words only


def test_color_match_prefers_named_colours():
    score = REWARDS["color_match"]
    target = solid("white")
    target[:, 8:24, 8:24] = torch.tensor(COLORS["red"]).view(3, 1, 1)  # red centre box on white
    images = torch.stack([target, solid("red"), solid("blue"), noisy(2, batch=1)[0]])
    s = score(images, [PROMPT] * 4)
    assert s[0] == pytest.approx(1.0)
    assert s[0] > s[1] > s[2] and s[3] > s[2]
    assert score(images[:1], ["a cat on a mat"]).item() == 0.0


def test_color_match_is_smooth():
    red, blue = solid("red"), solid("blue")
    blends = torch.stack([red * a + blue * (1 - a) for a in torch.linspace(0, 1, 6)])
    s = REWARDS["color_match"](blends, ["a red circle"] * 6)
    assert (s.diff() > 0).all() and len(set(s.tolist())) == 6


def test_position_match():
    left_red = solid("black")
    left_red[:, :, :16] = torch.tensor(COLORS["red"]).view(3, 1, 1)
    right_red = left_red.flip(-1)
    images = torch.stack([left_red, right_red])
    s = REWARDS["position_match"](images, ["a red square on the left"] * 2)
    assert s[0] > 0 > s[1] and s[0] == pytest.approx(-s[1])
    corner = REWARDS["position_match"](images, ["a red dot in the top right"] * 2)
    assert corner[1] > corner[0]
    assert REWARDS["position_match"](images, ["a red square", "a square on the left"]).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("name", ["color_match", "jpeg_compressibility"])
def test_video_is_mean_over_frames(name):
    video = torch.rand(2, 3, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    prompts = [PROMPT, "a blue square on a yellow background"]
    per_frame = torch.stack([REWARDS[name](video[:, :, f], prompts) for f in range(4)], dim=1)
    out = REWARDS[name](video, prompts)
    assert out.shape == (2,) and out.dtype == torch.float64
    torch.testing.assert_close(out, per_frame.mean(dim=1))


def test_bad_inputs():
    with pytest.raises(ValueError, match="images"):
        REWARDS["color_match"](torch.rand(2, 4, 8, 8), ["a", "b"])
    with pytest.raises(ValueError, match="prompts"):
        REWARDS["color_match"](torch.rand(2, 3, 8, 8), ["a"])


def test_compute_rewards_weighted_sum():
    images, prompts = noisy(4), [PROMPT, "a green square on a black background"]
    total, parts = compute_rewards({"color_match": 2.0, "jpeg_compressibility": -0.5}, images, prompts)
    assert set(parts) == {"color_match", "jpeg_compressibility"}
    torch.testing.assert_close(parts["color_match"], REWARDS["color_match"](images, prompts))
    torch.testing.assert_close(total, 2.0 * parts["color_match"] - 0.5 * parts["jpeg_compressibility"])
    assert total.dtype == torch.float64
    with pytest.raises(ValueError, match="'sharpness': unknown"):
        compute_rewards({"color_match": 1.0, "sharpness": 1.0}, images, prompts)
    with pytest.raises(ValueError, match="'aesthetic': loads a model"):
        compute_rewards({"color_match": 1.0, "aesthetic": 1.0}, images, prompts)


def test_a_reward_that_reads_audio_is_handed_it_and_the_others_are_not():
    """scored() hands the decoded soundtracks to the rewards that declare reads_audio, and only to them."""
    from lean.rewards.base import reads_audio
    from lean.rewards.scorer import weighted_sum

    heard = []

    def loudness(images, prompts, audio=None):
        heard.append(audio)
        return audio.abs().mean((1, 2)).double()

    loudness.reads_audio = True
    frames_only = REWARDS["color_match"]
    assert reads_audio(loudness) and not reads_audio(frames_only)
    images, prompts = noisy(2), [PROMPT, PROMPT]
    audio = torch.tensor([[[0.5, -0.5]], [[0.25, 0.0]]])
    rewards = {"loud": loudness, "color_match": frames_only}
    total, parts = weighted_sum(rewards, {"loud": 1.0}, images, prompts, None, audio)
    assert heard == [audio]
    torch.testing.assert_close(total, torch.tensor([0.5, 0.125], dtype=torch.float64))
    with pytest.raises(TypeError):  # without the declaration a reward gets no audio= and does not ask for it
        frames_only(images, prompts, audio)
