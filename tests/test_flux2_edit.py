"""FLUX.2 editing (``model.edit``): FLUX.2 [dev] and [klein] conditioned on a reference image per prompt against
diffusers' Flux2Pipeline / Flux2KleinPipeline called with ``image=``, the edit mode's rules, and the Flow-Factory klein
preset shrunk to tiny training edits (reference | base | trained grid), every schedule exact in float64 with references.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import lean_here, tiny_preset_sets

from lean.config import ConfigError
from lean.config.prompts import read_prompts, reference_image, reference_pixels
from lean.configure import load_config
from lean.models import EDIT_PROMPTS, Guidance, build_policy, build_scheduler, time_shift
from lean.models.options import ModelConfig
from lean.sampling.sde import ode_step, sigma_schedule

EDITS = read_prompts(EDIT_PROMPTS)
STEPS = 2


@pytest.mark.parametrize("family", ["flux2", "flux2_klein"])
def test_edits_match_the_pipeline_called_with_image(family, tmp_path):
    """The reference's tokens and rotary ids, the transformer call with them beside the noisy tokens (CFG keeping
    them in both branches) and 2 guided Euler steps equal the pipeline's with ``image=`` on the same weights."""
    import diffusers
    from PIL import Image

    from lean.models.flux2.model import bn_stats, unpack, unpatchify

    policy = build_policy(ModelConfig(family=family, reference_resolution=64), EDITS)  # the pipelines' smallest
    policy.save_pretrained(tmp_path, adapter=False)
    pipe = getattr(diffusers, policy.pipeline_class).from_pretrained(tmp_path, scheduler=build_scheduler(family, None))
    pipe.set_progress_bar_config(disable=True)
    prompt, res = EDITS[1], policy.resolution
    pixels = reference_pixels(prompt, 64, lanczos=True)
    image = Image.fromarray((pixels.permute(1, 2, 0) * 255).round().byte().numpy())
    emb = policy.encode_prompts([prompt])
    assert emb.reference.shape == (1, 4 * policy.runtime.h * policy.runtime.w, policy.runtime.channels)

    x = policy.init_latents([torch.Generator().manual_seed(3)])
    s = 3.5
    call = dict(num_inference_steps=STEPS, guidance_scale=s, height=res, width=res, max_sequence_length=16)
    latents = unpack(x, policy.runtime.h, policy.runtime.w)
    expected = pipe(image=image, prompt=str(prompt), latents=latents, output_type="latent", **call).images
    guide = Guidance(guidance_embed=s) if family == "flux2" else Guidance(cfg=True, guidance_scale=s)
    shift, _ = time_shift(family, None, None, policy.runtime.image_seq_len, STEPS)  # the noisy tokens only
    sigmas = sigma_schedule(STEPS, shift, "uniform")
    with torch.no_grad():
        for i in range(STEPS):
            x = ode_step(policy.velocity(x, sigmas[i].expand(1), emb, guide), x, sigmas, i)
    if family == "flux2_klein":  # its "latent" output is the VAE's latent
        p = unpack(x, policy.runtime.h, policy.runtime.w)
        mean, std = bn_stats(policy.vae, p)
        x = unpatchify(p * std + mean)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)
    bare = copy.copy(emb)
    bare.reference = bare.negative = None
    x = policy.init_latents([torch.Generator().manual_seed(3)])
    with torch.no_grad():  # the reference matters
        assert not torch.allclose(policy.velocity(x, sigmas[:1], emb), policy.velocity(x, sigmas[:1], bare))


def test_edit_mode_rules():
    """FLUX.2 generates from text by default and edits when its prompts carry images or ``model.edit`` is set (then,
    without a prompt file, the bundled set); a mixed or contradicting setting is refused in one line."""
    assert all(reference_image(p) is None for p in load_config(None, ["model.family=flux2_klein"]).train.prompts)
    cfg = load_config(None, ["model.family=flux2_klein", "model.edit=true", "model.resolution=64"])
    assert cfg.train.prompts == EDITS
    cfg = load_config(
        None, ["model.family=flux2", f"train.prompts_file={EDIT_PROMPTS}", "model.reference_resolution=64"]
    )
    assert cfg.train.prompts == EDITS and cfg.model.edit is None
    refusals = [
        (["model.family=flux2_klein", "model.edit=false", f"train.prompts_file={EDIT_PROMPTS}"], "text-to-image run"),
        (["model.family=flux2_klein", f"eval.prompts_file={EDIT_PROMPTS}"], "text-to-image run"),
        (["model.family=flux2_klein", "model.edit=true", "model.resolution=64", "eval.prompts=[a cat]"], "needs one"),
        (["model.family=kontext", "model.edit=false"], "only edits"),
        (["model.family=flux", "model.edit=true"], "takes no reference image"),
        (["model.family=flux", "model.reference_resolution=64"], "takes no reference image"),
        (["model.family=flux2_klein", "model.reference_resolution=40"], "multiple of 16"),
        (["model.family=qwen_image_edit", "model.reference_resolution=64"], "encodes references at its own side"),
        (["model.family=flux2_klein", "model.edit=true"], "at least 64 px; these would be 32 px"),
    ]
    for sets, message in refusals:
        with pytest.raises(ConfigError, match=message):
            load_config(None, sets)


def test_reference_resolution_resizes_the_original_once(tmp_path):
    """``model.reference_resolution``: the reference encoded at that side (Lanczos from the original), whatever the
    samples' resolution."""
    policy = build_policy(ModelConfig(family="flux2_klein", reference_resolution=64), EDITS)
    emb = policy.encode_prompts(EDITS[:1])
    assert emb.reference.shape[1] == 4 * policy.runtime.h * policy.runtime.w  # a 64 px reference, 32 px samples
    x = policy.init_latents([torch.Generator().manual_seed(0)])
    assert policy.velocity(x, torch.tensor([0.5]), emb).shape == x.shape


KLEIN = "flowfactory-grpo-flux2-klein"
TINY = [*tiny_preset_sets(KLEIN), "train.iterations=1", "model.lora_rank=4"]  # references at 64 px


@pytest.mark.timeout(300)
def test_the_klein_preset_shrunk_to_tiny_trains_edits(tmp_path):
    """``lean train --preset flowfactory-grpo-flux2-klein`` at tiny size edits: its prompts carry reference images,
    and its evaluation writes edits.png (reference | base | trained); ``lean export --merge`` and ``lean sample`` draw
    the edits through Flux2KleinPipeline's ``image=``; the float64 certificate (Recompute, Retain and
    Reweight's gradients equal) passes with the references."""
    cfg = load_config(None, TINY, preset=KLEIN)
    assert cfg.model.edit and all(p.image for p in cfg.train.prompts)
    two = tmp_path / "two_edits.jsonl"  # evaluated and sampled: two of the bundled edits (absolute image paths)
    two.write_text("".join(json.dumps({"prompt": str(p), "image": p.image}) + "\n" for p in EDITS[:2]))
    evaluated = ["eval.every=1", "eval.samples_per_prompt=1", f"eval.prompts_file={two}"]
    sets = [a for s in [*TINY, *evaluated] for a in ("--set", s)]
    lean_here("train", "--preset", KLEIN, *sets, "--out", str(tmp_path / "run"))
    run = tmp_path / "run"
    assert (run / "eval" / "1" / "edits.png").is_file() and (run / "eval" / "0" / "samples.csv").is_file()  # base
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["edit"] is True and config["model"]["reference_resolution"] == 64

    # lean export --merge, then lean sample draws the edits with the pipeline's image= at the run's reference side
    lean_here("export", "--run", str(run), "--out", str(tmp_path / "merged"), "--merge")
    settings = json.loads((tmp_path / "merged" / "lean_sampling.json").read_text())
    assert settings["pipeline"] == "Flux2KleinPipeline" and settings["reference_resolution"] == 64
    out = tmp_path / "samples"
    lean_here("sample", "--pretrained", str(tmp_path / "merged"), "--prompts-file", str(two), "--out", str(out))
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["image"] for r in records] == [p.image for p in EDITS[:2]]
    assert all((out / r["file"]).is_file() for r in records)
    eq = [a for s in [*TINY, "model.dtype=float64"] for a in ("--set", s)]
    lean_here("equivalence", "--preset", KLEIN, *eq, "--out", str(tmp_path / "eq"))
    assert json.loads((tmp_path / "eq" / "equivalence.json").read_text())["passes"]
