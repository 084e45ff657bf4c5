"""The train stage's runs side by side: at most ``jobs`` at once, each logged, a failure stops the others."""

from __future__ import annotations

import sys
import time

import pytest

from lean.workbench.side_by_side import RunFailed, run_side_by_side


def script(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.timeout(60)
def test_runs_side_by_side_and_logs_each(tmp_path):
    # each run sleeps 1 s: three of them at 3 at once take about 1 s, not 3
    commands = {n: script(f"import time; time.sleep(1); print('run {n}')") for n in ("a", "b", "c")}
    logs = {n: tmp_path / n / "train.log" for n in commands}
    start = time.perf_counter()
    seconds = run_side_by_side(commands, logs, jobs=3)
    assert time.perf_counter() - start < 2.5 and set(seconds) == {"a", "b", "c"}
    assert [logs[n].read_text().strip() for n in "abc"] == ["run a", "run b", "run c"]


@pytest.mark.timeout(60)
def test_a_failure_stops_the_others_and_shows_its_log(tmp_path):
    commands = {
        "slow": script("import time; time.sleep(30)"),
        "bad": script("import sys; print('the reason'); sys.exit(3)"),
    }
    logs = {n: tmp_path / f"{n}.log" for n in commands}
    start = time.perf_counter()
    with pytest.raises(RunFailed, match=r"bad exited with status 3(.|\n)*the reason"):
        run_side_by_side(commands, logs, jobs=2)
    assert time.perf_counter() - start < 20  # the slow one was terminated, not waited for
    with pytest.raises(ValueError):
        run_side_by_side(commands, logs, jobs=0)
