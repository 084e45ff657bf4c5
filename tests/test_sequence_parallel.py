"""Sequence parallelism (``parallel.sequence_parallel``): the sharded transformer equals the whole one, and training
under it ends with the weights of one process (float64, 1e-10).

Unit level, on real gloo processes: a policy's velocity and its LoRA (or full fine-tune) gradients, the forward and
backward of every overlap method, against the same policy unsharded in the same process. Training level: ``lean
train`` with ``sequence_parallel`` on the ranks ``lean launch`` would start (``helpers.lean_ranks``; 2 ranks = 1
group; 4 ranks = 2 data-parallel x 2 sequence parallel) against ``lean train`` on one process, for each schedule.
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import lean_here, lean_ranks, spawn, tiny
from safetensors.torch import load_file

from lean.config import ConfigError
from lean.configure import validate
from lean.models import build_policy, family_spec
from lean.models.options import ModelConfig
from lean.models.sequence_parallel import enable, sequence_problem
from lean.parallel.overlap.p2p import METHODS, Overlap
from lean.parallel.overlap.sequence import gather_tokens, heads_to_seq, seq_to_heads, split_tokens

TOLERANCE = 1e-10
PROMPTS = ["a red cube", "a blue ball"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _wide_heads(family: str, heads: int) -> str:
    """A tiny size with ``heads`` heads of the same width (so 4 ranks can split them); returns its name."""
    sizes = family_spec(family).sizes
    name = f"tiny{heads}h"
    if name not in sizes:
        size = copy.deepcopy(sizes["tiny"])
        t = size.transformer
        t["attention_head_dim"] = t["attention_head_dim"] * t["num_attention_heads"] // heads
        t["num_attention_heads"] = heads
        if "axes_dims_rope" in t:  # FLUX: the rotary axes must add up to the head width
            t["axes_dims_rope"] = [t["attention_head_dim"] - 2 * (t["attention_head_dim"] // 4 // 2 * 2)] + [
                t["attention_head_dim"] // 4 // 2 * 2
            ] * 2
        sizes[name] = size  # this process only (each worker adds it)
    return name


def _velocity_and_grads(policy, x, sigma, emb, weights):
    policy.zero_grad(set_to_none=True)
    v = policy.velocity(x, sigma, emb)
    (v * weights).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for _, p in policy.trainable_parameters()])
    return v.detach(), grads


def _policy_worker(rank: int, world: int, port: int, family: str, full_finetune: bool, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        size = _wide_heads(family, 4) if world == 4 else "tiny"
        model = ModelConfig(family=family, size=size, dtype="float64", full_finetune=full_finetune, lora_ffn=True)
        policy = build_policy(model, PROMPTS)
        if not full_finetune:
            policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))  # B = 0 would hide the LoRA terms
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, *policy.latent_shape(), generator=g, dtype=torch.float64)
        sigma = torch.tensor([0.7, 0.3], dtype=torch.float64)
        emb = policy.encode_prompts(PROMPTS)
        weights = torch.randn(x.shape, generator=g, dtype=torch.float64)
        v_ref, g_ref = _velocity_and_grads(policy, x, sigma, emb, weights)
        sp = enable(policy.networks(), policy.runtime, Overlap(METHODS[0]))
        result = {}
        for method in METHODS:
            sp.ov = Overlap(method)
            v, grads = _velocity_and_grads(policy, x, sigma, emb, weights)
            dist.all_reduce(grads)  # each rank's gradient is its share's (lean.parallel.overlap.sequence)
            with torch.no_grad(), policy.reference():
                ref_v = policy.velocity(x, sigma, emb)
            result[method] = {"velocity": _rel(v, v_ref), "grads": _rel(grads, g_ref), "ref_norm": ref_v.norm().item()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _ops_worker(rank: int, world: int, port: int, out: str) -> None:
    """The token ops alone: split / gather and the Ulysses all-to-alls, forward and backward, every method."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        g = torch.Generator().manual_seed(0)
        full = torch.randn(3, 4 * world, 2 * world, 5, generator=g, dtype=torch.float64)  # (B, S, H, hd)
        result = {}
        for method in METHODS:
            ov = Overlap(method)
            x = split_tokens(full, 1, ov).transpose(0, 1).requires_grad_()  # (s, B, H, hd)
            heads = seq_to_heads(x, 2, ov)  # (S, B, H/P, hd)
            mine = full.transpose(0, 1).unflatten(2, (world, -1))[:, :, rank]
            back = heads_to_seq(heads * 2, 2, ov)
            y = gather_tokens(back.transpose(0, 1), 1, ov)
            (y.square().sum() / 4).backward()  # d/dx of (2x)^2 / 4 = 2x: the share of this rank's rows
            result[method] = [
                _rel(heads, mine),
                _rel(y, 2 * full),
                _rel(x.grad, 2 * x.detach()),
            ]
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _results(folder: Path, world: int) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.matrix)])
def test_token_ops_are_exact_in_every_method(world, tmp_path):
    spawn(_ops_worker, world, str(tmp_path), deadline_s=100)
    for rank, result in enumerate(_results(tmp_path, world)):
        for method, errors in result.items():
            assert max(errors) < 1e-14, (rank, method, errors)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "family,world,full_finetune",
    [("wan", 2, False), ("flux", 4, False), ("wan", 4, True)],  # LoRA (its fused low-rank path); full fine-tune
)
def test_sharded_velocity_and_gradients_equal_one_process(family, world, full_finetune, tmp_path):
    spawn(_policy_worker, world, family, full_finetune, str(tmp_path), deadline_s=280)
    for rank, result in enumerate(_results(tmp_path, world)):
        for method, errors in result.items():
            assert errors["velocity"] < TOLERANCE and errors["grads"] < TOLERANCE, (rank, method, errors)


SMALL = ["train.prompts_per_iteration=2", "train.group_size=2", "sample.num_steps=4", "train.dist_timeout_s=60"]
SMALL += ["model.dtype=float64", "algorithm.beta=0.04", "train.iterations=2", "optimizer.lr=1e-3"]


def _train(out: Path, values: list[str], processes: int = 1) -> dict[str, torch.Tensor]:
    sets = [arg for value in values for arg in ("--set", value)]
    if processes == 1:
        lean_here("train", *sets, "--out", str(out))
    else:
        lean_ranks(processes, "train", *sets, "--out", str(out))
    # the weights, and the last rollout's x_T and rewards (decoded and scored in shares: parallel.split_decode)
    return {**load_file(out / "lora.safetensors"), **load_file(out / "rollout.safetensors")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """``lean train`` on one process, per (family, schedule, extra settings), trained once for the module."""
    runs: dict[tuple, dict[str, torch.Tensor]] = {}

    def run(family: str, schedule: str, extra: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        if (family, schedule, extra) not in runs:
            out = tmp_path_factory.mktemp(f"{family}-{schedule}")
            values = [*SMALL, f"model.family={family}", f"train.schedule={schedule}", *extra]
            runs[family, schedule, extra] = _train(out, values)
        return runs[family, schedule, extra]

    return run


FSDP = ("parallel.shard=fsdp",)
FULL = ("model.full_finetune=true",)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "family,processes,schedule,method,extra",
    [  # every schedule, every method and every family with SP once; 4 processes = 2 data-parallel x 2 sequence-
        # parallel. Retain finishes in the group layout (its backward beside the scoring) and Reweight batches: both
        # capture per-trajectory gradients through the fused projections (lean.models.sequence_parallel.linear_slice)
        ("wan", 2, "reweight", "sliced", ()),
        ("flux", 2, "recompute", "flash", ()),
        ("wan22_ti2v", 2, "retain", "flash", ()),  # the per-token timestep embeddings split with the tokens
        ("kontext", 2, "reweight", "collective", ()),  # an edit: its reference tokens split with the noisy ones
        # FSDP x SP on the ("dp", "sp") mesh: the base sharded over the 2 data-parallel ranks, tokens over the 2 of
        # each group; a full fine-tune's shards summed over the group after FSDP's reduce-scatter; the expert pair
        ("wan", 4, "reweight", "flash", FSDP),
        ("wan", 4, "retain", "collective", (*FSDP, *FULL)),
        ("wan22", 4, "recompute", "flash", FSDP),
    ],
)
def test_training_under_sequence_parallelism_ends_with_the_weights_of_one_process(
    family, processes, schedule, method, extra, one_process, tmp_path
):
    """Two iterations (AdamW, KL) of ``lean train --set parallel.sequence_parallel=2`` on P ranks (with ``extra``):
    the same weights, final latents and rewards as ``lean train`` on one process (float64, 1e-10 relative); each
    process of a group decoded and scored its share of the samples (``parallel.split_decode``)."""
    sp = ["parallel.sequence_parallel=2", f"parallel.overlap={method}"]
    shared = [*SMALL, f"model.family={family}", f"train.schedule={schedule}"]
    sharded = _train(tmp_path, [*shared, *sp, *extra], processes)
    reference = one_process(family, schedule, tuple(v for v in extra if v not in FSDP))
    assert sharded.keys() == reference.keys() and len(reference) > 4
    assert max(_rel(sharded[k], reference[k]) for k in reference) < TOLERANCE


@pytest.mark.parametrize(
    "overrides,world_size,key,words",
    [
        (
            ["model.family=sd3", "parallel.sequence_parallel=2"],
            2,
            "parallel.sequence_parallel",
            "no sequence parallelism",
        ),
        (["model.family=wan", "parallel.sequence_parallel=2"], 3, "parallel.sequence_parallel", "must divide the 3"),
        (
            ["model.family=wan", "parallel.sequence_parallel=2"],
            2 * 16 + 2,
            "train.prompts_per_iteration",
            "data-parallel",
        ),
        (["model.family=wan", "parallel.overlap=ring"], 1, "parallel.overlap", "collective, sliced, flash"),
    ],
)
def test_what_sequence_parallelism_cannot_run_is_one_config_line(overrides, world_size, key, words):
    with pytest.raises(ConfigError) as err:
        validate(tiny(*overrides), world_size=world_size)
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_heads_and_tokens_must_divide():
    policy = build_policy(ModelConfig(family="wan"), PROMPTS)  # 2 heads, 32 video tokens
    assert sequence_problem(policy, 2) is None
    assert "2 heads" in sequence_problem(policy, 4) and "tokens" not in sequence_problem(policy, 4)
    assert "32 image/video tokens" in sequence_problem(policy, 3)
