"""``lean sample``: images (videos: frames) from a diffusers pipeline folder with a LoRA folder loaded, sampled by the
pipeline itself, as a user of the trained model samples them.

The pipeline class is the one ``model_index.json`` names (a family's ``PIPELINE``: FluxPipeline,
StableDiffusion3Pipeline, WanPipeline); the LoRA folder (``<run>/lora``, or ``lean export``'s) is loaded with
``pipe.load_lora_weights``. Each prompt is one call ``pipe(prompt=..., num_inference_steps=..., guidance_scale=...,
generator=...)``: the ODE of the pipeline's scheduler. A folder without ``scheduler/`` (lean's own base folders) gets
the family's published scheduler config (``lean.models.build_scheduler``); ``shift`` sets a static shift instead (the
``sample.shift`` a run trained with). The text encoders see what lean's policy gives them: CLIP padded to its full
context, T5 at most the tokenizer's ``model_max_length`` tokens (lean's ``model.text_max_length``).

Prompt k (file order) is drawn from ``torch.Generator("cpu").manual_seed(seed + k)``, so an image depends on its
prompt and position only. Outputs under ``out``: ``<k>.png`` (5 digits), for video ``<k>/<frame>.png`` and
``<k>.gif``; ``samples.jsonl``: one line per prompt, ``{"index", "prompt", "seed", "file"}``.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lean.config import ConfigError
from lean.data import read_prompts
from lean.dtypes import DTYPES
from lean.export import LORA_DIR, LORA_WEIGHTS
from lean.models import FAMILIES, build_scheduler, family_module, pipeline_family, pretrained_problem

GIF_FRAME_MS = 125  # 8 frames per second


@dataclass
class SampleOptions:
    """What ``lean sample`` draws; None leaves the pipeline's own default."""

    num_steps: int | None = None
    """Scheduler steps (``num_inference_steps``)."""
    guidance_scale: float | None = None
    """The pipeline's ``guidance_scale``: CFG for SD3 and Wan, the distilled-guidance embedding for FLUX."""
    true_cfg_scale: float | None = None
    """FLUX only: CFG against the empty prompt (FluxPipeline's ``true_cfg_scale``), as lean's FLUX runs with
    ``sample.cfg: true`` guide."""
    seed: int = 0
    resolution: int | None = None
    """Image side in pixels."""
    num_frames: int | None = None
    """Video families: frames per video."""
    shift: float | None = None
    """A static sigma shift instead of the folder's scheduler config."""
    dtype: str | None = None
    """Precision (a name of ``lean.dtypes.DTYPES``); None: bfloat16 on a GPU, float32 on the CPU."""
    device: str | None = None
    """None: the first GPU if there is one, else the CPU."""

    def validate(self, family: str) -> None:
        if self.num_steps is not None and self.num_steps < 1:
            raise ConfigError("--num-steps", self.num_steps, "must be >= 1")
        if self.resolution is not None and (self.resolution < 16 or self.resolution % 16):
            raise ConfigError("--resolution", self.resolution, "must be a positive multiple of 16")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError("--dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")
        spec = family_module(family)
        if self.true_cfg_scale is not None and not getattr(spec, "GUIDANCE_EMBED", False):
            raise ConfigError("--true-cfg-scale", self.true_cfg_scale, f"{spec.PIPELINE} guides with --guidance-scale")
        step = getattr(spec, "FRAME_STEP", None)
        if self.num_frames is not None:
            if step is None:
                raise ConfigError("--num-frames", self.num_frames, f"{spec.PIPELINE} makes images")
            if self.num_frames < 1 or (self.num_frames - 1) % step:
                raise ConfigError("--num-frames", self.num_frames, f"{spec.DISPLAY_NAME} needs {step}k+1 frames")


def check_folders(pretrained: str | Path, lora: str | Path | None) -> str:
    """The family of the ``pretrained`` pipeline folder; a folder that is not a pipeline lean knows, or a LoRA
    folder without diffusers' weight file, is a :class:`ConfigError`."""
    family = pipeline_family(pretrained)
    if family is None:
        pipelines = ", ".join(family_module(f).PIPELINE for f in FAMILIES)
        raise ConfigError("--pretrained", str(pretrained), f"is not a diffusers pipeline folder of {pipelines}")
    problem = pretrained_problem(family, pretrained)
    if problem is not None:
        raise ConfigError("--pretrained", str(pretrained), problem)
    if lora is not None and not (Path(lora) / LORA_WEIGHTS).is_file():
        raise ConfigError(
            "--lora", str(lora), f"has no {LORA_WEIGHTS} (a diffusers LoRA folder, e.g. <run>/{LORA_DIR})"
        )
    return family


def load_pipeline(pretrained: str | Path, lora: str | Path | None, options: SampleOptions, family: str):
    """The diffusers pipeline of ``pretrained`` (with ``lora`` loaded) on the options' device and dtype."""
    import diffusers  # local: diffusers takes seconds to import

    index = json.loads((Path(pretrained) / "model_index.json").read_text())
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if options.dtype is not None:
        dtype = DTYPES[options.dtype]
    else:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    extra = {}
    if "scheduler" not in index or options.shift is not None:
        extra["scheduler"] = build_scheduler(family, pretrained, options.shift)
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(pretrained, dtype=dtype, **extra)
    if lora is not None:
        pipe.load_lora_weights(lora)
    if hasattr(pipe, "tokenizer_max_length") and hasattr(pipe.text_encoder.config, "max_position_embeddings"):
        pipe.tokenizer_max_length = pipe.text_encoder.config.max_position_embeddings  # CLIP: its whole context
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def call_arguments(pipe, family: str, options: SampleOptions) -> dict:
    """The pipeline call's keyword arguments shared by every prompt."""
    spec = family_module(family)
    args = {"num_inference_steps": options.num_steps, "guidance_scale": options.guidance_scale, "output_type": "np"}
    if options.true_cfg_scale is not None:
        args.update(true_cfg_scale=options.true_cfg_scale, negative_prompt="")
    if options.resolution is not None:
        args.update(height=options.resolution, width=options.resolution)
    if getattr(spec, "FRAME_STEP", None):
        args["num_frames"] = options.num_frames
    # the T5 encoder (the family's last tokenizer) sees at most the tokens its tokenizer was saved with
    t5 = getattr(pipe, list(spec.TOKENIZERS.values())[-1])
    default = inspect.signature(pipe.__call__).parameters["max_sequence_length"].default
    args["max_sequence_length"] = min(default, t5.model_max_length)
    return {k: v for k, v in args.items() if v is not None}


def to_uint8(pixels) -> torch.Tensor:
    """``[..., H, W, 3]`` floats in [0, 1] (the pipelines' ``output_type="np"``) -> uint8, rounded."""
    return (torch.as_tensor(pixels).clamp(0, 1) * 255).round().to(torch.uint8)


def write_sample(pixels, out: Path, index: int) -> str:
    """One prompt's image ``[H, W, 3]`` as ``<index>.png``, or video ``[F, H, W, 3]`` as frames and a GIF; the
    path written, relative to ``out``."""
    from PIL import Image  # local: only sampling writes images

    pixels = to_uint8(pixels).numpy()
    name = f"{index:05d}"
    if pixels.ndim == 3:
        Image.fromarray(pixels).save(out / f"{name}.png")
        return f"{name}.png"
    (out / name).mkdir(exist_ok=True)
    frames = [Image.fromarray(frame) for frame in pixels]
    for k, frame in enumerate(frames):
        frame.save(out / name / f"{k:04d}.png")
    frames[0].save(out / f"{name}.gif", save_all=True, append_images=frames[1:], duration=GIF_FRAME_MS, loop=0)
    return f"{name}.gif"


def sample(
    pretrained: str | Path, lora: str | Path | None, prompts_file: str | Path, out: str | Path, options: SampleOptions
) -> list[Path]:
    """``lean sample``: one image (video) per prompt of ``prompts_file`` under ``out``; returns the files written.
    Bad arguments are :class:`ConfigError` before any model is loaded."""
    family = check_folders(pretrained, lora)
    options.validate(family)
    try:
        prompts = read_prompts(prompts_file)
    except ValueError as err:
        raise ConfigError("--prompts-file", str(prompts_file), str(err)) from None
    pipe = load_pipeline(pretrained, lora, options, family)
    args = call_arguments(pipe, family, options)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for k, prompt in enumerate(tqdm(prompts, desc="sample", unit="prompt")):
        generator = torch.Generator("cpu").manual_seed(options.seed + k)
        result = pipe(prompt=prompt, generator=generator, **args)
        pixels = result.frames[0] if hasattr(result, "frames") else result.images[0]
        records.append({"index": k, "prompt": prompt, "seed": options.seed + k, "file": write_sample(pixels, out, k)})
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return [out / r["file"] for r in records]
