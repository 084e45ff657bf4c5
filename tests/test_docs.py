"""The README fits on a screen and the user guide under docs/ holds together: every relative link in README.md and
docs/*.md names a file that exists and, for ``file.md#anchor``, a heading of that file (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks, with inline code spans blanked."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(INLINE_CODE.sub(lambda m: "`" + "x" * (len(m.group(0)) - 2) + "`", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lowercased, punctuation other than hyphens and
    underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The text of the file's ATX headings outside fenced code blocks (a ``# comment`` in a bash block is none)."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            out.append(m.group(2))
    return out


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    return [m.group(1) for line in prose_lines(path) for m in LINK.finditer(line)]


def test_slug_follows_github():
    assert slug("The workbench: `dvc repro`, MLflow, notebooks") == "the-workbench-dvc-repro-mlflow-notebooks"
    assert slug("Coming from FlowGRPO / DanceGRPO") == "coming-from-flowgrpo--dancegrpo"
    assert slug("The pipeline (`dvc.yaml`, `dvc dag`)") == "the-pipeline-dvcyaml-dvc-dag"
    assert slug("Using `train.shard_size`") == "using-trainshard_size"


def test_readme_fits_on_a_screen():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail to a page under docs/"


def test_readme_links_every_page():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in links(README) if not t.startswith("#")}
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_flashoverlap_names_the_published_designs_it_is_and_is_not():
    """The name FlashOverlap is also a published GEMM + AllReduce system (arXiv 2504.19519); lean's decomposed P2P
    design is CommFuse's kind (arXiv 2604.24013): the page on it cites both, and the parallelism guide points there."""
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    section = results[results.index("## FlashOverlap") :]
    assert "arXiv 2504.19519" in section and "arXiv 2604.24013" in section and "CommFuse" in section
    parallelism = (ROOT / "docs" / "parallelism.md").read_text(encoding="utf-8")
    assert "2504.19519" in parallelism and "2604.24013" in parallelism


def test_the_readme_quotes_the_plan_the_docs_show():
    """README's row for DanceGRPO's FLUX LoRA plan and the guide's reading of it quote the table docs/parallelism.md
    shows (the group layout, sharded, checkpointed as the preset runs); test_layout checks that table against what
    `lean plan` prints now. One source: a changed plan fails here until both are updated."""
    from helpers import documented_plan_rows

    rows = documented_plan_rows()

    def row(schedule: str, ckpt: str, m: str = "-", offload: str = "-") -> dict[str, str]:
        wanted = {"schedule": schedule, "layout": "group", "shard": "fsdp", "ckpt": ckpt, "m": m, "offload": offload}
        return next(r for r in rows if wanted.items() <= r.items())

    # the preset's own Recompute (checkpointed) against the fastest row: Reweight, which fits without checkpointing
    recompute, reweight, retain = row("recompute", "on"), row("reweight", "off"), row("retain", "on", "all", "device")
    speed = float(recompute["time"]) / float(reweight["time"])
    quoted = next(
        line for line in README.read_text(encoding="utf-8").splitlines() if "DanceGRPO's FLUX LoRA run" in line
    )
    assert (
        f"Recompute {recompute['peak']} GiB" in quoted and f"Reweight {reweight['peak']} GiB at {speed:.2f}x" in quoted
    )
    assert f"{retain['peak']} GiB" in quoted and retain["fits"] == "no"
    guide = (ROOT / "docs" / "parallelism.md").read_text(encoding="utf-8")
    assert f"Recompute needs {recompute['peak']} GiB" in guide
    assert f"fits at {reweight['peak']} GiB for {reweight['time']} s, the fastest row" in " ".join(guide.split())
