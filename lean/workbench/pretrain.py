"""Offline pretraining of a tiny base model on the procedural task of ``lean.workbench.data``, so that GRPO starts
from a policy that roughly follows its prompts (a random network gives reward curves that mean nothing).

Two phases, both on the synthetic images, all weights trained (no LoRA):

1. Autoencoder. The family's VAE, randomly initialised, learns to reconstruct the images (pixels in [-1, 1]):
       L_vae = ||D(mu(x)) - x||^2 + kl_weight KL(q(z|x) || N(0, I))
   (decoding the posterior mean: a sampled z makes the tiny decoder learn several times slower)
   Then the latent normalisation the pipeline applies (FLUX, SD3: scalar shift/scale; Wan: per-channel mean/std) is
   set to the statistics of the encoded data set, so normalised latents have zero mean and unit variance, like the
   noise.
2. Rectified flow. On normalised latents x0, with noise eps ~ N(0, I) and sigma drawn from the sampler's shifted
   schedule (sigma = s u / (1 + (s - 1) u), u ~ U(0, 1)):
       x_sigma = (1 - sigma) x0 + sigma eps,     L_fm = ||v_theta(x_sigma, sigma, c) - (eps - x0)||^2
   The caption c is replaced by the empty prompt with probability ``caption_dropout``, which teaches the unconditional
   velocity that classifier-free guidance subtracts.

The text encoders are trained with the transformer in phase 2 (frozen random encoders make the tiny model learn the
caption -> image map several times slower; GRPO freezes them again). The tokenizer is trained on every caption of
the task (``lean.workbench.data.vocabulary``), so every prompt built from its words reads without unknown tokens.
The result is written with ``Policy.save_pretrained`` and loads with ``model.pretrained: <folder>``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lean.config.dtypes import dtype_name
from lean.models.build import build_policy
from lean.models.options import ModelConfig
from lean.models.registry import family_spec
from lean.models.scheduler import time_shift
from lean.models.spec import SCALE_SHIFT
from lean.rewards import compute_rewards
from lean.sampling.options import SampleConfig
from lean.sampling.rollout import RolloutPlan, Sampler, rollout, sample_generator
from lean.sampling.sde import STEP_SELECTIONS, StepRule, select_steps, sigma_schedule
from lean.workbench.data import make_dataset, vocabulary


@dataclass
class PretrainConfig:
    images: int = 1024  # training images (scenes drawn with replacement)
    vae_steps: int = 300
    vae_lr: float = 3e-3
    kl_weight: float = 1e-4
    steps: int = 500  # flow-matching steps
    batch_size: int = 32
    lr: float = 3e-3
    caption_dropout: float = 0.1
    shift: float = 3.0  # sigma sampling, as the sampler's schedule
    seed: int = 0

    @classmethod
    def from_dict(cls, raw: dict) -> PretrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"prepare: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**raw)


Log = Callable[[str, dict, int], None]  # (phase, metrics, step)


def _cosine_lr(optimizer: torch.optim.Optimizer, base: float, step: int, total: int, warmup: int = 20) -> None:
    """lr = base * min(1, (step + 1) / warmup) * (1 + cos(pi step / total)) / 2: a short warm-up, then cosine to 0."""
    lr = base * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_autoencoder(vae: torch.nn.Module, pixels: Tensor, cfg: PretrainConfig, log: Log | None = None) -> list[float]:
    """Phase 1 on ``pixels`` in [-1, 1]; returns the reconstruction MSE per step."""
    gen = torch.Generator().manual_seed(cfg.seed)
    vae.requires_grad_(True).train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    losses = []
    for step in range(cfg.vae_steps):
        _cosine_lr(optimizer, cfg.vae_lr, step, cfg.vae_steps)
        x = pixels[torch.randint(len(pixels), (cfg.batch_size,), generator=gen)]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.mode()).sample
        mse = (recon - x).pow(2).mean()
        loss = mse + cfg.kl_weight * posterior.kl().mean() / x[0].numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(mse.item())
        if log is not None:
            log("vae", {"vae_mse": mse.item()}, step)
    vae.requires_grad_(False).eval()
    return losses


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, pixels: Tensor, batch_size: int = 256) -> Tensor:
    """Posterior means of the VAE for ``pixels`` in [-1, 1], in the VAE's own layout."""
    return torch.cat([vae.encode(chunk).latent_dist.mean for chunk in pixels.split(batch_size)])


def calibrate_latents(policy, z: Tensor, resolution: int, num_frames: int) -> None:
    """Set the VAE config's latent normalisation to the statistics of ``z`` (what the family's decode inverts), and
    rebuild the policy's family geometry, which reads it."""
    vae, spec = policy.vae, family_spec(policy.family)
    if spec.vae.normalisation == SCALE_SHIFT:  # z = (z_vae - shift) * scale
        vae.register_to_config(shift_factor=z.mean().item(), scaling_factor=1 / z.std().item())
    else:  # z = (z_vae - mean_c) / std_c per channel
        dims = [d for d in range(z.ndim) if d != 1]
        vae.register_to_config(latents_mean=z.mean(dims).tolist(), latents_std=z.std(dims).tolist())
    policy.runtime = spec.runtime(policy.denoisers[0].config, vae.config, resolution, num_frames)


def normalise_latents(policy, z: Tensor) -> Tensor:
    """VAE latents -> the policy's latent layout (the inverse of its family's decode transform)."""
    return policy.runtime.latents_from_vae(z)


def sample_sigmas(n: int, shift: float, generator: torch.Generator) -> Tensor:
    """sigma = s u / (1 + (s - 1) u), u ~ U(0, 1): the sampler's shifted time warp applied to uniform draws."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return (shift * u / (1 + (shift - 1) * u)).float()


def train_flow(
    policy, latents: Tensor, captions: list[str], cfg: PretrainConfig, log: Log | None = None
) -> list[float]:
    """Phase 2: rectified-flow regression of the transformer and the text encoders (all their weights); returns the
    loss per step. The prompt embeddings are computed with gradients here, not from the policy's no-grad cache."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    params = [*policy.denoisers.parameters(), *policy.text_encoders.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    policy.denoisers.train()
    losses = []
    for step in range(cfg.steps):
        _cosine_lr(optimizer, cfg.lr, step, cfg.steps)
        idx = torch.randint(len(latents), (cfg.batch_size,), generator=gen)
        drop = torch.rand(cfg.batch_size, generator=gen) < cfg.caption_dropout
        prompts = ["" if d else captions[i] for i, d in zip(idx.tolist(), drop.tolist())]
        emb = policy.runtime.encode_text(
            policy.text_encoders, policy.tokenizers, prompts, policy.text_max_length, policy.device
        )
        x0 = latents[idx]
        noise = torch.randn(x0.shape, generator=gen)
        sigma = sample_sigmas(cfg.batch_size, cfg.shift, gen)
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        v = policy.velocity((1 - s) * x0 + s * noise, sigma, emb)  # unguided
        loss = (v - (noise - x0)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log is not None:
            log("flow", {"flow_loss": loss.item()}, step)
    for p in params:
        p.requires_grad_(False)
    policy.denoisers.eval()
    return losses


@torch.no_grad()
def sample_reward(
    policy,
    prompts: list[str],
    sample_cfg: SampleConfig,
    reward_weights: dict[str, float],
    samples_per_prompt: int = 4,
    seed: int = 0,
    pretrained: str | Path | None = None,
) -> float:
    """Mean reward of ``samples_per_prompt`` images per prompt drawn with the GRPO sampler (SDE steps, CFG).
    ``pretrained``: the folder ``policy`` was loaded from, whose scheduler config sets an unset ``sample_cfg.shift``
    (``lean.models.scheduler.time_shift``)."""
    shift, _ = time_shift(policy.family, pretrained, sample_cfg.shift, policy.runtime.image_seq_len)
    sample_cfg = dataclasses.replace(sample_cfg, shift=shift)
    pairs = [(i, k) for i in range(len(prompts)) for k in range(samples_per_prompt)]
    gens = [sample_generator(seed, 0, i, i, k) for i, k in pairs]  # one group per prompt
    steps = select_steps(
        StepRule.of(
            dataclasses.replace(
                sample_cfg,
                timestep_selection=STEP_SELECTIONS.default,
                sde_window=0,
                sde_steps_drawn=0,
                sde_window_max_start=None,
                sde_window_start=None,
            )
        ),
        len(gens),
        window_generator=torch.Generator().manual_seed(seed),
        sample_generators=gens,
    )
    names = [prompts[i] for i, _ in pairs]
    sampler = Sampler(sample_cfg, sigma_schedule(sample_cfg.num_steps, shift, sample_cfg.sigma_grid))
    final = rollout(
        policy, RolloutPlan(sampler=sampler, emb=policy.encode_prompts(names), generators=gens, steps=steps)
    )
    total, _ = compute_rewards(reward_weights, policy.decode(final), names)
    return total.mean().item()


def pretrain(
    model_cfg: ModelConfig,
    cfg: PretrainConfig,
    out: str | Path,
    *,
    eval_prompts: list[str] | None = None,
    sample_cfg: SampleConfig | None = None,
    reward_weights: dict[str, float] | None = None,
    log: Log | None = None,
) -> dict:
    """Both phases; write the pipeline folder to ``out`` and return a summary (losses, times, base reward) with the
    loss curves. The model is built and saved in float32 with all weights trainable, whatever ``model_cfg`` says
    about dtype and LoRA: those are the GRPO run's choices, made when the folder is loaded. With ``eval_prompts`` the
    saved folder is loaded back and sampled, which also checks that it round-trips.
    """
    torch.manual_seed(cfg.seed)
    base_cfg = dataclasses.replace(model_cfg, pretrained=None, dtype=dtype_name(torch.float32), full_finetune=True)
    policy = build_policy(base_cfg, vocabulary())
    frames = model_cfg.num_frames if family_spec(model_cfg.family).video else 1
    images, captions = make_dataset(cfg.images, model_cfg.resolution, cfg.seed, frames=frames)
    pixels = images * 2 - 1

    start = time.perf_counter()
    vae_losses = train_autoencoder(policy.vae, pixels, cfg, log)
    z = encode_latents(policy.vae, pixels)
    calibrate_latents(policy, z, model_cfg.resolution, model_cfg.num_frames)
    vae_seconds = time.perf_counter() - start
    start = time.perf_counter()
    flow_losses = train_flow(policy, normalise_latents(policy, z), captions, cfg, log)
    flow_seconds = time.perf_counter() - start

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out, adapter=False)

    def tail(values: list[float], n: int = 20) -> float:
        return sum(values[-n:]) / len(values[-n:])

    summary = {
        "vae_mse_final": tail(vae_losses),
        "flow_loss_first": sum(flow_losses[:20]) / len(flow_losses[:20]),
        "flow_loss_final": tail(flow_losses),
        "vae_seconds": vae_seconds,
        "flow_seconds": flow_seconds,
    }
    if eval_prompts:
        loaded = build_policy(dataclasses.replace(base_cfg, pretrained=str(out)), eval_prompts)
        summary["reward_pretrained"] = sample_reward(
            loaded, eval_prompts, sample_cfg or SampleConfig(), reward_weights or {"color_match": 1.0}, pretrained=out
        )
    return {"summary": summary, "vae_mse": vae_losses, "flow_loss": flow_losses}
