"""``lean bench ablation``: LeanGRPO's Table 1 rows (native, + shared layout, + coalesced sync, Retain, Reweight) on
real gloo processes, and its refusals in one line before any model is built."""

from __future__ import annotations

import json

import pytest
from helpers import lean_ranks

TINY = ["model.size=tiny", "model.resolution=32", "train.prompts_per_iteration=2", "train.group_size=4"]
TINY += ["sample.num_steps=4", "train.dist_timeout_s=60"]


def _sets(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


@pytest.mark.timeout(300)
def test_the_ablation_rows_of_a_sharded_full_fine_tune_on_two_processes(tmp_path):
    """Under FSDP2 full fine-tuning: native runs the group layout and reduce-scatters after every backward, the shared
    rows hold each prompt's samples across the ranks, and a per_update row reduce-scatters each unit once per update
    (Reweight as few times as coalesced Recompute); each row's speedup is over native in the same rounds, the Lean
    rows carry the recompute bound, and every row Table 1's speedup for the full fine-tune."""
    from lean.tools.bench.ablation import PAPER

    sets = [*TINY, "model.full_finetune=true", "parallel.shard=fsdp"]
    lean_ranks(2, "bench", "ablation", *_sets(sets), "--repeats", "1", "--warmup", "0", "--out", str(tmp_path))
    report = json.loads((tmp_path / "ablation.json").read_text())
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == ["native", "shared", "shared_coalesced", "retain", "reweight"]
    assert report["config"]["mode"] == "full_finetune" and report["config"]["world_size"] == 2
    assert rows["native"]["layout"] == "group" and {rows[r]["layout"] for r in list(rows)[1:]} == {"shared"}
    scatters = {name: r["comm_reduce_scatter_count"] for name, r in rows.items()}
    units = scatters["shared_coalesced"]
    assert units >= 3 and scatters["reweight"] == units  # one per sharded unit per update
    assert scatters["native"] > units and scatters["shared"] > units  # after every backward
    assert rows["native"]["speedup"] == 1.0 and "speedup_bound" not in rows["native"]
    assert rows["retain"]["speedup_bound"] > 1 and rows["reweight"]["time_recompute_forward_s"] == 0
    paper = PAPER["full_finetune"]
    assert rows["reweight"]["paper_speedup"] == pytest.approx(paper["native"] / paper["reweight"])  # 1.81x
    assert all(r["peak_memory_mb"] > 0 and 0 <= r["sync_share"] < 1 for r in rows.values())


def test_the_ablation_is_refused_on_one_process_and_for_a_recipe(capsys, tmp_path):
    """One data-parallel process has no layout or sync to compare; a recipe of several updates per rollout is not the
    paper's one-update setting: both refused in one line that names the fix."""
    from lean.cli import main
    from lean.config import read_config
    from lean.tools.bench.ablation import ablation_problem

    assert main(["bench", "ablation", *_sets(TINY), "--out", str(tmp_path)]) == 2
    assert "lean launch -n 2" in capsys.readouterr().err
    assert not (tmp_path / "ablation.json").exists()
    recipe = read_config(None, [*TINY, "train.optimizer_steps_per_iteration=2"])
    assert ablation_problem(recipe, 2)[:2] == ("train.on_policy", False)
    assert ablation_problem(read_config(None, TINY), 2) is None
