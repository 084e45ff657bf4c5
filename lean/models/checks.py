"""The family's configuration rules, read from its spec and JSON alone (nothing is built): :func:`check_config`
(``lean.configure`` runs it), :func:`family_defaults` (run before the rules), whether a pretrained folder holds a
pipeline of the family (:func:`pretrained_problem`) and which family a folder holds (:func:`pipeline_family`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from lean.config import ConfigError, suggest
from lean.config.dtypes import HALF
from lean.config.prompts import reference_image
from lean.models.options import ModelConfig
from lean.models.registry import FAMILIES, family_spec
from lean.models.spec import FamilySpec
from lean.parallel.sharding import shards

if TYPE_CHECKING:
    from lean.config import RunConfig

# What an editing family edits when no prompt file is given: lean.workbench.data.write_edit_dataset's recolouring task
EDIT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "edits" / "train_metadata.jsonl"


def pretrained_problem(family: str, folder: str | os.PathLike) -> str | None:
    """What keeps ``folder`` from loading as a ``family`` pipeline (one line), or None. Reads only JSON: the checks
    ``lean.models.build._load_components`` relies on, made before any model is built."""
    spec, folder = family_spec(family), Path(folder)
    if not folder.is_dir():
        return "is not a folder (a local diffusers pipeline folder, as save_pretrained writes it)"
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except FileNotFoundError:
        return "has no model_index.json: not a diffusers pipeline folder"
    except (OSError, ValueError) as err:
        return f"model_index.json is not readable JSON ({str(err).splitlines()[0]})"
    needed = [*spec.components, *spec.tokenizers.values(), *spec.processors]
    malformed = [n for n in needed if not (isinstance(index.get(n), list) and len(index[n]) == 2)]
    if malformed:
        return f"model_index.json has no [library, class] for {', '.join(malformed)} (a {spec.display_name} pipeline)"
    for name in spec.denoiser_folders:
        expected = spec.components[name].model_class
        if index[name][1] != expected:
            return f"holds a {index[name][1]}, not model.family={family}'s {expected}"
    # the same denoiser class in another family's pipeline (FLUX.2 [dev] and [klein]): its index names that pipeline
    named = index.get("_class_name")
    owner = next((f for f, s in FAMILIES.items() if s.pipeline == named and f != family), None)
    if owner is not None and named != spec.pipeline:
        return f"holds a {named} (model.family={owner}), not model.family={family}'s {spec.pipeline}"
    return _configs_problem(spec, folder) or _vae_problem(family, folder)


def _configs_problem(spec: FamilySpec, folder: Path) -> str | None:
    """A component folder of ``folder`` without a readable ``config.json`` (one line), or None."""
    for name in spec.components:
        try:
            json.loads((folder / name / "config.json").read_text())
        except FileNotFoundError:
            return f"has no {name}/config.json"
        except (OSError, ValueError) as err:
            return f"{name}/config.json is not readable JSON ({str(err).splitlines()[0]})"
    return None


def _vae_problem(family: str, folder: Path) -> str | None:
    """The same pipeline and denoiser class around another VAE (Wan2.1's 16 latent channels, Wan2.2-TI2V's 48): one
    line naming the family whose VAE it is, or None."""
    spec = family_spec(family)
    channels, expected = _vae_channels(folder), _latent_channels(spec)
    if channels is None or not expected or channels in expected:
        return None
    owner = next(
        (f for f, s in FAMILIES.items() if s.pipeline == spec.pipeline and channels in _latent_channels(s)), None
    )
    wanted = "/".join(map(str, sorted(expected)))
    holder = f" (model.family={owner})" if owner else ""
    return f"holds a {channels}-channel VAE{holder}, not model.family={family}'s {wanted}-channel one"


def _latent_channels(spec: FamilySpec) -> set[int]:
    """The VAE latent channels (``z_dim``) of a family's sizes; empty where its VAE config names none."""
    return {s.vae["z_dim"] for s in spec.sizes.values() if "z_dim" in s.vae}


def _vae_channels(folder: Path) -> int | None:
    """``z_dim`` of a pipeline folder's ``vae/config.json``, or None (none, or unreadable)."""
    try:
        channels = json.loads((folder / "vae" / "config.json").read_text()).get("z_dim")
    except (OSError, ValueError, AttributeError):
        return None
    return channels if isinstance(channels, int) else None


def _pixel_multiple(spec: FamilySpec, size: str, pretrained: str | None) -> int | None:
    """The side every resolution must be a multiple of where the configs say it (Wan's): the VAE's
    ``scale_factor_spatial`` times the transformer's spatial ``patch_size``, from the size table or the pretrained
    folder's JSON; None where they do not name both."""
    name = spec.denoiser_folders[0]
    if pretrained is None:
        vae, t = spec.size_config(size, "vae"), spec.size_config(size, name)
    else:
        vae, t = (json.loads((Path(pretrained) / n / "config.json").read_text()) for n in ("vae", name))
    scale, patch = vae.get("scale_factor_spatial"), t.get("patch_size")
    return scale * patch[-1] if isinstance(scale, int) and isinstance(patch, list | tuple) else None


def pipeline_family(folder: str | os.PathLike) -> str | None:
    """The family whose pipeline class a pipeline folder's ``model_index.json`` names, or None (no readable
    index, or a pipeline class no family runs)."""
    try:
        index = json.loads((Path(folder) / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    name = index.get("_class_name") if isinstance(index, dict) else None
    families = [family for family, spec in FAMILIES.items() if spec.pipeline == name]

    def present(folder: str) -> bool:  # diffusers writes [null, null] for an absent optional component
        entry = index.get(folder)
        return isinstance(entry, list) and bool(entry) and entry[0] is not None

    # WanPipeline runs Wan2.1 (one transformer), Wan2.2-A14B (transformer_2 too) and Wan2.2-TI2V-5B (one transformer,
    # the 48-channel Wan2.2 VAE, expand_timesteps): the families whose VAE latent channels the folder's VAE has, then
    # the most denoisers the folder has
    complete = [f for f in families if all(present(d) for d in FAMILIES[f].denoiser_folders)]
    channels = _vae_channels(Path(folder))
    fitting = [f for f in complete if channels is None or channels in (_latent_channels(FAMILIES[f]) or {channels})]
    return max(
        fitting or complete, key=lambda f: len(FAMILIES[f].denoiser_folders), default=families[0] if families else None
    )


def family_defaults(cfg: RunConfig) -> None:
    """The family's own defaults, set before any rule runs: a run that edits (:func:`edits`) given lean's default text
    prompts edits the bundled recolouring set (:data:`EDIT_PROMPTS`) instead; a video family whose VAE cannot make
    lean's default frame count (``FamilySpec.num_frames``: LTX-2's 8k + 1) renders its own instead."""
    from lean.config import DEFAULT_PROMPTS, prompts_of_file  # local: lean.config imports no domain module

    own_frames = family_spec(cfg.model.family).num_frames
    if own_frames is not None and cfg.model.num_frames == ModelConfig.num_frames:
        cfg.model.num_frames = own_frames
    t = cfg.train
    if t.prompts_file is None and t.prompts == DEFAULT_PROMPTS and edits(cfg.model, []):
        t.prompts_file = str(EDIT_PROMPTS)
        t.prompts = prompts_of_file("train.prompts_file", t.prompts_file)


def edits(m: ModelConfig, prompts: list[str]) -> bool:
    """Whether the run edits: ``model.edit`` where set, else an edit-only family's always, and a family whose
    reference image is optional (FLUX.2) when ``prompts`` (the training prompts) carry images."""
    family = family_spec(m.family)
    if m.edit is not None:
        return m.edit
    if not family.reference_optional:
        return family.reference_images
    return any(reference_image(p) is not None for p in prompts)


def check_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """The family's configuration rules (``lean.configure`` runs them): the size and frame count exist, the
    pretrained folder holds a pipeline of it, the frame sides fit it, the prompts suit it and the capabilities asked
    for are the family's."""
    m, s, family = cfg.model, cfg.sample, family_spec(cfg.model.family)
    _check_size(m, family)
    if m.pretrained is not None and (problem := pretrained_problem(m.family, m.pretrained)) is not None:
        raise ConfigError("model.pretrained", m.pretrained, problem)
    _check_sides(m, family)
    _check_eval_geometry(cfg, family)
    if s.guidance_scale_2 is not None and family.boundary is None:
        raise ConfigError(
            "sample.guidance_scale_2",
            s.guidance_scale_2,
            f"is the low-noise expert's CFG scale; {family.display_name} has one denoiser (set null)",
        )
    _check_prompts(cfg, family)
    _check_capabilities(cfg, family)


def _check_size(m: ModelConfig, family: FamilySpec) -> None:
    """``model.size`` is one of the family's; the frame count fits its VAE's temporal compression."""
    if m.size not in family.sizes:
        raise ConfigError(
            "model.size", m.size, f"{m.family} comes in {', '.join(family.sizes)}" + suggest(m.size, family.sizes)
        )
    step = family.vae.temporal_compression  # video VAEs compress time: F = step k + 1 frames
    if step and (m.num_frames - 1) % step:
        raise ConfigError(
            "model.num_frames",
            m.num_frames,
            f"{family.display_name}'s VAE needs {step}k+1 frames (1, {1 + step}, {1 + 2 * step}, ...)",
        )


def _check_sides(m: ModelConfig, family: FamilySpec) -> None:
    """A width only for a family that renders non-square frames; each side a multiple of what the configs need."""
    if m.width is not None and not family.non_square:
        able = ", ".join(n for n, f in FAMILIES.items() if f.non_square)
        raise ConfigError(
            "model.width", m.width, f"{family.display_name} renders square frames (families with a width: {able})"
        )
    side = _pixel_multiple(family, m.size, m.pretrained)
    for key, pixels in (("model.resolution", m.resolution), ("model.width", m.width)):
        if side is not None and pixels is not None and pixels % side:  # Wan2.2-TI2V's 16x VAE, 2x2 patches: 32
            raise ConfigError(
                key, pixels, f"{family.display_name} needs a multiple of {side} pixels (VAE compression x patch)"
            )


def _check_eval_geometry(cfg: RunConfig, family: FamilySpec) -> None:
    """``eval.resolution`` and ``eval.num_frames`` pass the rules ``model.resolution`` and ``model.num_frames`` do
    (the family's runtime checks its latent when the evaluator builds it: ``lean.evaluation.eval_runtime``)."""
    m, e = cfg.model, cfg.eval
    step = family.vae.temporal_compression
    if e.num_frames is not None and not step:
        raise ConfigError("eval.num_frames", e.num_frames, f"{family.display_name} makes images (set null)")
    if e.num_frames is not None and (e.num_frames - 1) % step:
        why = f"{family.display_name}'s VAE needs {step}k+1 frames (1, {1 + step}, {1 + 2 * step}, ...)"
        raise ConfigError("eval.num_frames", e.num_frames, why)
    if e.resolution is None:
        return
    if m.width is not None:  # which width the eval frames would have is not obvious: not guessed
        why = f"evaluates square frames; model.width={m.width} renders {m.resolution}x{m.width} (set null)"
        raise ConfigError("eval.resolution", e.resolution, why)
    side = _pixel_multiple(family, m.size, m.pretrained)
    if side is not None and e.resolution % side:
        why = f"{family.display_name} needs a multiple of {side} pixels (VAE compression x patch)"
        raise ConfigError("eval.resolution", e.resolution, why)
    reference = m.reference_resolution or family.sizes[m.size].reference_resolution or e.resolution
    if edits(m, cfg.train.prompts) and reference < family.min_reference_side:
        least = family.min_reference_side
        why = f"{family.pipeline} takes references of at least {least} px; these would be {reference} px"
        raise ConfigError("eval.resolution", e.resolution, why)


def _editing_families() -> list[str]:
    return [n for n, f in FAMILIES.items() if f.reference_images]


def _check_edit_keys(m: ModelConfig, family: FamilySpec, editing_run: bool) -> None:
    """``model.edit`` and ``model.reference_resolution`` suit the family; an edit's reference is as large as the
    family's pipeline takes."""
    editing = _editing_families()
    if m.edit and not family.reference_images:
        raise ConfigError(
            "model.edit", m.edit, f"{family.display_name} takes no reference image ({', '.join(editing)} do)"
        )
    if m.edit is False and family.reference_images and not family.reference_optional:
        raise ConfigError(
            "model.edit", m.edit, f"{family.display_name} only edits (its prompts carry reference images)"
        )
    if m.reference_resolution is not None and not family.reference_images:
        raise ConfigError("model.reference_resolution", m.reference_resolution, f"{m.family} takes no reference image")
    if m.reference_resolution is not None and (own := family.sizes[m.size].reference_resolution) is not None:
        why = f"{family.pipeline} encodes references at its own side ({own} px at size {m.size})"
        raise ConfigError("model.reference_resolution", m.reference_resolution, why)
    side = m.reference_resolution or family.sizes[m.size].reference_resolution or m.resolution
    if editing_run and side < family.min_reference_side:
        raise ConfigError(
            "model.reference_resolution",
            m.reference_resolution,
            f"{family.pipeline} takes references of at least {family.min_reference_side} px; these would be {side} px",
        )


def _check_prompts(cfg: RunConfig, family: FamilySpec) -> None:
    """The edit keys suit the family (:func:`_check_edit_keys`); an edit run's prompts each carry a reference image,
    another run's carry none."""
    m = cfg.model
    editing = _editing_families()
    editing_run = edits(m, cfg.train.prompts)
    _check_edit_keys(m, family, editing_run)
    prompt_sets = [("train.prompts_file", cfg.train.prompts_file, cfg.train.prompts)]
    if cfg.eval.prompts is not None:
        prompt_sets.append(("eval.prompts_file", cfg.eval.prompts_file, cfg.eval.prompts))
    for key, file, prompts in prompt_sets:
        with_image = sum(reference_image(p) is not None for p in prompts)
        if editing_run and with_image < len(prompts):
            raise ConfigError(
                key,
                file,
                f"{family.display_name} edits reference images: every prompt needs one (a .jsonl prompt file whose "
                f'lines carry an "image" path beside the "prompt"); {len(prompts) - with_image} of {len(prompts)} '
                "have none",
            )
        if with_image and not editing_run:
            cannot = (
                f"model.family={m.family} cannot take"
                if not family.reference_images
                else "a text-to-image run (model.edit false, or training prompts without images) cannot take"
            )
            raise ConfigError(
                key,
                file,
                f"{with_image} prompts carry a reference image, which {cannot} "
                f"(editing families: {', '.join(editing)})",
            )


def _check_capabilities(cfg: RunConfig, family: FamilySpec) -> None:
    """A distilled-guidance value only for a family with the embedding; no FSDP over the float32 modules a
    half-precision full fine-tune keeps."""
    m, s = cfg.model, cfg.sample
    if s.guidance_embed is not None and not family.guidance_embed:
        raise ConfigError(
            "sample.guidance_embed",
            s.guidance_embed,
            f"model.family={m.family} has no distilled-guidance embedding (only FLUX has one)",
        )
    if shards(cfg.parallel.shard) and m.full_finetune and m.torch_dtype in HALF and family.keeps_float32:
        raise ConfigError(
            "parallel.shard",
            cfg.parallel.shard,
            f"a half-precision full fine-tune of {m.family} keeps float32 modules FSDP would gather at {m.dtype}",
        )
