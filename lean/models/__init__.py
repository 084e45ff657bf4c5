"""Model families behind one :class:`~lean.models.policy.Policy`, by job:

* ``spec``: :class:`FamilySpec`, everything lean reads about a family without building it, and the
  ``FamilyRuntime`` protocol, everything a built policy calls on it (``Policy.runtime``);
* ``<family>/`` (flux, wan, sd3, ...): one package per family, whose ``SPEC`` states every fact about it (its
  ``spec.py``), beside its runtime (``model.py``) and size table (``sizes.py``);
* ``registry``: :data:`FAMILIES` (name -> spec, :func:`family_spec`) and :data:`LORA_INITS`;
* ``build``: :func:`build_policy` (pretrained or random components, the runtime, LoRA or full fine-tuning);
* ``policy``: the :class:`Policy` (velocity with CFG, reference, trainable state, pipeline folders);
* ``scheduler``: the sigma grid's shift as the family's pipeline computes it (:func:`time_shift`,
  :func:`terminal_stretch`, :func:`build_scheduler`);
* ``checks``: the family's configuration rules (``check_config``, ``family_defaults``, :func:`pipeline_family`);
* ``footprint``: sizes from the configs alone (:func:`count_parameters`, ``tracked_step_floor``);
* ``text``, ``processors``, ``precision``, ``sequence_parallel``, ``snapshot``, ``sizes``: what the families share.

Code outside ``lean/models/`` reads spec fields and never probes a family with ``getattr``/``hasattr``. Family
packages import no diffusers at import time (config validation reads their specs); the component classes are
imported when a model is built. Adding a family is one new package plus one :data:`FAMILIES` line. The names below
are the package's face for notebooks and tests; lean's own modules import from the job modules.
"""

from __future__ import annotations

from lean.models.build import build_policy
from lean.models.checks import EDIT_PROMPTS, pipeline_family
from lean.models.footprint import count_parameters
from lean.models.policy import Guidance, Policy
from lean.models.registry import FAMILIES, LORA_INITS, family_spec
from lean.models.scheduler import build_scheduler, terminal_stretch, time_shift
from lean.models.spec import FamilySpec
from lean.models.text import PromptEmbeds

__all__ = [
    "EDIT_PROMPTS",
    "FAMILIES",
    "LORA_INITS",
    "FamilySpec",
    "Guidance",
    "Policy",
    "PromptEmbeds",
    "build_policy",
    "build_scheduler",
    "count_parameters",
    "family_spec",
    "pipeline_family",
    "terminal_stretch",
    "time_shift",
]
