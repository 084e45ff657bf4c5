"""Published recipes: ``lean/config/presets/<name>.yaml``, applied by ``--preset NAME`` on top of ``params.yaml``.

Every value in a preset cites the file and line of the published training code it comes from.
"""

from __future__ import annotations

from pathlib import Path

from lean.config.registry import Registry

PRESET_DIR = Path(__file__).parent
PRESETS: Registry[Path] = Registry("preset", ((p.stem, p) for p in sorted(PRESET_DIR.glob("*.yaml"))))
