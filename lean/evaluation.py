"""Evaluation during ``lean train``: deterministic samples of fixed prompts from fixed noise, scored and drawn.

For each eval prompt p (``eval.prompts``, default the training prompts) and sample k < ``eval.samples_per_prompt``:

    x_1 ~ N(0, I)                         from the stream (eval.seed, p, k): the same x_1 at every evaluation
    x_{i+1} = x_i + (σ_{i+1} − σ_i) v_θ(x_i, σ_i)      Euler (ODE) steps, i < eval.num_steps, over the run's sigma
                                          grid (``sample.sigma_grid``, ``sample.shift``), CFG at eval.guidance_scale
    images = decode(x_N)                  (the last ODE step lands on DanceGRPO's x̂_0 too: σ_N = 0)
    reward = Σ_name w_name r_name(images, prompts)     the run's ``reward.weights``

The loop is the rollout's own (``lean.sampling.rollout.rollout``) with a step selection that marks no step stochastic,
under the weights the caller swaps in (``TrainState.ema_swapped_in``: the EMA ones with ``ema.enabled`` and
``eval.use_ema``). With the same weights two evaluations give the same images, so the grids of a run show what
training changed and nothing else.

Metrics of an evaluation (one row of ``<out>/eval.csv``, MLflow metrics at step = the iteration): ``eval_reward_mean``
and ``eval_reward_std`` (population std over all P x S samples), ``eval_reward_<name>`` (each unweighted reward's
mean), ``eval_samples``, ``eval_time_s``. The iteration of an evaluation is the number of updates applied before it:
0 is the base model, and iteration i's rollout samples the same weights as evaluation i.

The noise of a gain: with ``eval.noise_seeds`` J > 0 the base model's evaluation is repeated under J eval seeds
(``Evaluator.noise_std``; the first is the evaluation itself) and its row gets ``eval_reward_noise_std``, the
unbiased std of the J mean eval rewards. The eval reward of one fixed noise is a lottery over which x_1 it drew; a
gain of the trained model over the base counts when it is well above that spread (the workbench asks for 5 times).

Files under ``<out>/eval/<iteration>/``: ``p<prompt>_s<sample>.png`` (video: an animated ``.gif`` of all frames),
``grid.png`` (rows = prompts with their text, columns = samples with their reward; video: first frames) and
``samples.csv`` (each sample's prompt and rewards).

Data parallel: the P x S samples are split into contiguous shares, one per process (the last ones may hold fewer);
each process samples, scores and writes its own, the rewards are gathered (``World.gather``), and the main process
draws the grid from the written files. Every process works, so none waits idle in a collective whose timeout
(``train.dist_timeout_s``) an evaluation by the main process alone could exceed.

The eval geometry: ``eval.resolution`` (video: ``eval.num_frames``) apart from the training's ``model.resolution``
(``model.num_frames``): the rollout samples at the training size, the evaluation (its samples, files, grid and
reward) at the eval size, through the family's runtime for it (:func:`eval_runtime`, swapped in by
``Policy.at_geometry``) on the same weights and sigma grid (the run's ``sample.shift``, as resolved for the training
size). Training at 128-256 px and evaluating at 512 keeps the eval comparable while the rollouts cost less.

Random-weight policies train their tokenizer on the training prompts (``lean.models.build.build_policy``): words of eval
prompts that no training prompt has read as unknown tokens (a pretrained folder brings its own tokenizer).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.config import ConfigError
from lean.config.prompts import reference_image
from lean.models.build import build_runtime
from lean.models.registry import family_spec
from lean.models.sequence_parallel import sequence_problem
from lean.observe.outputs import write_csv
from lean.parallel.sharding import shards
from lean.sampling.rollout import RolloutPlan, Sampler, rollout, sample_generator
from lean.sampling.sde import EULER, StepSelection, sigma_schedule

if TYPE_CHECKING:
    from PIL import Image

    from lean.config import RunConfig
    from lean.models.policy import Policy
    from lean.models.spec import FamilyRuntime
    from lean.parallel.distributed import World
    from lean.run.iteration import IterationPipeline

EVAL_STREAM = 2**32 - 2  # the iteration key of the eval noise streams: no training iteration has it
GIF_FRAME_MS = 62  # 16 frames per second, Wan's rate
GRID_CELL_TARGET, GRID_CELL_MAX = 128, 256  # small samples are magnified (nearest) towards 128 px, large cut to 256
CAPTION_CHARS = 36  # characters per line of a row's prompt in the grid


def eval_iterations(every: int, iterations: int) -> list[int]:
    """The iterations evaluated: 0 (the base model), every ``every``-th, and ``iterations`` (the trained model);
    none when ``every`` is 0."""
    if not every:
        return []
    return sorted({0, iterations, *range(every, iterations + 1, every)})


def share(n: int, rank: int, size: int) -> slice:
    """Process ``rank``'s contiguous share of ``n`` items: ``ceil(n / size)`` each, the last shares shorter (or
    empty)."""
    per = math.ceil(n / size)
    return slice(min(rank * per, n), min((rank + 1) * per, n))


def pad_share(local: Tensor, n: int, size: int) -> Tensor:
    """A share's rows [len(share), K] padded with NaN to the longest share's length (a collective needs equal
    shapes)."""
    padded = torch.full((math.ceil(n / size), local.shape[1]), math.nan, dtype=local.dtype)
    padded[: local.shape[0]] = local
    return padded


def unpad_shares(rows: Tensor, n: int, size: int) -> Tensor:
    """The padded shares of all processes, concatenated in rank order -> the ``n`` rows, in order."""
    rows = rows.view(size, math.ceil(n / size), -1)
    shares = [share(n, r, size) for r in range(size)]
    return torch.cat([rows[r, : s.stop - s.start] for r, s in enumerate(shares)])


def gather_shares(world: World, local: Tensor, n: int) -> Tensor:
    """Every data-parallel rank's rows ``local`` [len(share), K] (float64, on the host) -> all ``n`` rows, in order."""
    gathered = world.gather(pad_share(local, n, world.data_size).to(world.device)).cpu()
    return unpad_shares(gathered, n, world.data_size)


def eval_runtime(policy: Policy, cfg: RunConfig, sequence_parallel: int = 1) -> FamilyRuntime | None:
    """The family's runtime at ``eval.resolution`` / ``eval.num_frames``, or None where they are the training's
    (unset, or equal). A size the family's latent cannot take (its runtime's own check, as the training size gets
    when the policy is built) or that sequence parallelism cannot split is a one-line config error."""
    e, m = cfg.eval, cfg.model
    geometry = {"resolution": e.resolution or m.resolution, "num_frames": e.num_frames or m.num_frames}
    if (geometry["resolution"], geometry["num_frames"]) == (m.resolution, m.num_frames):
        return None
    key, value = ("eval.resolution", e.resolution) if e.resolution is not None else ("eval.num_frames", e.num_frames)
    try:
        runtime = build_runtime(
            policy.spec, policy.denoisers[0].config, policy.vae.config, dataclasses.replace(m, **geometry)
        )
    except ValueError as err:
        raise ConfigError(key, value, str(err).splitlines()[0]) from None
    if sequence_parallel > 1:
        with policy.at_geometry(runtime, geometry["resolution"]):
            problem = sequence_problem(policy, sequence_parallel)
        if problem:
            raise ConfigError(key, value, f"parallel.sequence_parallel={sequence_parallel} {problem}")
    return runtime


class Evaluator:
    """The evaluation of one run: its prompts, sampler, noise streams and output folder (``<out>/eval``)."""

    def __init__(self, pipeline: IterationPipeline, out_dir: str | Path):
        cfg = pipeline.cfg  # sample.shift resolved (build_pipeline)
        e = cfg.eval
        self.policy, self.world, self.cfg = pipeline.policy, pipeline.world, cfg
        self.reward = pipeline.reward  # the run's rewards, built once (model and remote rewards included)
        self.scorer = lambda: pipeline.scorer  # which rewards read audio, asked when the first samples are scored
        self.prompts = list(e.prompts or cfg.train.prompts)
        self.sample_cfg = dataclasses.replace(
            cfg.sample,
            num_steps=e.num_steps or cfg.sample.num_steps,
            guidance_scale=cfg.sample.guidance_scale if e.guidance_scale is None else e.guidance_scale,
            tail_solver=EULER,  # Euler steps whatever the run samples with: every run evaluates alike
            tail_compress=1.0,
        )
        grid = sigma_schedule(
            self.sample_cfg.num_steps, cfg.sample.shift, cfg.sample.sigma_grid, cfg.sample.shift_terminal
        )
        self.sigmas = grid.to(self.world.device)
        self.keys = [(p, k) for p in range(len(self.prompts)) for k in range(e.samples_per_prompt)]
        self.local = share(len(self.keys), self.world.data_rank, self.world.data_size)
        self.video = family_spec(cfg.model.family).video
        self.root = Path(out_dir) / "eval"
        self.runtime = eval_runtime(self.policy, cfg, self.world.sequence_parallel)  # None: the training geometry
        self.resolution = e.resolution or cfg.model.resolution

    @property
    def lockstep_batches(self) -> int:
        """Under ``parallel.shard=fsdp`` every process samples as many batches as the largest share needs
        (``lean.parallel.sharding``); else 0 (no padding)."""
        if not shards(self.cfg.parallel.shard) or self.world.size < 2:
            return 0
        return math.ceil(math.ceil(len(self.keys) / self.world.size) / self.cfg.eval.batch_size)

    def folder(self, iteration: int) -> Path:
        return self.root / str(iteration)

    def due(self, iteration: int) -> bool:
        return iteration in eval_iterations(self.cfg.eval.every, self.cfg.train.iterations)

    def images_due(self, iteration: int) -> bool:
        """Whether the evaluation of ``iteration`` writes its images (``eval.images_every``; None: every one)."""
        every = self.cfg.eval.images_every
        return every is None or iteration in eval_iterations(every, self.cfg.train.iterations)

    def file(self, prompt_index: int, sample_index: int) -> str:
        return f"p{prompt_index:03d}_s{sample_index:02d}.{'gif' if self.video else 'png'}"

    @torch.no_grad()
    def sample(self, keys: list[tuple[int, int]], seed: int | None = None) -> tuple[Tensor, Tensor | None]:
        """Decoded ODE samples of ``keys`` ((prompt index, sample index) pairs) from the noise of ``seed`` (default
        ``eval.seed``): ``[B, 3, H, W]`` (video ``[B, 3, F, H, W]``) in [0, 1], and their soundtracks where a reward
        reads them (``Policy.decode_audio``; else None)."""
        n = self.sample_cfg.num_steps
        seed = self.cfg.eval.seed if seed is None else seed
        generators = [sample_generator(seed, EVAL_STREAM, 0, p, k) for p, k in keys]
        deterministic = StepSelection(
            stochastic=torch.zeros(n, dtype=torch.bool), trained=torch.zeros(len(keys), n, dtype=torch.bool)
        )
        geometry = self.policy.at_geometry(self.runtime, self.resolution) if self.runtime else contextlib.nullcontext()
        with geometry:
            emb = self.policy.encode_prompts([self.prompts[p] for p, _ in keys])
            plan = RolloutPlan(
                sampler=Sampler(self.sample_cfg, self.sigmas), emb=emb, generators=generators, steps=deterministic
            )
            final = rollout(self.policy, plan)
            audio = self.policy.decode_audio(final) if self.scorer().reads_audio else None
            return self.policy.decode(final), audio

    def score(self, seed: int | None = None, folder: Path | None = None) -> Tensor:
        """Sample and score this process's share from the noise of ``seed`` (default ``eval.seed``), writing each
        sample into ``folder`` if given; gather the shares. Returns every sample's rewards ``[P x S, 1 + R]`` (the
        total, then each reward of ``reward.weights``), the same on every process."""
        names = list(self.cfg.reward.weights)
        local_keys = self.keys[self.local]
        scores = torch.empty(len(local_keys), 1 + len(names), dtype=torch.float64)
        for lo in range(0, len(local_keys), self.cfg.eval.batch_size):
            keys = local_keys[lo : lo + self.cfg.eval.batch_size]
            images, audio = self.sample(keys, seed)
            total, parts = self.reward(images, [self.prompts[p] for p, _ in keys], audio)
            scores[lo : lo + len(keys)] = torch.stack([total, *(parts[name] for name in names)], dim=1).double()
            if folder is not None:
                for (p, k), image in zip(keys, images):
                    write_sample(folder / self.file(p, k), image)
        for _ in range(self.lockstep_batches - math.ceil(len(local_keys) / self.cfg.eval.batch_size)):
            self.sample(self.keys[:1], seed)  # a sharded policy's passes are collectives: as many as the others run
        return gather_shares(self.world, scores, len(self.keys))  # after it, every process has written its files

    def noise_std(self, mean_at_seed: float) -> dict:
        """How much the mean eval reward of the current weights moves with the eval noise alone: their mean eval
        reward ``m_j`` under ``eval.noise_seeds`` seeds j = ``eval.seed``, ``eval.seed + 1``, ... (the first is
        ``mean_at_seed``, the evaluation already made; the others write no files) and ``eval_reward_noise_std`` =
        sqrt(Σ_j (m_j − m̄)² / (J − 1)), the unbiased std. A gain of the eval reward is noise unless it is several
        of these."""
        seed, count = self.cfg.eval.seed, self.cfg.eval.noise_seeds
        means = [mean_at_seed, *(self.score(seed + j)[:, 0].mean().item() for j in range(1, count))]
        return {
            "eval_reward_noise_std": torch.tensor(means, dtype=torch.float64).std(unbiased=True).item(),
            "eval_noise_seeds": count,
        }

    def evaluate(self, iteration: int) -> dict:
        """Sample, score and (when its images are due) write this process's share; gather the rewards; the main
        process writes the grid and ``samples.csv``. Returns the metrics row (the same on every process)."""
        start = time.perf_counter()
        folder = self.folder(iteration) if self.images_due(iteration) else None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        names = list(self.cfg.reward.weights)
        scores = self.score(folder=folder)
        if self.world.is_main and folder is not None:
            self.write_summary(folder, scores, names)
        rewards = scores[:, 0]
        return {
            "iteration": iteration,
            "eval_reward_mean": rewards.mean().item(),
            "eval_reward_std": rewards.std(unbiased=False).item(),
            **{f"eval_reward_{name}": scores[:, j].mean().item() for j, name in enumerate(names, 1)},
            "eval_samples": len(self.keys),
            "eval_time_s": time.perf_counter() - start,
        }

    def write_summary(self, folder: Path, scores: Tensor, names: list[str]) -> None:
        """``samples.csv`` and ``grid.png`` of an evaluation whose sample files are all written."""
        rows = [
            {
                "prompt_index": p,
                "sample_index": k,
                "prompt": self.prompts[p],
                "file": self.file(p, k),
                "reward": row[0],
                **{f"reward_{name}": v for name, v in zip(names, row[1:])},
            }
            for (p, k), row in zip(self.keys, scores.tolist())
        ]
        write_csv(folder / "samples.csv", rows)
        columns = self.cfg.eval.samples_per_prompt
        rewards = scores[:, 0].view(len(self.prompts), columns).tolist()
        labels = [[f"{r:.4f}" for r in row] for row in rewards]
        write_grid(
            folder / "grid.png",
            self.prompts,
            [[folder / self.file(p, k) for k in range(columns)] for p in range(len(self.prompts))],
            labels,
        )
        if any(reference_image(p) is not None for p in self.prompts):
            self.write_edit_grid(folder, labels)

    def write_edit_grid(self, folder: Path, labels: list[list[str]]) -> None:
        """``edits.png`` of an edit evaluation: per prompt its reference image | the base model's first sample
        (iteration 0's evaluation, when it ran) | this evaluation's samples, each with its reward."""
        base = self.folder(0)
        base_rewards = {}
        if base != folder and (base / "samples.csv").exists():
            with open(base / "samples.csv", newline="") as f:
                base_rewards = {
                    int(r["prompt_index"]): r["reward"] for r in csv.DictReader(f) if r["sample_index"] == "0"
                }
        files, texts = [], []
        for p, prompt in enumerate(self.prompts):
            row, text = [Path(reference_image(prompt))], ["reference"]
            if p in base_rewards:
                row.append(base / self.file(p, 0))
                text.append(f"base {float(base_rewards[p]):.4f}")
            files.append(row + [folder / self.file(p, k) for k in range(self.cfg.eval.samples_per_prompt)])
            texts.append(text + labels[p])
        write_grid(folder / "edits.png", self.prompts, files, texts)


# ---------------------------------------------------------------- files


def to_uint8(image: Tensor) -> Tensor:
    """[3, ...] in [0, 1] -> uint8 [..., 3] (channels last) on the host."""
    return (image.float().cpu() * 255).round().clamp(0, 255).to(torch.uint8).movedim(0, -1)


def write_sample(path: Path, image: Tensor) -> None:
    """An image [3, H, W] as PNG, or a video [3, F, H, W] as an animated GIF (every frame, looping)."""
    from PIL import Image  # local: only evaluations draw

    pixels = to_uint8(image).numpy()
    if image.ndim == 3:
        Image.fromarray(pixels).save(path)
        return
    frames = [Image.fromarray(frame) for frame in pixels]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=GIF_FRAME_MS, loop=0)


def cell(path: Path) -> Image.Image:
    """A grid cell: the sample's (first) frame, magnified (nearest) towards ``GRID_CELL_TARGET`` px when small,
    shrunk to ``GRID_CELL_MAX`` px when large."""
    from PIL import Image

    with Image.open(path) as opened:
        image = opened.convert("RGB")  # a GIF opens at its first frame
    side = max(image.size)
    scale = GRID_CELL_MAX / side if side > GRID_CELL_MAX else max(1, GRID_CELL_TARGET // side)
    if scale == 1:
        return image
    size = (round(image.width * scale), round(image.height * scale))
    return image.resize(size, Image.Resampling.NEAREST if scale > 1 else Image.Resampling.LANCZOS)


def write_grid(path: Path, prompts: list[str], files: list[list[Path]], labels: list[list[str]]) -> None:
    """``grid.png``: one row per prompt (its text on the left), one column per image (its label, e.g. its reward,
    below). Rows may differ in length."""
    from PIL import Image, ImageDraw, ImageFont

    cells = [[cell(f) for f in row] for row in files]
    font = ImageFont.load_default()
    captions = ["\n".join(textwrap.wrap(prompt, CAPTION_CHARS)) or " " for prompt in prompts]
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    pad = 4
    caption_w = max(measure.multiline_textbbox((0, 0), c, font=font)[2] for c in captions) + 2 * pad
    caption_h = max(measure.multiline_textbbox((0, 0), c, font=font)[3] for c in captions)
    line_h = measure.textbbox((0, 0), "0.0", font=font)[3] + pad
    cell_w = max(c.width for row in cells for c in row)
    cell_h = max(c.height for row in cells for c in row)
    row_h = max(cell_h + line_h, caption_h) + pad
    columns = max(len(row) for row in cells)
    grid = Image.new("RGB", (caption_w + columns * (cell_w + pad) + pad, len(cells) * row_h + pad), "white")
    draw = ImageDraw.Draw(grid)
    for r, (caption, row, texts) in enumerate(zip(captions, cells, labels)):
        y = pad + r * row_h
        draw.multiline_text((pad, y), caption, fill="black", font=font)
        for c, (image, text) in enumerate(zip(row, texts)):
            x = caption_w + pad + c * (cell_w + pad)
            grid.paste(image, (x, y))
            draw.text((x, y + cell_h + 2), text, fill="black", font=font)
    grid.save(path)
