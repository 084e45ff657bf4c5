"""lean.models.ltx2: LTX-2 policies against diffusers' own LTX2Pipeline (Gemma-3 and the text connectors, the joint
video and audio Euler steps on the dynamically shifted grid, the video and audio decodes), the joint state on the SDE
trajectory (an audio entry moves the step's log-probability), the soundtrack handed to a reward that reads it, LoRA
targets, sizes, a saved pipeline folder, ``lean train``, the float64 certificate under the three schedules, the bf16
certificate, and the Flow-Factory preset planned at the published size.

One tiny float32 build (module-scoped) serves the tests that do not need float64.
"""

from __future__ import annotations

import copy
import json
import math
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import FAST, preset_value_lines, reference_gap, sets, spawn, uncited

from lean.cli import main
from lean.config import DEFAULT_PROMPTS
from lean.configure import load_config
from lean.export import LORA_WEIGHTS
from lean.models import Guidance, build_policy, count_parameters, family_spec, time_shift
from lean.models.options import ModelConfig
from lean.sampling.sde import ode_step, sigma_schedule

FAMILY = "ltx2"
PRESET = "flowfactory-grpo-ltx2"
ATOL = 1e-5  # float32
FRAMES = 9  # 8k + 1: 2 latent frames, 9 latent audio frames


def make(**overrides):
    return build_policy(ModelConfig(**{"family": FAMILY, "num_frames": FRAMES, **overrides}), DEFAULT_PROMPTS)


@pytest.fixture(scope="module")
def policy():
    """The shared tiny build (float32) with a non-zero LoRA."""
    p = make()
    p.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    return p


def inputs(policy, batch: int = 2, seed: int = 0):
    x = policy.init_latents([torch.Generator().manual_seed(seed + b) for b in range(batch)])
    sigma = torch.linspace(0.3, 0.9, batch, dtype=policy.dtype)
    return x, sigma, policy.encode_prompts(DEFAULT_PROMPTS[:batch])


def test_architecture_lora_targets_and_geometry(policy):
    base = policy.transformer.get_base_model()
    assert type(base).__name__ == "LTX2VideoTransformer3DModel"
    parts = {n: type(m).__name__ for n, m in policy.text_encoders.items()}
    assert parts == {
        "text_encoder": "Gemma3ForConditionalGeneration",
        "audio_vae": "AutoencoderKLLTX2Audio",
        "connectors": "LTX2TextConnectors",
        "vocoder": "LTX2VocoderWithBWE",
    }
    runtime = policy.runtime
    assert (runtime.frames, runtime.h, runtime.w, runtime.audio_frames) == (2, 1, 1, 9)  # 9 / 24 s x 25 a second
    assert runtime.noise_shape == (2 + 9, 16) and runtime.image_seq_len == 2
    suffixes = tuple(
        f"{a}.{p}"
        for a in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
        for p in ("to_q", "to_k", "to_v", "to_out.0")
    ) + ("ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")
    flowfactory = [n for n, _ in base.named_modules() if n.endswith(suffixes) and "lora" not in n]
    ffn = family_spec(FAMILY).lora_targets(True)
    assert len(flowfactory) == 28 and all(re.fullmatch(ffn, n) for n in flowfactory)  # 28 a block (Flow-Factory's)
    names = [n for n, _ in policy.trainable_parameters()]
    assert not any(".ff." in n or "audio_ff" in n for n in names)  # model.lora_ffn off: attention only
    with pytest.raises(ValueError, match="guidance"):
        policy.velocity(*inputs(policy, 1), Guidance(guidance_embed=3.5))
    with pytest.raises(ValueError, match="8k \\+ 1"):
        make(num_frames=5)


def _pipeline(policy):
    """diffusers' LTX2Pipeline of the shared build's modules (LoRA merged into a copy), the published scheduler."""
    import diffusers

    merged = copy.deepcopy(policy)
    parts = dict(merged.text_encoders)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(dict(family_spec(FAMILY).scheduler))
    return diffusers.LTX2Pipeline(
        scheduler=scheduler,
        vae=merged.vae,
        transformer=merged.transformer.merge_and_unload(),
        tokenizer=merged.tokenizers["tokenizer"],
        **parts,
    )


def test_matches_ltx2_pipeline(policy):
    """The joint state on 3 Euler steps of the dynamically shifted grid, from the same video and audio noise, and both
    decodes equal diffusers' LTX2Pipeline (no CFG, no STG, no modality guidance: Flow-Factory's training call)."""
    pipe = _pipeline(policy)
    prompts = DEFAULT_PROMPTS[:2]
    emb = policy.encode_prompts(prompts)
    shift, source = time_shift(FAMILY, None, None, policy.runtime.image_seq_len)
    assert "dynamic" in source
    sigmas = sigma_schedule(3, shift, "uniform")
    x = policy.init_latents([torch.Generator().manual_seed(b) for b in range(2)])
    video, audio = policy.runtime.split(x)
    unguided = dict(guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0)
    unguided |= dict(audio_guidance_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0)
    kwargs = dict(prompt=prompts, num_frames=FRAMES, height=32, width=32, num_inference_steps=3, **unguided)
    kwargs["max_sequence_length"] = policy.text_max_length
    with torch.no_grad():
        expected_video, expected_audio = pipe(
            latents=video.clone(), audio_latents=audio.clone(), output_type="latent", return_dict=False, **kwargs
        )
        torch.testing.assert_close(pipe.scheduler.sigmas.double(), sigmas, rtol=0, atol=1e-6)
        for i in range(3):
            x = ode_step(policy.velocity(x, sigmas[i].expand(2), emb), x, sigmas, i)
        ours_video, ours_audio = policy.runtime.split(x)
        torch.testing.assert_close(ours_video.transpose(1, 2).reshape(expected_video.shape), expected_video,
                                   rtol=ATOL, atol=ATOL)  # fmt: skip
        torch.testing.assert_close(ours_audio, expected_audio.transpose(1, 2).flatten(2), rtol=ATOL, atol=ATOL)
        frames, sound = pipe(latents=video.clone(), audio_latents=audio.clone(), output_type="pt", return_dict=False,
                             **kwargs)  # fmt: skip
    torch.testing.assert_close(policy.decode_audio(x), sound.float(), rtol=ATOL, atol=ATOL)
    # the two trajectories' last rounding differences (<= 1e-5), through the VAE
    torch.testing.assert_close(policy.decode(x), frames.permute(0, 2, 1, 3, 4), rtol=10 * ATOL, atol=10 * ATOL)


def test_the_audio_latents_are_on_the_sde_trajectory(policy):
    """The step's log-probability covers the audio tokens: moving one audio entry of x_{i+1} moves it (that row's
    only), as a video entry does; and the video velocity hears the audio input (the cross-modal attention)."""
    from lean.sampling.rollout import Sampler, policy_step
    from lean.sampling.transition import Transition

    cfg = load_config(None, [f"model.family={FAMILY}", "sample.num_steps=4", "sample.noise_level=0.7"])
    sampler = Sampler(cfg.sample, sigma_schedule(4, 3.0, "uniform"))
    x, _, emb = inputs(policy)
    gens = [torch.Generator().manual_seed(7 + b) for b in range(2)]
    with torch.no_grad():
        step = policy_step(policy, sampler, Transition(index=1, rows=slice(0, 2), sample=x), emb, generators=gens)
        scored = policy_step(
            policy, sampler, Transition(index=1, rows=slice(0, 2), sample=x, next_sample=step.next_sample), emb
        )
        torch.testing.assert_close(scored.log_prob, step.log_prob, rtol=0, atol=1e-6)
        audio_entry, video_entry = (policy.runtime.video_tokens + 3, 5), (1, 2)
        for token, channel in (audio_entry, video_entry):
            moved = step.next_sample.clone()
            moved[0, token, channel] += 0.5
            again = policy_step(
                policy, sampler, Transition(index=1, rows=slice(0, 2), sample=x, next_sample=moved), emb
            )
            assert abs(again.log_prob[0] - step.log_prob[0]) > 1e-4 and again.log_prob[1] == step.log_prob[1]
        heard = x.clone()
        heard[:, policy.runtime.video_tokens :] += 0.5
        v, v_heard = policy.velocity(x, torch.full((2,), 0.6), emb), policy.velocity(heard, torch.full((2,), 0.6), emb)
    video = slice(0, policy.runtime.video_tokens)
    assert (v[:, video] - v_heard[:, video]).abs().max() > 1e-4


def test_the_soundtrack_reaches_a_reward_that_reads_it(policy, tmp_path):
    """The rollout's decode (and the evaluation's) hands each sample's waveform to a reward that declares reads_audio
    (the frames to the others), and decodes none when no reward reads it."""
    from lean.evaluation import Evaluator
    from lean.observe.metrics import FlopTally
    from lean.run.iteration import IterationPipeline

    heard = []

    def loudness(images, prompts, audio=None):
        heard.append(audio)
        return audio.abs().mean((1, 2)).double()

    loudness.reads_audio = True
    overrides = [f"model.family={FAMILY}", f"model.num_frames={FRAMES}", "reward.weights={color_match: 1.0}"]
    cfg = load_config(None, [*overrides, "sample.shift=3.0", "sample.num_steps=2", "eval.prompts=[a red cube]"])
    pipeline = IterationPipeline(policy, cfg, sigma_schedule(4, 3.0, "uniform"))
    final = inputs(policy)[0]
    assert not pipeline.scorer.reads_audio
    frames_only = pipeline.decode_and_score(final, DEFAULT_PROMPTS[:2], FlopTally())
    pipeline.scorer.rewards["loud"], pipeline.scorer.weights["loud"] = loudness, 1.0
    scored = pipeline.decode_and_score(final, DEFAULT_PROMPTS[:2], FlopTally())
    waveforms = policy.decode_audio(final)
    assert len(heard) == 1 and waveforms.shape == (2, 2, 15840)  # stereo, 9 frames at 24 fps of 48 kHz audio
    torch.testing.assert_close(heard[0], waveforms)
    torch.testing.assert_close(scored.rewards, frames_only.rewards + waveforms.abs().mean((1, 2)).double())
    evaluation = Evaluator(pipeline, tmp_path).score()  # the evaluation's ODE samples: their soundtracks too
    assert len(heard) == 2 and heard[1].shape[1:] == (2, 15840) and evaluation.shape[1] == 2


def test_the_plan_decodes_the_soundtrack_when_a_reward_reads_it(monkeypatch):
    """``lean plan``'s decode term (the meta device) adds the audio VAE and vocoder when a weighted reward declares
    reads_audio, and only then: the difference is the soundtrack decode's own FLOPs."""
    from lean.observe.flops import FlopCounter
    from lean.plan.meta import meta_input, meta_probe
    from lean.rewards.base import REWARDS
    from lean.rewards.scorer import declared_reads_audio

    def loudness(images, prompts, audio=None):
        return audio.abs().mean((1, 2)).double()

    loudness.reads_audio = True
    monkeypatch.setitem(REWARDS, "loudness", loudness)
    base = [*FAST, f"model.family={FAMILY}", f"model.num_frames={FRAMES}"]
    probes = {}
    for weights in ("{color_match: 1.0}", "{color_match: 1.0, loudness: 0.5}"):
        cfg = load_config(None, [*base, f"reward.weights={weights}"])
        probes[declared_reads_audio(cfg.reward)] = meta_probe(meta_input(cfg, 1), 1.0)  # times counted in FLOPs
    inp = meta_input(cfg, 1)
    with FlopCounter() as sound:
        inp.policy.decode_audio(inp.policy.init_latents(inp.batch.generators[: probes[True]["batch"]]))
    assert sound.total > 0 and probes[True]["batch"] == probes[False]["batch"]
    assert probes[True]["t_decode"] == probes[False]["t_decode"] + sound.total
    assert probes[True]["decode_mb"] > probes[False]["decode_mb"]


def test_a_saved_pipeline_folder_loads_as_model_pretrained(policy, tmp_path):
    """Policy.save_pretrained writes every component, the connectors and vocoder under the pipeline's own module
    (model_index.json's "ltx2", as diffusers writes it); the folder loads as model.pretrained with the same velocity."""
    policy.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == "LTX2Pipeline" and index["connectors"] == ["ltx2", "LTX2TextConnectors"]
    assert index["audio_vae"] == ["diffusers", "AutoencoderKLLTX2Audio"]
    loaded = make(pretrained=str(tmp_path / "saved"))
    x, sigma, emb = inputs(policy)
    with torch.no_grad():
        expected = policy.velocity(x, sigma, emb)
        got = loaded.velocity(x, sigma, loaded.encode_prompts(DEFAULT_PROMPTS[:2]))
        torch.testing.assert_close(loaded.decode_audio(x), policy.decode_audio(x), rtol=ATOL, atol=ATOL)
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)


def test_sizes_and_full_size_parameter_count():
    """LTX-2.3's transformer, 48 blocks of two streams: 18.99B parameters, counted on the meta device."""
    assert count_parameters(FAMILY, "full") == pytest.approx(18.99e9, rel=1e-3)
    assert count_parameters(FAMILY, "tiny") < count_parameters(FAMILY, "small") < 1e7


# ---------------------------------------------------------------- sequence parallelism


def _sequence_parallel_worker(rank: int, world: int, port: int, out: str) -> None:
    """float64, LoRA on every layer Flow-Factory adapts: the velocity and the summed gradient shares over 2 ranks
    (each holding 1 of the 2 video tokens, the 9 audio tokens whole) against one process's."""
    from lean.models.sequence_parallel import enable
    from lean.parallel.overlap.p2p import METHODS, Overlap

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        policy = make(dtype="float64", lora_ffn=True)
        policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, *policy.latent_shape(), generator=g, dtype=torch.float64)
        sigma, emb = torch.tensor([0.7, 0.3], dtype=torch.float64), policy.encode_prompts(DEFAULT_PROMPTS[:2])
        weights = torch.randn(x.shape, generator=g, dtype=torch.float64)

        def velocity_and_grads():
            policy.zero_grad(set_to_none=True)
            v = policy.velocity(x, sigma, emb)
            (v * weights).sum().backward()
            return v.detach(), torch.cat([p.grad.reshape(-1) for _, p in policy.trainable_parameters()])

        v_ref, g_ref = velocity_and_grads()
        sp = enable(policy.networks(), policy.runtime, Overlap(METHODS[0]))
        errors = {}
        for method in METHODS:
            sp.ov = Overlap(method)
            v, grads = velocity_and_grads()
            dist.all_reduce(grads)  # each rank's gradient is its share's
            errors[method] = [
                ((v - v_ref).norm() / v_ref.norm()).item(),
                ((grads - g_ref).norm() / g_ref.norm()).item(),
            ]
        Path(out, f"rank{rank}.json").write_text(json.dumps(errors))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
def test_sequence_parallel_velocity_and_gradients_equal_one_process(tmp_path):
    spawn(_sequence_parallel_worker, 2, str(tmp_path), deadline_s=180)
    for rank in range(2):
        for method, (velocity, grads) in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            assert velocity < 1e-10 and grads < 1e-10, (rank, method, velocity, grads)


# ---------------------------------------------------------------- runs, the certificates


def test_lean_train_trains_one_iteration(tmp_path):
    """``lean train --set model.family=ltx2`` (tiny, CLI; the family's 9 frames for lean's default 5): one
    iteration, a finite reward, the LoRA written; exported and sampled with diffusers' LTX2Pipeline."""
    out = tmp_path / "run"
    assert main(["train", *sets(*FAST, f"model.family={FAMILY}"), "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["schedule"] == "recompute" and all(math.isfinite(r) for r in metrics["reward_mean"])
    config = json.loads((out / "config.json").read_text())["model"]
    assert config["family"] == FAMILY and config["num_frames"] == FRAMES
    assert (out / "lora" / LORA_WEIGHTS).is_file()
    # lean export --merge writes an LTX2Pipeline folder diffusers loads; lean sample draws a video with it
    assert main(["export", "--run", str(out), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    (tmp_path / "prompts.txt").write_text("a red cube\n")
    args = ["sample", "--pretrained", str(tmp_path / "merged"), "--prompts-file", str(tmp_path / "prompts.txt")]
    assert main([*args, "--out", str(tmp_path / "samples"), "--num-steps", "2"]) == 0
    assert (tmp_path / "samples" / "00000.gif").is_file()


def test_float64_equivalence_passes_at_1e_10(tmp_path, capsys):
    float64 = sets(*FAST, f"model.family={FAMILY}", "model.dtype=float64", "sample.num_steps=2")
    args = ["equivalence", *float64, "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["passes"] and "PASS" in capsys.readouterr().out
    assert set(report["reference"]) == {"recompute", "retain", "reweight"}
    assert reference_gap(report) < 1e-10


def test_bfloat16_certificate_runs(tmp_path):
    """In bf16 the schedules are held to the rounding's own tolerance against the float64 reference."""
    bf16 = sets(*FAST, f"model.family={FAMILY}", "model.dtype=bfloat16", "sample.num_steps=2")
    assert main(["equivalence", *bf16, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["passes"] and set(report["reference"]) == {"recompute", "retain", "reweight"}


# ---------------------------------------------------------------- the Flow-Factory preset


def test_preset_cites_every_value_and_plans_at_the_published_size(tmp_path):
    from lean.plan.cost import main as plan
    from lean.run.iteration import select_local_steps

    values = preset_value_lines(PRESET)
    assert len(values) >= 40 and uncited(values) == []
    cfg = load_config(None, [], preset=PRESET)
    m, s, a, t = cfg.model, cfg.sample, cfg.algorithm, cfg.train
    assert (m.family, m.size, m.resolution, m.width, m.num_frames, m.lora_rank, m.lora_alpha, m.lora_ffn) == (
        FAMILY, "full", 512, 768, 121, 64, 128, True
    )  # fmt: skip
    assert (s.num_steps, s.sde_kind, s.noise_level, s.cfg, s.sde_window, s.sde_steps_drawn) == (
        24,
        "cps",
        0.8,
        False,
        10,
        3,
    )
    assert (a.clip_range, a.beta, a.reward_combination, t.group_size, t.prompts_per_iteration) == (
        1e-4,
        0.0,
        "gdpo",
        16,
        48,
    )
    for iteration in range(20):  # 3 of the steps 0..9 (t2av_pickscore.yaml:100-101), drawn anew each iteration
        steps = torch.nonzero(select_local_steps(cfg, iteration, [(0, 0, 0)], None).stochastic.flatten()).flatten()
        assert len(steps) == 3 and steps.max() <= 9
    report = plan(cfg, out=str(tmp_path))["published_size"]
    assert report["transformer_parameters"] == pytest.approx(18.99e9, rel=1e-3)
    assert report["trainable_parameters"] > 0
