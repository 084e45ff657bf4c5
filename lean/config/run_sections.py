"""The run-level sections every layer reads: ``train`` (the loop: schedule, batch shape, prompts, faults),
``optimizer`` (AdamW and gradient clipping), ``ema`` (the moving average of the trained weights), ``checkpoint``
(when and how many) and ``eval`` (evaluation during ``lean train``).

They live in the config package, beside the mechanism but not in it, because they have no owner below
``lean.configure`` that it could import: the loop that reads them is ``lean.run``, ``lean.train`` and
``lean.checkpoint``, above it. Every other section is declared by its owner and registered there
(``lean.models.options``, ``lean.sampling.options``, ``lean.rewards.options``, ``lean.algorithms.options``,
``lean.parallel.options``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lean.config.checks import (
    AUTO,
    ConfigError,
    check_choice,
    check_fraction,
    check_positive,
    choice,
    choices,
    prompts_of_file,
)
from lean.config.sections import register_options

DEFAULT_PROMPTS = [
    "a red circle on a white background",
    "a green square on a black background",
    "a blue triangle on a yellow background",
    "a yellow circle on a blue background",
    "a white square on a red background",
    "a black triangle on a green background",
    "a magenta circle on a cyan background",
    "a cyan square on a magenta background",
]


ON_NONFINITE = ("abort", "skip")
# what ema.every counts, and the count the warm-up reads (lean.run.optimizer.ema_decay)
EMA_UNITS = ("optimizer_step", "iteration")


@register_options("train")
@dataclass
class TrainConfig:
    """The run loop: schedule, iterations, batches, prompts, seed, output and faults."""

    schedule: str = choice("schedule", also=(AUTO,))
    """Update schedule: a name of ``lean.schedules.SCHEDULES``, or auto (the fastest predicted schedule that fits
    ``memory_budget_mb``)."""
    iterations: int = 3
    prompts_per_iteration: int = 2
    """Groups per iteration, across all processes."""
    group_size: int = 4
    """Samples per prompt (k); advantages are relative to the group."""
    rollout_batch_size: int = 8
    """Samples per forward during the rollout, per process."""
    train_batch_size: int = 8
    """Samples per forward during Recompute's update, per process."""
    optimizer_steps_per_iteration: int = 1
    """> 1 is off-policy (FlowGRPO's gradient accumulation)."""
    edges_per_update: int | None = None
    """On a tree rollout: the trained edges of one optimizer step, the rollout's edges shuffled and split into steps of
    this many plus one for the remainder (BranchGRPO's --gradient_accumulation_steps: ``lean/schedules/
    edge_updates.py``); null: one update per tree rollout. ``on_policy`` sets it null."""
    on_policy: bool = False
    """The recipe's on-policy form: each rollout feeds one optimizer step with the recipe's samples per step. With
    S = optimizer_steps_per_iteration: prompts_per_iteration / S prompts per rollout, iterations x S rollouts, one
    optimizer step each (S becomes 1). The samples per step and the number of steps stay the recipe's; every step's
    ratio is 1, so retain, reweight and auto run it exactly. Needs num_inner_epochs 1 (a second pass reuses samples
    under moved weights). A tree cannot be split: ``edges_per_update`` becomes null, one update per tree rollout."""
    shuffle_update: bool = True
    """Recompute's update visits the local samples in a shuffled order (FlowGRPO's SD3, FLUX and Wan scripts); false:
    in rollout order (Flow-GRPO-Fast, DanceGRPO). It decides which samples share an optimizer step."""
    recompute_batching: str = choice("recompute batching")
    """Recompute's update forwards: update (FlowGRPO's: shuffled samples, train_batch_size) | rollout (the rollout's
    own micro-batches and CFG batch, so on-policy the ratio is exactly 1 where kernels are deterministic)."""
    num_inner_epochs: int = 1
    memory_budget_mb: float | None = None
    """For schedule auto (and a check of retain): default, what the device has."""
    seed: int = 42
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    """The prompt set; replaced by the file's prompts when ``prompts_file`` is set."""
    prompts_file: str | None = None
    """A prompt file read by ``lean.config.prompts.read_prompts`` into ``prompts`` when the config is validated: one
    prompt a line (FlowGRPO's dataset/*/train.txt; blank lines skipped), or ``.jsonl`` with a ``prompt`` field per line
    (FlowGRPO's GenEval *_metadata.jsonl)."""
    out: str = "outputs/train"
    dist_timeout_s: float | None = None
    """Every process-group operation fails after this instead of hanging; default 60 s on CPU (gloo), 30 minutes
    on GPUs (NCCL: checkpoint writes and uneven model loading can hold a rank for minutes)."""
    on_nonfinite: str = ON_NONFINITE[0]
    """What a non-finite reward, log-prob, loss or gradient does: abort | skip (undo the iteration)."""
    threads: int | None = None
    """Torch threads of each ``lean train`` process (``lean train --threads``); None: torch's default."""
    memory_every: int = 1
    """Measure an iteration's peak memory every N iterations, and the first (the other rows leave ``peak_memory_mb``
    empty). On a CPU the measurement hands the heap's freed pages back to the kernel and resets the high-water mark,
    and the iteration's allocations fault them in again: 0.04 of the workbench run's 0.17 CPU s an iteration."""

    def validate(self) -> None:
        choices(self, "train")
        check_positive("train.memory_every", self.memory_every)
        for key in (
            "iterations",
            "prompts_per_iteration",
            "rollout_batch_size",
            "train_batch_size",
            "optimizer_steps_per_iteration",
            "num_inner_epochs",
        ):
            check_positive(f"train.{key}", getattr(self, key))
        for key in ("dist_timeout_s", "threads"):
            if getattr(self, key) is not None:
                check_positive(f"train.{key}", getattr(self, key))
        if self.group_size < 2:
            raise ConfigError(
                "train.group_size", self.group_size, "must be >= 2 (advantages are relative to the group)"
            )
        check_choice("train.on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        if self.memory_budget_mb is not None:
            check_positive("train.memory_budget_mb", self.memory_budget_mb)
        if self.edges_per_update is not None:
            check_positive("train.edges_per_update", self.edges_per_update)
        if self.prompts_file is not None:
            self.prompts = prompts_of_file("train.prompts_file", self.prompts_file)
        if self.on_policy:
            self.to_on_policy()
        if not self.prompts:
            raise ConfigError("train.prompts", self.prompts, "needs at least one prompt")

    def to_on_policy(self) -> None:
        """``on_policy``: S optimizer steps per rollout become S rollouts of one step each (a no-op at S = 1, so a
        validated config validates again unchanged)."""
        steps, prompts = self.optimizer_steps_per_iteration, self.prompts_per_iteration
        if self.num_inner_epochs != 1:
            raise ConfigError(
                "train.on_policy",
                True,
                f"takes one pass over each rollout; train.num_inner_epochs={self.num_inner_epochs} reuses its samples "
                "under moved weights: set train.num_inner_epochs=1",
            )
        if prompts % steps:
            raise ConfigError(
                "train.on_policy",
                True,
                f"splits an iteration's train.prompts_per_iteration={prompts} into train.optimizer_steps_per_iteration"
                f"={steps} rollouts: use a multiple of {steps}",
            )
        self.prompts_per_iteration, self.iterations = prompts // steps, self.iterations * steps
        self.optimizer_steps_per_iteration, self.edges_per_update = 1, None


@register_options("optimizer")
@dataclass
class OptimizerConfig:
    """AdamW and the gradient clipping of each optimizer step (``lean.run.optimizer.TrainState``)."""

    lr: float = 1e-4
    weight_decay: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0

    def validate(self) -> None:
        for key in ("lr", "max_grad_norm", "adam_eps"):
            check_positive(f"optimizer.{key}", getattr(self, key))
        check_positive("optimizer.weight_decay", self.weight_decay, strict=False)
        for key in ("adam_beta1", "adam_beta2"):
            check_fraction(f"optimizer.{key}", getattr(self, key))


@register_options("ema")
@dataclass
class EMAConfig:
    """An exponential moving average of the trained weights, updated after optimizer steps
    (``lean.run.optimizer.TrainState``)."""

    enabled: bool = False
    """Keep an exponential moving average of the trained weights (written as ``lora_ema.safetensors``)."""
    decay: float = 0.9
    """Each update: ``ema <- decay * ema + (1 - decay) * weights``."""
    every: int = 8
    """Update the EMA every N units (``unit``; FlowGRPO's ``update_step_interval``, Flow-Factory's
    ``ema_update_interval``)."""
    unit: str = EMA_UNITS[0]
    """What ``every`` counts, and what the warm-up's t is: ``optimizer_step`` (FlowGRPO: t = the optimizer steps
    taken, from 1) or ``iteration`` (Flow-Factory: after an iteration's last optimizer step, t = the iteration's
    index, from 0: its ``ema_step(step=self.epoch)`` before ``epoch += 1``, src/flow_factory/trainers/grpo.py:89-91
    at a0b2bc5). See ``lean.run.optimizer.ema_decay``."""
    warmup: bool = False
    """The warm-up schedule of both sources (FlowGRPO at ac4c86e: flow_grpo/ema.py:33-37 and :45, called right after
    ``global_step += 1`` in scripts/train_sd3.py:952-955; Flow-Factory's default ``ema_decay_schedule: power``,
    src/flow_factory/ema/ema_utils.py:38-52 and ema.py:102-113 at a0b2bc5): after unit t with ``(t + 1) % every ==
    0`` the decay is ``min((1 + t) / (10 + t), decay)``, t as ``unit`` says. false: ``decay`` after every
    ``every``-th unit. See ``lean.run.optimizer.ema_decay``."""
    repeats: int = 1
    """Each EMA update is applied this many times (decay^r): FlowGRPO calls its EMA once per training micro-batch, so
    an update repeats gradient_accumulation_steps times (scripts/train_sd3.py at 879042c: :959-960 in the micro-batch
    loop)."""

    def validate(self) -> None:
        for key in ("every", "repeats"):
            check_positive(f"ema.{key}", getattr(self, key))
        check_fraction("ema.decay", self.decay)
        check_choice("ema.unit", self.unit, EMA_UNITS)


@register_options("checkpoint")
@dataclass
class CheckpointConfig:
    """Checkpoints of a run for ``lean train --resume`` (``lean.checkpoint``)."""

    every: int = 0
    """Checkpoint every N iterations into <out>/checkpoints (0: off)."""
    keep: int = 2
    """The newest checkpoints kept; older ones are deleted."""

    def validate(self) -> None:
        check_positive("checkpoint.every", self.every, strict=False)
        check_positive("checkpoint.keep", self.keep)


@register_options("eval")
@dataclass
class EvalConfig:
    """Evaluation during ``lean train`` (``lean.evaluation``): deterministic ODE samples of fixed prompts from the
    same noise at every evaluation, scored with the run's reward, written as image grids and logged to MLflow."""

    every: int = 0
    """Evaluate every N iterations, and before the first (the base model) and after the last; 0: never."""
    images_every: int | None = None
    """Write the evaluation's images (samples, ``grid.png``, ``samples.csv``, MLflow's image and artifacts) every N
    iterations, and at the first and last evaluation; the other evaluations give only the eval-reward row (a curve
    measured often, pictures where a person looks). A multiple of ``every``; None: at every evaluation."""
    prompts: list[str] | None = None
    """The eval prompts; None: the training prompts (``train.prompts``). Replaced by ``prompts_file``'s when set."""
    prompts_file: str | None = None
    """A prompt file (``lean.config.prompts.read_prompts``: one prompt a line, or ``.jsonl`` with a ``prompt``
    field)."""
    samples_per_prompt: int = 2
    """Samples of each eval prompt: the grid's columns."""
    num_steps: int | None = None
    """Euler (ODE) steps over the run's sigma grid; None: ``sample.num_steps``."""
    guidance_scale: float | None = None
    """CFG scale of the eval samples; None: ``sample.guidance_scale``."""
    seed: int = 0
    """Seed of the eval noise: every evaluation starts from the same x_1, so its images compare across iterations."""
    batch_size: int = 8
    """Samples per rollout, decode and reward call, per process."""
    use_ema: bool = True
    """With ``ema.enabled``: evaluate the EMA weights (those of ``lora_ema.safetensors``); false: the trained ones."""
    resolution: int | None = None
    """Side in pixels of the eval samples (the images written, the grid, the eval reward), apart from the training
    resolution: train at 128-256 px (the rollout's cost falls quadratically) and evaluate at 512. A legal size for
    the family, as ``model.resolution`` is; square frames only (``model.width`` unset). None: ``model.resolution``."""
    num_frames: int | None = None
    """Video families: frames of the eval samples (``4k + 1`` as ``model.num_frames``); None: ``model.num_frames``."""
    noise_seeds: int = 0
    """The base model's evaluation (iteration 0) is repeated with this many eval seeds (``seed``, ``seed + 1``, ...;
    no files written) and ``eval_reward_noise_std`` is the unbiased std of their mean eval rewards: how much the eval
    reward moves with the noise alone, the yardstick of a gain. 0: off; 1 is refused (no spread)."""

    def validate(self) -> None:
        check_positive("eval.every", self.every, strict=False)
        if self.images_every is not None:
            check_positive("eval.images_every", self.images_every)
            if self.every and self.images_every % self.every:
                multiple = self.every * max(1, round(self.images_every / self.every))
                raise ConfigError(
                    "eval.images_every", self.images_every, f"must be a multiple of eval.every={self.every}: {multiple}"
                )
        check_positive("eval.noise_seeds", self.noise_seeds, strict=False)
        if self.noise_seeds == 1:
            raise ConfigError("eval.noise_seeds", self.noise_seeds, "must be 0 (off) or >= 2: one seed has no spread")
        for key in ("samples_per_prompt", "batch_size"):
            check_positive(f"eval.{key}", getattr(self, key))
        if self.num_steps is not None:
            check_positive("eval.num_steps", self.num_steps)
        if self.guidance_scale is not None:
            check_positive("eval.guidance_scale", self.guidance_scale, strict=False)
        if self.resolution is not None and (self.resolution <= 0 or self.resolution % 16):
            raise ConfigError("eval.resolution", self.resolution, "must be a positive multiple of 16 (or null)")
        if self.num_frames is not None:
            check_positive("eval.num_frames", self.num_frames)
        if self.prompts_file is not None:
            self.prompts = prompts_of_file("eval.prompts_file", self.prompts_file)
        if self.prompts is not None and not self.prompts:
            raise ConfigError("eval.prompts", self.prompts, "needs at least one prompt (or null: the training prompts)")
