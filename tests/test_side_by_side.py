"""The train stage's runs side by side: at most ``jobs`` at once (commands or forked functions), each logged, a failure
stops the others."""

from __future__ import annotations

import os
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


@pytest.mark.timeout(60)
def test_functions_run_in_forked_children_beside_commands(tmp_path):
    """A function runs in a forked child (it sees the parent's modules and state without importing them), with its
    output in its log; a SystemExit's status and an exception's traceback reach the parent as a command's would."""
    parent = os.getpid()
    inherited = {"state": "set before the fork"}
    commands = {
        "forked": lambda: print(f"child of the parent: {os.getppid() == parent}; {inherited['state']}"),
        "command": script("print('a new interpreter')"),
    }
    logs = {n: tmp_path / f"{n}.log" for n in commands}
    assert set(run_side_by_side(commands, logs, jobs=2)) == {"forked", "command"}
    assert logs["forked"].read_text().strip() == "child of the parent: True; set before the fork"
    assert logs["command"].read_text().strip() == "a new interpreter"

    def fails():
        print("about to fail")
        raise ValueError("the reason")

    with pytest.raises(RunFailed, match=r"bad exited with status 1(.|\n)*about to fail(.|\n)*ValueError: the reason"):
        run_side_by_side({"bad": fails}, {"bad": tmp_path / "bad.log"}, jobs=1)
    with pytest.raises(RunFailed, match="exit exited with status 4"):
        run_side_by_side({"exit": lambda: sys.exit(4)}, {"exit": tmp_path / "exit.log"}, jobs=1)
