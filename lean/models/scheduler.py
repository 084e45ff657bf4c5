"""The sigma grid's shift as a family's pipeline computes it: :func:`scheduler_config` (a pretrained folder's
``scheduler/scheduler_config.json``, else the family's published one), :func:`time_shift` (static, or dynamic in the
image token count), :func:`terminal_stretch` and the diffusers scheduler itself (:func:`build_scheduler`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from lean.models.registry import family_spec

SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"  # in a diffusers pipeline folder


def scheduler_config(family: str, pretrained: str | os.PathLike | None) -> tuple[dict, str]:
    """The scheduler settings of a run and where they come from: ``<pretrained>/scheduler/scheduler_config.json``
    when the folder has one, else the family's published one (``FamilySpec.scheduler``)."""
    if pretrained is not None:
        path = Path(pretrained) / SCHEDULER_CONFIG
        if path.exists():
            return json.loads(path.read_text()), str(path)
    spec = family_spec(family)
    return dict(spec.scheduler), f"{spec.display_name}'s published scheduler config"


def build_scheduler(family: str, pretrained: str | os.PathLike | None, shift: float | None = None):
    """The diffusers scheduler a pipeline of ``family`` samples with: the class and settings of
    :func:`scheduler_config` (``_class_name`` names the class, as in a ``scheduler_config.json``); with ``shift``,
    that static shift instead (``flow_shift`` of Wan's UniPC scheduler, else ``shift``; no dynamic shifting, no
    terminal stretch), e.g. the shift a run sampled with (``sample.shift`` as resolved)."""
    import diffusers  # local: diffusers takes seconds to import

    config, _ = scheduler_config(family, pretrained)
    name = config.get("_class_name") or family_spec(family).scheduler["_class_name"]
    if shift is not None:
        config = {**config, ("flow_shift" if "flow_shift" in config else "shift"): shift, "use_dynamic_shifting": False}
        if config.get("shift_terminal"):  # lean's grids have no terminal stretch (Qwen-Image's 0.02)
            config["shift_terminal"] = None
    return getattr(diffusers, name).from_config(config)


def time_shift(
    family: str,
    pretrained: str | os.PathLike | None,
    shift: float | None,
    image_seq_len: int,
    num_steps: int | None = None,
) -> tuple[float, str]:
    """The sigma grid's time shift and where it comes from. ``shift`` (``sample.shift``) wins when set; otherwise the
    scheduler config of :func:`scheduler_config`, read as diffusers' pipelines read it:

    * ``use_dynamic_shifting`` (FLUX.1; SD3 pipelines too when set): the shift is ``e^mu`` (``time_shift_type``
      exponential, diffusers' default) or ``mu`` (linear), mu from :func:`dynamic_mu`;
    * else ``flow_shift`` (Wan's UniPCMultistepScheduler), else ``shift`` (FlowMatchEulerDiscreteScheduler, whose
      default is 1).
    """
    if shift is not None:
        return float(shift), "sample.shift"
    config, source = scheduler_config(family, pretrained)
    if not config.get("use_dynamic_shifting", False):
        return float(config.get("flow_shift", config.get("shift", 1.0))), source
    mu = dynamic_mu(family, config, image_seq_len, num_steps)
    kind = config.get("time_shift_type", "exponential")
    if kind not in ("exponential", "linear"):
        raise ValueError(f"{source}: time_shift_type={kind!r} is not supported (exponential, linear)")
    value = math.exp(mu) if kind == "exponential" else mu
    return value, f"{source}, dynamic: mu={mu:.4g} at {image_seq_len} image tokens"


def dynamic_mu(family: str, config: dict, image_seq_len: int, num_steps: int | None) -> float:
    """A dynamically shifting scheduler's mu: linear in the image token count, ``base_shift`` at
    ``base_image_seq_len`` tokens to ``max_shift`` at ``max_image_seq_len`` (FluxPipeline's ``calculate_shift``,
    extrapolated beyond them as it is); a family with a ``FamilySpec.mu_rule`` computes mu as its pipeline does
    instead, from the image token count and ``num_steps`` (Flux2Pipeline's ``compute_empirical_mu``)."""
    rule = family_spec(family).mu_rule
    if rule is not None:
        if num_steps is None:
            raise ValueError(f"{family}'s pipeline computes mu from the step count: pass num_steps")
        return rule(image_seq_len, num_steps)
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


def terminal_stretch(
    family: str, pretrained: str | os.PathLike | None, shift: float | None, shift_terminal: float | None
) -> float | None:
    """The sigma grid's terminal stretch (``lean.sampling.sde.sigma_schedule``'s ``terminal``):
    ``sample.shift_terminal`` when set; else, when the shift too comes from the scheduler config (``sample.shift``
    None), that config's ``shift_terminal`` (Qwen-Image: 0.02); else none, since a static ``sample.shift`` replaces the
    scheduler's shifting."""
    if shift_terminal is not None or shift is not None:
        return shift_terminal
    return scheduler_config(family, pretrained)[0].get("shift_terminal") or None
