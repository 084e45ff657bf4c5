"""``lean sample``: images (videos: frames) from a diffusers pipeline folder with a LoRA folder loaded, sampled by the
pipeline itself, as a user of the trained model samples them.

The pipeline class is the one ``model_index.json`` names (a family's ``FamilySpec.pipeline``: FluxPipeline,
StableDiffusion3Pipeline, WanPipeline); the LoRA folder (``<run>/lora``, or ``lean export``'s) is loaded with
``pipe.load_lora_weights``. Each prompt is one call ``pipe(prompt=..., num_inference_steps=..., guidance_scale=...,
generator=...)``: the ODE of the pipeline's scheduler. A folder without ``scheduler/`` (lean's own base folders) gets
the family's published scheduler config (``lean.models.scheduler.build_scheduler``); ``shift`` sets a static shift
instead (the ``sample.shift`` a run trained with). The text encoders see what lean's policy gives them: CLIP padded to
its full context, T5 at most the tokenizer's ``model_max_length`` tokens (lean's ``model.text_max_length``).

The run's settings: an export (``<run>/lora``, ``lean export``'s folders, ``--merge``'s included) carries the settings
of the run's evaluation in ``lean_sampling.json`` (``lean.export.sampling_settings``); every option left unset
(None) takes its value from the LoRA folder's file, else the pipeline folder's (:func:`with_run_defaults`), so that
``lean sample`` without options draws as the run's evaluation did: the run's eval resolution (``eval.resolution``,
else ``model.resolution``: not the rollout's where they differ; ``--resolution`` is this tool's own), steps, guidance,
static shift and sigma grid (FluxPipeline and StableDiffusion3Pipeline get the grid as their ``sigmas`` argument;
WanPipeline steps on its UniPC scheduler's own grid). A folder without the file leaves the pipeline's defaults.

The noise: prompt k (file order) starts from the noise lean's evaluation draws for eval prompt k, sample 0, at eval
seed ``seed`` (:func:`noise_generator`; default the run's ``eval.seed``). With the run's eval prompts in order and no
options, image k is the run's ``eval/<iteration>/p<k>_s00.png`` of the same weights (the EMA ones with ``ema.enabled``
and ``eval.use_ema``: ``lora_ema/``, ``lean export --ema``) to 1/255 for FLUX and SD3 in float32
(``tests/test_export.py``): the pipeline runs CFG as two one-row forwards and feeds the transformer
(1000 sigma) / 1000, the evaluation one [uncond, cond] batch and sigma, which round differently in the last bits.
WanPipeline's UniPC multistep solver is not the evaluation's Euler step: a Wan run's samples stay close to its eval
images but not equal. Nor are they equal for a run with ``sample.truncate_timestep`` or an eval guidance scale below 1
(the pipelines guide only above 1), or at another ``dtype`` than the run's ``model.dtype``. An image depends on its
prompt, its position and the seed only. Outputs under ``out``: ``<k>.png`` (5 digits), for video ``<k>/<frame>.png``
and ``<k>.gif``; ``samples.jsonl``: one line per prompt, ``{"index", "prompt", "seed", "file"}``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lean.config import ConfigError
from lean.config.dtypes import DTYPES
from lean.config.prompts import conditioning_pixels, read_prompts, reference_image
from lean.evaluation import EVAL_STREAM
from lean.export import LORA_DIR, LORA_WEIGHTS, SAMPLING_FILE, expert_weight_name
from lean.models.checks import pipeline_family, pretrained_problem
from lean.models.processors import load_processor
from lean.models.registry import FAMILIES, family_spec
from lean.models.scheduler import build_scheduler
from lean.sampling.rollout import sample_generator
from lean.sampling.sde import SIGMA_GRIDS, sigma_schedule

GIF_FRAME_MS = 125  # 8 frames per second


@dataclass
class SampleOptions:
    """What ``lean sample`` draws; None takes the run's setting (:func:`with_run_defaults`), else leaves the
    pipeline's own default."""

    num_steps: int | None = None
    """Scheduler steps (``num_inference_steps``)."""
    guidance_scale: float | None = None
    """The pipeline's ``guidance_scale``: CFG for SD3 and Wan, the distilled-guidance embedding for FLUX."""
    guidance_scale_2: float | None = None
    """Wan2.2-A14B: the low-noise expert's ``guidance_scale_2`` (``sample.guidance_scale_2``)."""
    true_cfg_scale: float | None = None
    """FLUX and Qwen-Image: CFG against the empty prompt (the pipeline's ``true_cfg_scale``), as lean's runs with
    ``sample.cfg: true`` guide."""
    seed: int | None = None
    """Prompt k starts from the eval noise of eval prompt k, sample 0, at this eval seed (:func:`noise_generator`);
    None: the run's ``eval.seed``, else 0."""
    resolution: int | None = None
    """Image side in pixels (the height when ``width`` is set); None: the run's eval side (``eval.resolution``, else
    ``model.resolution``)."""
    width: int | None = None
    """Frame width in pixels where it is not ``resolution`` (``model.width``)."""
    num_frames: int | None = None
    """Video families: frames per video; None: the run's eval frames (``eval.num_frames``, else
    ``model.num_frames``)."""
    shift: float | None = None
    """A static sigma shift instead of the folder's scheduler config."""
    sigma_grid: str | None = None
    """A name of ``lean.sampling.sde.SIGMA_GRIDS``: the sampling sigmas lean's runs use (``sample.sigma_grid``), passed
    as the pipeline's ``sigmas`` (FluxPipeline, StableDiffusion3Pipeline); needs a static ``shift``. None: the
    pipeline's own grid."""
    negative_prompt: str | None = None
    """CFG's unconditional prompt (``sample.negative_prompt``); None: the empty prompt."""
    shift_terminal: float | None = None
    """With ``sigma_grid``: the grid's terminal stretch (``sample.shift_terminal`` as the run resolved it,
    Qwen-Image's 0.02)."""
    reference_resolution: int | None = None
    """Edits: the square side the reference image is resized to (PIL's Lanczos) before the pipeline takes it
    (``model.reference_resolution``); None: the image side (``resolution``, PIL's bicubic), as the run resized it."""
    dtype: str | None = None
    """Precision (a name of ``lean.config.dtypes.DTYPES``); None: bfloat16 on a GPU, float32 on the CPU."""
    device: str | None = None
    """None: the first GPU if there is one, else the CPU."""

    def validate(self, family: str) -> None:
        if self.num_steps is not None and self.num_steps < 1:
            raise ConfigError("--num-steps", self.num_steps, "must be >= 1")
        sides = (("--resolution", self.resolution), ("--width", self.width))
        for flag, pixels in (*sides, ("--reference-resolution", self.reference_resolution)):
            if pixels is not None and (pixels < 16 or pixels % 16):
                raise ConfigError(flag, pixels, "must be a positive multiple of 16")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError("--dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")
        spec = family_spec(family)
        if self.sigma_grid is not None:
            if self.sigma_grid not in SIGMA_GRIDS:
                raise ConfigError("--sigma-grid", self.sigma_grid, f"must be one of {', '.join(SIGMA_GRIDS)}")
            if not takes_sigmas(family):
                raise ConfigError("--sigma-grid", self.sigma_grid, f"{spec.pipeline} steps on its scheduler's own grid")
        if self.shift_terminal is not None:
            if not 0 < self.shift_terminal < 1:
                raise ConfigError("--shift-terminal", self.shift_terminal, "must be in (0, 1)")
            if self.sigma_grid is None:
                raise ConfigError("--shift-terminal", self.shift_terminal, "stretches lean's grid: set --sigma-grid")
        if self.true_cfg_scale is not None and not (spec.guidance_embed or spec.true_cfg):
            raise ConfigError("--true-cfg-scale", self.true_cfg_scale, f"{spec.pipeline} guides with --guidance-scale")
        if self.true_cfg_scale is not None and not pipeline_takes(spec.pipeline, "true_cfg_scale"):
            # FLUX.2 [dev]: guidance-distilled, and its pipeline has no true CFG to draw a CFG-trained run with
            raise ConfigError("--true-cfg-scale", self.true_cfg_scale, f"{spec.pipeline} has no true CFG")
        step = spec.vae.temporal_compression
        if self.num_frames is not None:
            if step is None:
                raise ConfigError("--num-frames", self.num_frames, f"{spec.pipeline} makes images")
            if self.num_frames < 1 or (self.num_frames - 1) % step:
                raise ConfigError("--num-frames", self.num_frames, f"{spec.display_name} needs {step}k+1 frames")


def pipeline_takes(pipeline: str, argument: str) -> bool:
    """Whether the diffusers pipeline class ``pipeline``'s ``__call__`` takes ``argument``."""
    import diffusers  # local: diffusers takes seconds to import

    return argument in inspect.signature(getattr(diffusers, pipeline).__call__).parameters


SETTINGS = tuple(
    f.name for f in dataclasses.fields(SampleOptions) if f.name not in ("dtype", "device")
)  # what lean_sampling.json sets


def takes_sigmas(family: str) -> bool:
    """Whether the family's pipeline call takes ``sigmas`` (``FamilySpec.takes_sigmas``)."""
    return family_spec(family).takes_sigmas


def run_settings(pretrained: str | Path, lora: str | Path | None) -> tuple[dict, Path] | None:
    """The run's sampling settings an export carries (``lean_sampling.json``) and the file: the LoRA folder's, else
    the pipeline folder's; None when neither has one (an older export, or a pipeline not from lean)."""
    for flag, folder in (("--lora", lora), ("--pretrained", pretrained)):
        path = Path(folder) / SAMPLING_FILE if folder is not None else None
        if path is None or not path.is_file():
            continue
        try:
            settings = json.loads(path.read_text())
        except ValueError as err:
            raise ConfigError(flag, str(folder), f"{SAMPLING_FILE} is not readable JSON ({err})") from None
        if not isinstance(settings, dict):
            raise ConfigError(flag, str(folder), f"{SAMPLING_FILE} is not a JSON object")
        return settings, path
    return None


def with_run_defaults(
    options: SampleOptions, family: str, pretrained: str | Path, lora: str | Path | None
) -> tuple[SampleOptions, Path | None]:
    """``options`` with each unset (None) setting taken from the run's (:func:`run_settings`), and the file they
    came from (None: no file; then the seed defaults to 0 and the rest stays the pipeline's). Settings of another
    pipeline class are a :class:`ConfigError`; the sigma grid is dropped for a pipeline that takes no ``sigmas``."""
    found = run_settings(pretrained, lora)
    if found is None:
        return dataclasses.replace(options, seed=0 if options.seed is None else options.seed), None
    settings, path = found
    pipeline = family_spec(family).pipeline
    if settings.get("pipeline") != pipeline:
        flag = "--lora" if lora is not None and path.parent == Path(lora) else "--pretrained"
        why = f"{SAMPLING_FILE} is for a {settings.get('pipeline')}, not the {pipeline} of --pretrained"
        raise ConfigError(flag, str(path.parent), why)
    defaults = {k: settings.get(k) for k in SETTINGS}
    if not takes_sigmas(family):
        defaults["sigma_grid"] = None  # WanPipeline: its UniPC scheduler's own grid
    chosen = {k: defaults[k] if getattr(options, k) is None else getattr(options, k) for k in SETTINGS}
    chosen["seed"] = 0 if chosen["seed"] is None else chosen["seed"]
    return dataclasses.replace(options, **chosen), path


def describe(options: SampleOptions) -> str:
    """The settings of ``options`` that are set, in words (None: the pipeline's default)."""
    names = {
        "resolution": "{} px",
        "width": "{} px wide",
        "num_frames": "{} frames",
        "num_steps": "{} steps",
        "guidance_scale": "guidance_scale {}",
        "guidance_scale_2": "guidance_scale_2 {}",
        "true_cfg_scale": "true_cfg_scale {}",
        "shift": "shift {:.6g}",
        "sigma_grid": "{} sigma grid",
        "shift_terminal": "stretched to {:.6g}",
        "negative_prompt": "negative prompt {!r}",
        "reference_resolution": "references at {} px",
        "seed": "seed {}",
    }
    return ", ".join(text.format(getattr(options, k)) for k, text in names.items() if getattr(options, k) is not None)


def noise_generator(seed: int, index: int) -> torch.Generator:
    """Prompt ``index``'s noise: the stream from which lean's evaluation (``lean.evaluation.Evaluator.sample``) draws
    eval prompt ``index``'s sample 0 with ``eval.seed`` = ``seed``. The pipeline draws its initial latents from it
    (one ``randn`` of the latent shape, as lean's ``init_latents``; in a half-precision ``dtype`` the same draws,
    rounded)."""
    return sample_generator(seed, EVAL_STREAM, 0, index, 0)


def pipeline_sigmas(num_steps: int, shift: float, grid: str, terminal: float | None = None) -> list[float]:
    """The ``sigmas`` argument that makes FluxPipeline / StableDiffusion3Pipeline, with a scheduler of the static
    ``shift`` (and no terminal stretch: ``lean.models.scheduler.build_scheduler``), step on lean's grid
    ``sigma_schedule(num_steps, shift, grid, terminal)``: the scheduler shifts what it is given by
    f(s) = shift s / (1 + (shift - 1) s) (in float32) and appends 0, so these are f^-1 of the grid's first
    ``num_steps`` points, s = g / (shift - (shift - 1) g)."""
    g = sigma_schedule(num_steps, shift, grid, terminal)[:-1]
    return (g / (shift - (shift - 1) * g)).tolist()


def template_prefix_tokens(tokenizer, template: str) -> int:
    """Tokens of a prompt template before its ``{}``, in ``tokenizer``: what QwenImagePipeline cuts from the text
    encoder's states (its ``prompt_template_encode_start_idx``, hard-coded as 34 for Qwen2's tokenizer, which this
    count gives; lean's word-level tokenizer splits the prefix differently, as lean's Qwen-Image family counts it).
    A template with an image (QwenImageEditPipeline's) is cut before its ``<|vision_start|>``: the pipeline keeps the
    image's tokens, which its processor expands (its 64; lean.models.qwen_image_edit.model)."""
    prefix = template.split("{}")[0].split("<|vision_start|>")[0]
    return len(tokenizer(prefix, add_special_tokens=False, verbose=False).input_ids)


def check_folders(pretrained: str | Path, lora: str | Path | None) -> str:
    """The family of the ``pretrained`` pipeline folder; a folder that is not a pipeline lean knows, or a LoRA
    folder without diffusers' weight file, is a :class:`ConfigError`."""
    family = pipeline_family(pretrained)
    if family is None:
        pipelines = ", ".join(spec.pipeline for spec in FAMILIES.values())
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
    for name, processor in family_spec(family).processors.items():  # lean's assembly of it (lean.models.processors)
        extra[name] = load_processor(processor, Path(pretrained) / name)
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(pretrained, dtype=dtype, **extra)
    if lora is not None:
        pipe.load_lora_weights(lora)
        for name in family_spec(family).denoiser_folders[1:]:  # Wan2.2's low-noise expert: its own file
            pipe.load_lora_weights(lora, weight_name=expert_weight_name(name), load_into_transformer_2=True)
    if hasattr(pipe, "tokenizer_max_length") and hasattr(pipe.text_encoder.config, "max_position_embeddings"):
        pipe.tokenizer_max_length = pipe.text_encoder.config.max_position_embeddings  # CLIP: its whole context
    if hasattr(pipe, "prompt_template_encode_start_idx"):  # a chat template's prefix, cut by a hard-coded count
        pipe.prompt_template_encode_start_idx = template_prefix_tokens(pipe.tokenizer, pipe.prompt_template_encode)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def call_arguments(pipe, family: str, options: SampleOptions) -> dict:
    """The pipeline call's keyword arguments shared by every prompt."""
    spec = family_spec(family)
    args = {"num_inference_steps": options.num_steps, "guidance_scale": options.guidance_scale, "output_type": "np"}
    if options.guidance_scale_2 is not None:  # WanPipeline with transformer_2
        args["guidance_scale_2"] = options.guidance_scale_2
    if options.true_cfg_scale is not None:
        args.update(true_cfg_scale=options.true_cfg_scale, negative_prompt=options.negative_prompt or "")
    elif options.negative_prompt:  # CFG's unconditional prompt where the pipeline guides by guidance_scale
        args["negative_prompt"] = options.negative_prompt
    if options.resolution is not None:
        args.update(height=options.resolution, width=options.width or options.resolution)
    if spec.video:
        args["num_frames"] = options.num_frames
    if options.sigma_grid is not None:
        steps = options.num_steps or inspect.signature(pipe.__call__).parameters["num_inference_steps"].default
        args["sigmas"] = pipeline_sigmas(steps, options.shift, options.sigma_grid, options.shift_terminal)
    # the T5 encoder sees at most the tokens its tokenizer was saved with
    t5 = getattr(pipe, spec.t5_tokenizer)
    default = inspect.signature(pipe.__call__).parameters["max_sequence_length"].default
    args["max_sequence_length"] = min(default, t5.model_max_length)
    return {k: v for k, v in args.items() if v is not None}


def reference_arguments(pipe, prompt: str, resolution: int, reference_resolution: int | None = None) -> dict:
    """An edit's reference image for the pipeline call (``image``), resized to the square ``resolution`` as lean's
    policy conditions on it (with ``reference_resolution``: to that side, Lanczos, as ``model.reference_resolution``
    does; the FLUX.2 pipelines keep a square of at most 1024 px as it is). FluxKontextPipeline's own resizing is
    switched off: to its preferred resolutions (``_auto_resize``, which FlowGRPO's Kontext sampler ignores) and to its
    1024^2 area (``max_area``, FlowGRPO: 512^2 at 512 px). A text prompt: nothing."""
    from PIL import Image  # local: only edits need it

    if reference_image(prompt) is None:
        return {}
    pixels = conditioning_pixels(prompt, resolution, reference_resolution)
    args = {"image": Image.fromarray(to_uint8(pixels.permute(1, 2, 0)).numpy())}
    if "_auto_resize" in inspect.signature(pipe.__call__).parameters:
        args.update(_auto_resize=False, max_area=pixels.shape[-1] ** 2)
    return args


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
    Unset options take the run's settings (:func:`with_run_defaults`). Bad arguments are :class:`ConfigError` before
    any model is loaded."""
    family = check_folders(pretrained, lora)
    options.validate(family)  # what was given
    options, source = with_run_defaults(options, family, pretrained, lora)
    options.validate(family)  # with the run's settings
    if options.sigma_grid is not None and options.shift is None:
        raise ConfigError("--sigma-grid", options.sigma_grid, "needs a static --shift")
    try:
        prompts = read_prompts(prompts_file)
    except ValueError as err:
        raise ConfigError("--prompts-file", str(prompts_file), str(err)) from None
    origin = f" (unset options from {source})" if source is not None else " (no lean_sampling.json: pipeline defaults)"
    print(f"lean sample: {describe(options) or 'the pipeline defaults'}{origin}")
    pipe = load_pipeline(pretrained, lora, options, family)
    args = call_arguments(pipe, family, options)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for k, prompt in enumerate(tqdm(prompts, desc="sample", unit="prompt")):
        side = options.resolution or pipe.default_sample_size * pipe.vae_scale_factor
        edit = reference_arguments(pipe, prompt, side, options.reference_resolution)
        result = pipe(prompt=str(prompt), generator=noise_generator(options.seed, k), **args, **edit)
        pixels = result.frames[0] if hasattr(result, "frames") else result.images[0]
        record = {"index": k, "prompt": str(prompt), "seed": options.seed, "file": write_sample(pixels, out, k)}
        records.append(record if reference_image(prompt) is None else {**record, "image": reference_image(prompt)})
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return [out / r["file"] for r in records]
