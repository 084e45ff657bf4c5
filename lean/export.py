"""Trained weights out of lean in diffusers' formats: ``<out>/lora/`` at the end of ``lean train``; ``lean export``.

A LoRA run's adapter is written as diffusers' training scripts write theirs (``train_dreambooth_lora_flux.py``,
``_sd3.py``): the pipeline class's ``save_lora_weights(folder, transformer_lora_layers=..., transformer_lora_adapter_
metadata=...)`` with peft's ``get_peft_model_state_dict``. That gives ``<folder>/pytorch_lora_weights.safetensors``
with keys ``transformer.<module>.lora_A.weight`` / ``lora_B.weight`` and the peft ``LoraConfig`` (rank, alpha, target
modules) as JSON in the safetensors header (``lora_adapter_metadata``), so that ``pipe.load_lora_weights(folder)``
rebuilds the adapter with its alpha: the layer computes W x + (alpha / r) B A x, as lean's policy does, also when
alpha != r (diffusers would otherwise infer alpha = r from the shapes).

Beside the weights, every export (``<out>/lora/``, ``<out>/lora_ema/``, ``lean export``'s folder with or without
``--merge``) holds ``lean_sampling.json`` (:data:`SAMPLING_FILE`): how the run's evaluation drew its images, in
``lean sample``'s option names (:func:`sampling_settings`), which ``lean sample`` takes as its defaults.

``lean export --run <out> --out DIR`` writes that folder again from a run's ``lora.safetensors`` (``--ema``:
``lora_ema.safetensors``) and ``config.json``, without loading the base weights; a full fine-tune gives the trained
transformer instead (a diffusers model folder). ``--merge`` writes a whole diffusers pipeline folder: the base
pipeline (``model.pretrained``, or the random base rebuilt from the run's config) with W <- W + (alpha / r) B A in
every adapted layer (peft's ``merge_and_unload``) and a scheduler with the run's ``sample.shift`` (static), loadable
with ``<Pipeline>.from_pretrained``.

A random base (``model.pretrained: null``) is drawn from fixed seeds on the CPU (``lean.models.build.build_policy``), so
it is rebuilt exactly, as long as torch and diffusers draw it as they did in the run: ``lean train`` records a SHA-256
of the base weights in ``<out>/base.json``, and ``--merge`` refuses (one line) a rebuild that does not match it. The
``full`` size is drawn on the run's device and is never rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from lean.config import ConfigError, RunConfig
from lean.config.moved import relocated
from lean.configure import load_config
from lean.models.build import build_policy, lora_config
from lean.models.footprint import meta_transformer
from lean.models.options import ModelConfig
from lean.models.policy import Policy
from lean.models.registry import family_spec
from lean.models.scheduler import build_scheduler
from lean.models.spec import is_published
from lean.parallel.sharding import full_state_dict

LORA_DIR, LORA_EMA_DIR = "lora", "lora_ema"  # under a run's output folder
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' default weight name
RUN_WEIGHTS, RUN_EMA_WEIGHTS = "lora.safetensors", "lora_ema.safetensors"  # lean train's trainable parameters
BASE_RECORD = "base.json"  # a random base's fingerprint, written by lean train
SAMPLING_FILE = "lean_sampling.json"  # in every export: the run's eval sampling settings, lean sample's defaults
PEFT_PREFIX = "base_model.model."  # peft's PeftModel in front of the transformer's module names


# ---------------------------------------------------------------- diffusers' LoRA format


def diffusers_lora_layers(peft_transformer, state: dict[str, Tensor] | None = None) -> tuple[dict, dict]:
    """(transformer LoRA layers keyed by the transformer's module names, the adapter's ``LoraConfig`` as a dict):
    what ``<Pipeline>.save_lora_weights`` takes. ``state`` (keyed as ``Policy.lora_state_dict``, e.g. the EMA
    weights) replaces the adapter's current weights."""
    from peft import get_peft_model_state_dict  # local: peft imports transformers (seconds)

    layers = get_peft_model_state_dict(peft_transformer, state_dict=state)
    layers = {k.removeprefix(PEFT_PREFIX): v.detach().cpu().contiguous() for k, v in layers.items()}
    return layers, peft_transformer.peft_config["default"].to_dict()


def save_diffusers_lora(
    pipeline_class: str,
    peft_transformer,
    folder: str | Path,
    state: dict[str, Tensor] | None = None,
    weight_name: str = LORA_WEIGHTS,
) -> Path:
    """``folder/<weight_name>`` (``pytorch_lora_weights.safetensors``) for
    ``<pipeline_class>.load_lora_weights(folder, weight_name=...)``. A pipeline without diffusers' LoRA loader
    (HunyuanVideo15Pipeline in diffusers 0.42) gets the same file from the loaders' common writer, which its
    transformer loads: ``pipe.transformer.load_lora_adapter(folder, prefix="transformer", weight_name=...)``."""
    import diffusers  # local: diffusers takes seconds to import
    from diffusers.loaders.lora_base import LoraBaseMixin

    layers, metadata = diffusers_lora_layers(peft_transformer, state)
    pipeline = getattr(diffusers, pipeline_class)
    if not issubclass(pipeline, LoraBaseMixin):
        LoraBaseMixin._save_lora_weights(
            str(folder), {"transformer": layers}, {"transformer": metadata}, weight_name=weight_name
        )
        return Path(folder)
    pipeline.save_lora_weights(
        str(folder), transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata, weight_name=weight_name
    )
    return Path(folder)


def expert_weight_name(folder_name: str) -> str:
    """The LoRA file of a second denoiser (Wan2.2's ``transformer_2``) beside the first's
    ``pytorch_lora_weights.safetensors``: WanPipeline loads it with
    ``load_lora_weights(folder, weight_name=..., load_into_transformer_2=True)``."""
    return LORA_WEIGHTS.replace(".safetensors", f"_{folder_name}.safetensors")


def save_policy_lora(policy: Policy, folder: str | Path, state: dict[str, Tensor] | None = None) -> None:
    """Every denoiser's LoRA in diffusers' format: the first as ``pytorch_lora_weights.safetensors``, a second one
    (``transformer_2``) as :func:`expert_weight_name`; ``state`` keyed as ``Policy.lora_state_dict``."""
    several = len(policy.denoisers) > 1
    for folder_name, net in zip(policy.denoiser_folders, policy.denoisers, strict=True):
        own = state
        if state is not None and several:
            own = {k.removeprefix(f"{folder_name}."): v for k, v in state.items() if k.startswith(f"{folder_name}.")}
        name = expert_weight_name(folder_name) if net is not policy.denoisers[0] else LORA_WEIGHTS
        save_diffusers_lora(policy.pipeline_class, net, folder, own, name)


def sampling_settings(cfg: RunConfig) -> dict:
    """How the run's evaluation (``lean.evaluation``) draws its images, as the keyword arguments of
    ``lean.tools.sampling.SampleOptions`` (``lean sample``'s options) that make the family's diffusers pipeline draw the
    same: ``num_steps`` (``eval.num_steps`` or ``sample.num_steps``), ``resolution`` (``eval.resolution`` or
    ``model.resolution``: the eval's side), ``num_frames`` (video: ``eval.num_frames`` or ``model.num_frames``),
    ``shift`` (``sample.shift`` as the run resolved it, static),
    ``sigma_grid`` (``sample.sigma_grid``), ``shift_terminal`` (as resolved), ``seed`` (``eval.seed``),
    ``reference_resolution`` (edits: ``model.reference_resolution``) and the
    guidance: with ``sample.cfg`` CFG at ``eval.guidance_scale`` (or ``sample.guidance_scale``), which is FLUX's
    ``true_cfg_scale`` (its guidance embedding then sees 1.0, as lean feeds it) and the ``guidance_scale`` of SD3 and
    Wan; without it no CFG (``guidance_scale`` 1.0) and, for FLUX, ``sample.guidance_embed`` (default 1.0) as
    ``guidance_scale``. A family whose pipeline guides
    with ``true_cfg_scale`` alone (``FamilySpec.true_cfg``: Qwen-Image) gets no ``guidance_scale`` and, with
    ``sample.cfg``, the scale as ``true_cfg_scale``; one whose ``guidance_scale`` counts from the conditional velocity
    (``FamilySpec.guidance_from_conditional``: Z-Image) gets the scale less 1. ``pipeline`` names the pipeline class
    they are for."""
    m, s, e = cfg.model, cfg.sample, cfg.eval
    spec = family_spec(m.family)
    scale = s.guidance_scale if e.guidance_scale is None else e.guidance_scale
    embed = spec.guidance_embed
    if spec.true_cfg:  # QwenImagePipeline: CFG is true_cfg_scale (against negative_prompt ""); no guidance_scale
        guidance, true_cfg = None, (scale if s.cfg else None)
    elif s.cfg:
        guidance, true_cfg = (1.0, scale) if embed else (scale, None)
    elif embed:
        guidance, true_cfg = (1.0 if s.guidance_embed is None else s.guidance_embed), None
    else:
        guidance, true_cfg = 1.0, None
    if spec.guidance_from_conditional and guidance is not None:  # ZImagePipeline's g = s - 1; no CFG: 0
        guidance -= 1.0
    return {
        "pipeline": spec.pipeline,
        "num_steps": e.num_steps or s.num_steps,
        "guidance_scale": guidance,
        "guidance_scale_2": s.guidance_scale_2 if s.cfg and e.guidance_scale is None else None,
        "true_cfg_scale": true_cfg,
        "seed": e.seed,
        "resolution": e.resolution or m.resolution,
        "width": m.width,
        "num_frames": (e.num_frames or m.num_frames) if spec.video else None,
        "shift": s.shift,
        "sigma_grid": s.sigma_grid,
        "shift_terminal": s.shift_terminal,
        "negative_prompt": s.negative_prompt if s.cfg and s.negative_prompt else None,
        "reference_resolution": m.reference_resolution,
    }


def write_sampling(folder: str | Path, cfg: RunConfig) -> None:
    """``folder/lean_sampling.json``: :func:`sampling_settings` of the run."""
    (Path(folder) / SAMPLING_FILE).write_text(json.dumps(sampling_settings(cfg), indent=2) + "\n")


def write_run_exports(
    out_dir: Path,
    policy: Policy,
    ema: dict[str, Tensor] | None,
    base_sha256: str | None,
    cfg: RunConfig | None = None,
) -> None:
    """What ``lean train`` adds to its outputs: ``lora/`` (and ``lora_ema/`` with EMA weights) in diffusers' format
    for a LoRA run (the adapter is never sharded), each with the run's sampling settings (:func:`write_sampling`,
    given ``cfg``, the run's config with ``sample.shift`` resolved), and for a random base that can be rebuilt
    (:func:`rebuildable`) its fingerprint (:func:`base_fingerprint`), which ``--merge`` checks a rebuild against."""
    if not policy.full_finetune:
        folders = [(out_dir / LORA_DIR, None), *([(out_dir / LORA_EMA_DIR, ema)] if ema is not None else [])]
        for folder, state in folders:
            save_policy_lora(policy, folder, state)
            if cfg is not None:
                write_sampling(folder, cfg)
    if base_sha256 is not None:
        record = {"base_sha256": base_sha256, "diffusers": diffusers_version()}
        (out_dir / BASE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def rebuildable(model_cfg: ModelConfig) -> bool:
    """A random base (``model.pretrained`` null) below the published sizes: rebuilt exactly from its seeds."""
    return model_cfg.pretrained is None and not is_published(model_cfg.size)


def diffusers_version() -> str:
    from diffusers import __version__  # local: diffusers takes seconds to import

    return __version__


def base_fingerprint(policy: Policy) -> str:
    """SHA-256 over the base weights (names, dtypes, shapes, bytes) of each denoiser (adapter excluded; under full
    fine-tuning its frozen initial copy), the VAE and the text encoders."""
    folders = policy.denoiser_folders
    if policy.full_finetune:  # gathered when sharded
        parts = {n: full_state_dict(r) for n, r in zip(folders, policy.reference_denoisers, strict=True)}
    else:
        parts = {n: policy.base_transformer_state_dict(k) for k, n in enumerate(policy.denoiser_folders)}
    parts |= {"vae": policy.vae.state_dict(), "text": policy.text_encoders.state_dict()}
    digest = hashlib.sha256()
    for part, state in parts.items():
        for name in sorted(state):
            tensor = state[name].detach().cpu().contiguous()
            digest.update(f"{part}.{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())  # 0-d too (BatchNorm's count)
    return digest.hexdigest()


# ---------------------------------------------------------------- lean export


def run_config(run: str | Path) -> RunConfig:
    """The config a run was trained with (``<run>/config.json``), validated. Its prompts (training and eval) are
    already read, so the prompts files need not exist any more; one that still does is read again, so that an edit
    run's prompts get back their reference images (config.json keeps the instructions only)."""
    path = Path(run) / "config.json"
    if not path.is_file():
        raise ConfigError("--run", str(run), "has no config.json: not the output folder of lean train")
    tree = relocated(json.loads(path.read_text()))  # written before a key moved: at its new place
    for section in ("train", "eval"):
        part = tree.get(section, {})
        if not (part.get("prompts_file") and Path(part["prompts_file"]).is_file()):
            part["prompts_file"] = None
    return load_config(tree=tree)


def run_weights(run: str | Path, ema: bool) -> Path:
    """The run's trained parameters: ``lora.safetensors``, or ``lora_ema.safetensors`` with ``ema``."""
    path = Path(run) / (RUN_EMA_WEIGHTS if ema else RUN_WEIGHTS)
    if not path.is_file():
        why = "has no lora_ema.safetensors (the run had ema.enabled: false)" if ema else f"has no {RUN_WEIGHTS}"
        raise ConfigError("--run", str(run), why)
    return path


def adapter_skeleton(cfg: RunConfig):
    """The run's peft-wrapped transformer on the meta device (no weights read, nothing allocated): enough for
    peft to name and configure the adapter's layers."""
    from peft import get_peft_model  # local: peft imports transformers (seconds)

    m = cfg.model
    transformer = meta_transformer(family_spec(m.family), m.size, m.pretrained)
    return get_peft_model(transformer, lora_config(m), autocast_adapter_dtype=False)


def rebuild_policy(cfg: RunConfig, run: str | Path, weights: Path) -> Policy:
    """The run's policy on the CPU with its trained weights: the base from ``model.pretrained``, or the random base
    rebuilt and checked against the run's ``base.json``."""
    m = cfg.model
    if m.pretrained is None and is_published(m.size):
        raise ConfigError(
            "model.pretrained",
            None,
            "the run's random full-size base was drawn on its device and cannot be rebuilt; export without --merge",
        )
    policy = build_policy(m, cfg.train.prompts)
    if m.pretrained is None:
        record = Path(run) / BASE_RECORD
        recorded = json.loads(record.read_text()).get("base_sha256") if record.is_file() else None
        if recorded != base_fingerprint(policy):
            why = (
                "base.json records no fingerprint"
                if recorded is None
                else "a rebuild here differs from the fingerprint in base.json (another torch or diffusers?)"
            )
            raise ConfigError(
                "--run",
                str(run),
                f"its random base (model.pretrained: null) cannot be rebuilt exactly: {why}; export without --merge",
            )
    policy.load_lora_state_dict(matching_weights(weights, trained_shapes(policy.trainable_parameters()), run))
    return policy


def trained_shapes(parameters) -> dict[str, torch.Size]:
    return {name: p.shape for name, p in parameters}


def matching_weights(weights: Path, expected: dict[str, torch.Size], run: str | Path) -> dict[str, Tensor]:
    """The tensors of ``weights``, which must be exactly the parameters (names and shapes) the run's config trains."""
    from safetensors.torch import load_file

    state = load_file(str(weights))
    wrong = sorted(set(state) ^ set(expected)) or [n for n in sorted(state) if state[n].shape != expected[n]]
    if wrong:
        raise ConfigError(
            "--run",
            str(run),
            f"{weights.name} does not hold the parameters config.json trains ({len(wrong)} differ, e.g. {wrong[0]})",
        )
    return state


def unheld_components(family: str) -> list[str]:
    """Components the family's pipeline class requires that a lean policy does not hold (HunyuanVideo15Pipeline's
    ``guider``): a pipeline ``--merge`` cannot assemble."""
    import inspect

    import diffusers  # local: diffusers takes seconds to import

    spec = family_spec(family)
    held = {*spec.components, *spec.tokenizers.values(), *spec.processors, "scheduler"}
    params = inspect.signature(getattr(diffusers, spec.pipeline).__init__).parameters.values()
    return [
        q.name
        for q in list(params)[1:]
        if q.default is q.empty and q.name not in held and q.kind == q.POSITIONAL_OR_KEYWORD
    ]


def assemble_pipeline(policy: Policy, transformer: torch.nn.Module, scheduler):
    """A diffusers pipeline of ``policy``'s class from its parts, with ``transformer`` and ``scheduler``."""
    import diffusers  # local: diffusers takes seconds to import

    parts = {**policy.text_encoders, **policy.tokenizers, "vae": policy.vae, "transformer": transformer}
    return getattr(diffusers, policy.pipeline_class)(scheduler=scheduler, **parts, **policy.pipeline_config)


def export_run(run: str | Path, out: str | Path, ema: bool = False, merge: bool = False) -> str:
    """``lean export``: the run's trained weights as a diffusers LoRA folder (a transformer folder for a full
    fine-tune) or, with ``merge``, a whole pipeline folder with them merged, with the run's sampling settings
    (:data:`SAMPLING_FILE`) beside them. Returns what was written, in words.
    ``out`` is written atomically (a temporary sibling renamed into place); an existing ``out`` is replaced."""
    cfg = run_config(run)
    experts = family_spec(cfg.model.family).denoiser_folders
    if len(experts) > 1 and (merge or cfg.model.full_finetune):  # the merge assembles one transformer
        raise ConfigError(
            "--merge" if merge else "model.full_finetune",
            "true",
            f"{len(experts)} experts are exported as their LoRA files (one per expert): export without --merge",
        )
    if merge and (unheld := unheld_components(cfg.model.family)):
        pipeline = family_spec(cfg.model.family).pipeline
        why = f"a {pipeline} also takes {', '.join(unheld)}, which lean does not hold: export without --merge"
        raise ConfigError("--merge", "true", why)
    weights = run_weights(run, ema)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        if merge or cfg.model.full_finetune:
            policy = rebuild_policy(cfg, run, weights)
            transformer = policy.transformer if policy.full_finetune else policy.transformer.merge_and_unload()
            if merge:
                # the shift the run sampled with, static: its images' sigma grid at model.resolution
                scheduler = build_scheduler(cfg.model.family, cfg.model.pretrained, cfg.sample.shift)
                assemble_pipeline(policy, transformer, scheduler).save_pretrained(tmp)
                what = f"a {policy.pipeline_class} folder with the trained weights merged into its transformer"
            else:
                transformer.save_pretrained(tmp)
                what = "the fully fine-tuned transformer (a diffusers model folder)"
        elif len(experts) > 1:  # Wan2.2-A14B: the run's policy, one LoRA file per expert (save_policy_lora)
            save_policy_lora(rebuild_policy(cfg, run, weights), tmp)
            what = f"a diffusers LoRA folder for {family_spec(cfg.model.family).pipeline}.load_lora_weights, per expert"
        else:
            spec, skeleton = family_spec(cfg.model.family), adapter_skeleton(cfg)
            shapes = trained_shapes((n, p) for n, p in skeleton.named_parameters() if p.requires_grad)
            save_diffusers_lora(spec.pipeline, skeleton, tmp, matching_weights(weights, shapes, run))
            what = f"a diffusers LoRA folder for {spec.pipeline}.load_lora_weights"
        write_sampling(tmp, cfg)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return what
