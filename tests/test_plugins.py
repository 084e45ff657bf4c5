"""Extending lean from outside ``lean/``: a package installed beside it adds an algorithm (with its own options), a
model family and a reward through entry points, and ``lean train`` and the float64 certificate run them; a module on
``PYTHONPATH`` named in the config's ``plugins:`` list does the same without being installed (docs/architecture.md,
"Extending lean")."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import FAST

from lean.config import ConfigError, options_type, plugins
from lean.config.sections import OPTIONS
from lean.configure import load_config
from lean.rewards import REWARDS

ROOT = Path(__file__).resolve().parents[1]

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "lean-plugin-demo"
version = "0.1"

[tool.setuptools]
packages = ["lean_plugin_demo", "lean_plugin_demo.demo_flux"]

[project.entry-points."lean.algorithms"]
scaled_grpo = "lean_plugin_demo.scaled_grpo"

[project.entry-points."lean.families"]
demo_flux = "lean_plugin_demo.demo_flux"

[project.entry-points."lean.rewards"]
brightness = "lean_plugin_demo.brightness"
"""

# (a) GRPO with its clipped surrogate scaled by s > 0: loss = s max(-A r, -A clip(r, 1 - c, 1 + c)). Still linear in
# A, and the ratio is identically 1 on-policy: GRPO's facts, so Retain and Reweight stay exact.
ALGORITHM = """
from dataclasses import dataclass

from lean.algorithms import ALGORITHMS
from lean.algorithms.base import LINEAR_IN_TARGET, RATIO_ONE_ON_POLICY
from lean.algorithms.grpo import GRPO
from lean.config import check_positive, register_options


@register_options("algorithm.scaled_grpo")
@dataclass
class ScaledGRPOConfig:
    scale: float = 2.0

    def validate(self, prefix):
        check_positive(f"{prefix}.scale", self.scale)


@ALGORITHMS.register("scaled_grpo")
class ScaledGRPO(GRPO):
    facts = frozenset({RATIO_ONE_ON_POLICY, LINEAR_IN_TARGET})

    def policy_term(self, ratio, targets):
        return self.cfg.scaled_grpo.scale * super().policy_term(ratio, targets)
"""

# (b) a family that is FLUX under another name: FLUX's runtime and components, its own display name.
FAMILY = """
import dataclasses

from lean.models import FAMILIES
from lean.models.flux import SPEC as FLUX

SPEC = FAMILIES.register("demo_flux")(dataclasses.replace(FLUX, display_name="Demo FLUX"))
"""

# (c) the mean luminance of the image (Rec. 601 weights), in [0, 1].
REWARD = """
import torch

from lean.rewards import register


@register("brightness")
def brightness(images, prompts):
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=images.dtype, device=images.device)
    return torch.einsum("bchw,c->b", images, weights) / (images.shape[-1] * images.shape[-2])
"""


def write_package(folder: Path) -> Path:
    package = folder / "lean_plugin_demo"
    (package / "demo_flux").mkdir(parents=True)
    (folder / "pyproject.toml").write_text(PYPROJECT)
    (package / "__init__.py").write_text("")
    for path, text in (("scaled_grpo.py", ALGORITHM), ("demo_flux/__init__.py", FAMILY), ("brightness.py", REWARD)):
        (package / path).write_text(textwrap.dedent(text))
    return folder


# `lean <args>` of each command in turn, in one fresh process: the plugin is found through its entry points there,
# and the imports (seconds of CPU) are paid once
RUN_COMMANDS = """
import json, sys
from lean.cli import main
for args in json.loads(sys.argv[1]):
    if code := main(args):
        sys.exit(f"lean {args[0]} exited with {code}")
"""


def lean(site: Path, cwd: Path, *commands: list[str]) -> str:
    """Runs the ``commands`` (each the arguments of one ``lean`` call) in one new Python process that sees the
    package installed in ``site``; returns its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    cmd = [sys.executable, "-c", RUN_COMMANDS, json.dumps(list(commands))]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


PLUGIN_SETS = [
    "algorithm.name=scaled_grpo",
    "algorithm.scaled_grpo.scale=3.0",
    "model.family=demo_flux",
    "reward.weights={brightness: 1.0}",
]


@pytest.mark.timeout(300)  # about 30 s of CPU: pip, one process: a one-iteration lean train, the float64 certificate
def test_an_installed_plugin_trains_and_passes_the_certificate(tmp_path):
    """pip installs the demo package; in a new process its entry points register the algorithm (with its options),
    the family and the reward, and `lean train` and then `lean equivalence` (float64) run them and pass."""
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    subprocess.run([*pip, "--target", str(site), str(write_package(tmp_path / "src"))], check=True, timeout=120)
    sets = [arg for value in [*FAST, *PLUGIN_SETS] for arg in ("--set", value)]

    train = ["train", *sets, "--out", str(tmp_path / "train")]
    equivalence = ["equivalence", *sets, "--set", "model.dtype=float64", "--out", str(tmp_path / "eq")]
    out = lean(site, tmp_path, train, equivalence)
    config = json.loads((tmp_path / "train" / "config.json").read_text())
    assert config["algorithm"]["name"] == "scaled_grpo" and config["algorithm"]["scaled_grpo"] == {"scale": 3.0}
    assert config["model"]["family"] == "demo_flux" and config["reward"]["weights"] == {"brightness": 1.0}

    report = json.loads((tmp_path / "eq" / "equivalence.json").read_text())
    assert report["passes"] and {"retain", "reweight"} <= set(report) and out.strip().endswith("PASS")
    assert report["algorithm"] == "scaled_grpo"


LOCAL_PLUGIN = """
from dataclasses import dataclass

from lean.config import register_options
from lean.rewards import register


@register_options("reward.demo_contrast")
@dataclass
class ContrastOptions:
    floor: float = 0.0

    def validate(self, prefix):
        pass


@register("demo_contrast")
def contrast(images, prompts):
    return images.flatten(1).std(dim=1)
"""


@pytest.fixture
def local_plugin(tmp_path, monkeypatch):
    """``demo_contrast_plugin``, a module on ``sys.path`` only; its registrations are undone afterwards."""
    (tmp_path / "demo_contrast_plugin.py").write_text(textwrap.dedent(LOCAL_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "demo_contrast_plugin"
    OPTIONS.pop("reward.demo_contrast", None)
    REWARDS.pop("demo_contrast", None)
    sys.modules.pop("demo_contrast_plugin", None)


def test_the_plugins_list_imports_a_module_and_its_options_nest(local_plugin):
    cfg = load_config(
        None,
        [*FAST, f"plugins=[{local_plugin}]", "reward.weights={demo_contrast: 1.0}", "reward.demo_contrast.floor=1"],
    )
    assert cfg.reward.demo_contrast.floor == 1.0 and cfg.to_dict()["reward"]["demo_contrast"] == {"floor": 1.0}
    assert pickle.loads(pickle.dumps(cfg)) == cfg and type(pickle.loads(pickle.dumps(cfg))) is type(cfg)
    with pytest.raises(ConfigError, match=r"reward\.demo_contrast\.flor.*did you mean 'floor'"):
        load_config(None, [f"plugins=[{local_plugin}]", "reward.demo_contrast.flor=1"])
    OPTIONS.pop("reward.demo_contrast")
    assert "demo_contrast" not in {f for f in options_type("reward").__dataclass_fields__}


def test_a_plugin_that_fails_to_import_is_one_line():
    with pytest.raises(ConfigError, match=r"^config error: plugins='no_such_plugin_module': failed to import: Module"):
        load_config(None, ["plugins=[no_such_plugin_module]"])
    with pytest.raises(ConfigError, match="must be a list of module names"):
        load_config(None, ["plugins=one_module"])


def test_an_entry_point_that_fails_to_import_is_one_line(monkeypatch):
    broken = importlib.metadata.EntryPoint("broken", "no_such_plugin_module", "lean.rewards")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [broken] if group == "lean.rewards" else [])
    plugins.load_entry_points.cache_clear()
    try:
        with pytest.raises(
            ConfigError, match=r"^config error: entry point lean.rewards:broken='no_such_plugin_module': "
        ):
            load_config(None, [])
    finally:
        plugins.load_entry_points.cache_clear()
