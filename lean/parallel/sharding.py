"""Sharding the policy over processes with FSDP2 (``torch.distributed.fsdp.fully_shard``): ``parallel.shard``.

    none    every process holds the whole policy (data parallel; the trained weights' gradients are all-reduced
            once per update by ``lean.run.optimizer.TrainState``).
    fsdp    every transformer block, then the transformer itself (and, under full fine-tuning, its frozen reference
            copy), is a ``fully_shard`` unit over every process (the run's 2-D mesh ("dp", "sp") flattened,
            ``lean.parallel.distributed.device_mesh``): each process keeps 1/W of the weights and gathers a block's full
            weights just before the block runs (forward, and again in the backward), freeing them after. Which
            weights, gradients and optimizer states are sharded:

            LoRA            the frozen base is sharded; the adapter (``ignored_params``) stays whole on every process,
                            so every schedule, Reweight's per-trajectory buffers included, is unchanged and the
                            adapter's gradient is all-reduced once per update as with ``none``.
            full fine-tune  weights, gradients and AdamW state are sharded (DTensors). FSDP reduce-scatters each
                            backward's gradient into the shards (averaged over the data-parallel ranks), so the
                            update's gradient is the ``none`` one; ``TrainState`` then clips and steps the shards.
                            In half precision the float32 masters are the shards and FSDP's
                            ``MixedPrecisionPolicy`` gathers them at ``model.dtype`` (the cast ``Policy`` does itself
                            without FSDP).

The VAE and text encoders stay whole: each process decodes and encodes its own samples, a different number of times.

Lockstep. Every sharded forward and backward gathers weights collectively, so every process must run the same
passes in the same order. The rollout does (same local batch size); for the backwards the processes track the same
steps (``StepSelection.shared_grad_steps``: the union over every process's samples, computed locally from the
seeds), Reweight backpropagates every tracked micro-batch (a zero weight where no local sample trains the step), and
the evaluation pads its shares to the same number of batches. Reweight under a sharded full fine-tune is refused: its
per-trajectory buffers are gradients of the whole unsharded model per trajectory.

FSDP x sequence parallelism (``parallel.sequence_parallel: P``, W = D x P processes): the processes of a
sequence-parallel group hold the same samples and run the same passes on their shares of the tokens, so every process
still runs every pass in lockstep and the weights shard over all W, not only over the D data-parallel ranks: 1/W of
a replica each at the same gathered bytes per pass (torchtitan shards over its data x context-parallel mesh alike). A
weight's gradient is the sum of the group's token shares averaged over the data-parallel ranks: the adapter's is
all-reduced so as without FSDP (``World.reduce_gradients_``); a sharded full fine-tune's reduce-scatter averages over
all W processes, and ``TrainState`` multiplies its shards by P (FSDP's own ``set_gradient_divide_factor`` would
pre-multiply with ``PREMUL_SUM``, which gloo has not).

With one process there is nothing to shard over, and ``fsdp`` is ``none``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from lean.config.registry import Registry

SHARDS: Registry[str] = Registry(
    "shard",
    [
        ("none", "every process holds the whole policy"),
        (
            "fsdp",
            "FSDP2: transformer blocks sharded over the processes (frozen base; under full fine-tuning also the "
            "trained weights, gradients and AdamW state)",
        ),
        (
            "hsdp",
            "FSDP2 on a (replicate across nodes x shard within a node) mesh: sharded as fsdp inside each node, "
            "replicated across parallel.replicas nodes (the gradients reduce-scattered in a node, all-reduced across)",
        ),
    ],
)
FSDP, HSDP = "fsdp", "hsdp"
SHARDING = (FSDP, HSDP)  # the settings under which FSDP2 shards the policy
HSDP_DIMS = ("replicate", "shard")  # hsdp's mesh: nodes x processes of a node


def shards(shard: str) -> bool:
    """Whether ``parallel.shard=shard`` shards the policy with FSDP2 (fsdp, hsdp)."""
    return shard in SHARDING


def node_count() -> int:
    """The launch's nodes: processes / processes per node (torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE; 1 unknown)."""
    import os

    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    return world // local if local and world % local == 0 else 1


def replica_count(replicas: int | None) -> int:
    """``parallel.replicas``, or the launch's nodes (:func:`node_count`) when None."""
    return replicas or node_count()


def effective_shard(shard: str, world_size: int) -> str:
    """What ``parallel.shard=shard`` does with ``world_size`` processes: fsdp and hsdp need two (with one, nothing
    to shard)."""
    return shard if world_size > 1 else SHARDS.default


def planned_shard(shard: str, world_size: int) -> str:
    """The ``parallel.shard`` row ``lean plan`` and the benchmarks model for ``shard`` (:func:`effective_shard`;
    hsdp as fsdp: the plan does not model the sharding within a node yet, so an hsdp run's figures are fsdp's over
    every process)."""
    shard = effective_shard(shard, world_size)
    return FSDP if shard == HSDP else shard


def shard_units(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's blocks, in order: every module of the ``ModuleList`` children of the model (FLUX's double-
    and single-stream blocks, SD3's and Wan's blocks), whatever the family calls them."""
    return [block for child in net.children() if isinstance(child, torch.nn.ModuleList) for block in child]


def shard_policy(policy, world, dtype: torch.dtype, replicas: int = 1) -> bool:
    """``fully_shard`` each of the policy's denoisers (and reference copies) over ``world``'s processes, blocks
    first, as described in the module docstring; with ``replicas`` > 1 (hsdp) on a (replicate x shard) mesh: sharded
    within each of ``replicas`` groups of consecutive processes (a node), replicated across them. Returns whether
    anything was sharded (not with one process)."""
    if world.size < 2:
        return False
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lean.parallel.distributed import device_mesh

    # diffusers' blocks return chunks of one tensor (views); FSDP warns that an in-place op on one would skip its
    # backward gather. No code in the forward writes into a block's output, and the float64 certificate on sharded
    # processes (tests/test_sharding.py) would see a skipped gather, so the warning says nothing here.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = device_mesh(world)._flatten("dp_sp")  # every process its own shard, sequence-parallel groups included
    if replicas > 1:  # HSDP: FSDP2 reduce-scatters within a node and all-reduces across the nodes
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(world.device.type, (replicas, world.size // replicas), mesh_dim_names=HSDP_DIMS)
    adapter = None if policy.full_finetune else {p for _, p in policy.trainable_parameters()}
    mixed = MixedPrecisionPolicy()
    if policy.full_finetune and policy.drop_master_casts():  # half precision: FSDP gathers the masters at dtype
        mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    units = [(net, mixed) for net in policy.denoisers]
    units += [(net, MixedPrecisionPolicy()) for net in policy.reference_denoisers or []]
    for net, mp in units:
        base = net.get_base_model() if hasattr(net, "get_base_model") else net
        # Every unit, the root too (FSDP's default keeps the root's gathered weights after a forward), frees its
        # gathered weights after each pass: no gathered copy outlives a pass, so weights written between passes
        # (the EMA swapped in for an evaluation, a restored state) are what the next pass gathers.
        for unit in (*shard_units(base), base):
            fully_shard(
                unit, mesh=mesh, mp_policy=mp, reshard_after_forward=True, ignored_params=_inside(unit, adapter)
            )
    return True


@dataclass(frozen=True)
class ShardSizes:
    """What sharding moves, in MiB (``lean.plan.cost`` turns a probe of one ``parallel.shard`` into the other's
    figures).

    * weights: the weights FSDP shards (LoRA: the frozen base; full fine-tuning: the trained transformer and its
      reference copy); net: those of the one net a pass runs (what each pass gathers);
    * state: the trained weights' gradients and two AdamW moments, sharded under full fine-tuning (0 with LoRA, whose
      adapter stays whole);
    * unit: the largest unit's gathered weights; gathered: what a process holds gathered at once: the running unit
      and the prefetched next one, and under full fine-tuning one unit's unsharded gradient before its
      reduce-scatter.
    """

    weights: float
    net: float
    state: float
    unit: float
    gathered: float

    def resident_saved(self, world_size: int) -> float:
        """MiB a process holds less under fsdp than with the whole policy (negative: more) through the iteration: the
        weights and the moments (the gradients live from the backward to the optimizer step: :meth:`gradient_saved`)."""
        return (self.weights + 2 / 3 * self.state) * (1 - 1 / world_size) - self.gathered

    def gradient_saved(self, world_size: int) -> float:
        """MiB of gradients a process holds less under fsdp (reduce-scattered into its shard)."""
        return self.state / 3 * (1 - 1 / world_size)


def shard_sizes(policy) -> ShardSizes:
    """:class:`ShardSizes` of ``policy`` (whole or already sharded: a DTensor counts its global size)."""
    adapter = set() if policy.full_finetune else {p for _, p in policy.trainable_parameters()}

    def mb(params) -> float:
        return sum(p.numel() * p.element_size() for p in params if p not in adapter) / 2**20

    nets = policy.networks()
    base = [n.get_base_model() if hasattr(n, "get_base_model") else n for n in nets]
    unit = 0.0
    for net in base:  # each block, and the root (what is left of the net outside its blocks)
        blocks = [mb(u.parameters()) for u in shard_units(net)]
        unit = max(unit, *blocks, mb(net.parameters()) - sum(blocks))
    state = 3 * mb(p for _, p in policy.trainable_parameters()) if policy.full_finetune else 0.0
    weights = sum(mb(n.parameters()) for n in nets)
    net = max(mb(n.parameters()) for n in policy.denoisers)  # a pass runs one denoiser
    return ShardSizes(weights, net, state, unit, (3 if policy.full_finetune else 2) * unit)


def _inside(module: torch.nn.Module, params: set | None) -> set | None:
    return None if params is None else {p for p in module.parameters() if p in params}


def is_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor (a parameter, gradient or optimizer state FSDP shards)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered from every process (a collective: every process must call it in the
    same order), anything else as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) laid out as ``param``: this process's shard when ``param`` is a DTensor (sliced
    locally, no communication), else ``value`` on ``param``'s device."""
    if is_sharded(value) or not is_sharded(param):
        return value.to(param.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def local_mb(tensors) -> float:
    """MiB this process holds of ``tensors`` (a DTensor: its own shard)."""
    local = [t.to_local() if is_sharded(t) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local) / 2**20


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every sharded entry gathered (collective when anything is sharded)."""
    return {name: full(value) for name, value in module.state_dict().items()}


# ---------------------------------------------------------------- the accumulated gradient, synced once per update
# FSDP2 reduce-scatters each unit's gradient after each backward. With ``set_requires_gradient_sync(False)`` it keeps
# accumulating the unsharded gradient instead (its ``no_sync``), and its next synced backward would reduce-scatter the
# sum; lean syncs at the optimizer step instead, without a backward, one reduce-scatter per unit as FSDP2 does
# (``parallel.grad_sync=per_update``, lean.parallel.grad_sync). FSDP2 keeps that unsharded gradient on its own
# parameter records (``FSDPParam``, grouped per unit): :func:`param_groups` is the one place lean reads them.


def fsdp_modules(policy) -> list[torch.nn.Module]:
    """Every ``fully_shard`` unit of the policy's networks."""
    from torch.distributed.fsdp import FSDPModule

    return [m for net in policy.networks() for m in net.modules() if isinstance(m, FSDPModule)]


def param_groups(policy) -> list[list]:
    """FSDP2's parameter records of every unit (``FSDPParam``: the sharded parameter, the unsharded one and its
    accumulated gradient), one list per unit's parameter group."""
    return [
        group.fsdp_params for module in fsdp_modules(policy) for group in module._get_fsdp_state()._fsdp_param_groups
    ]


def set_gradient_sync(policy, enabled: bool) -> None:
    """FSDP2's gradient reduction after each backward, on or off for every unit."""
    for module in fsdp_modules(policy):
        module.set_requires_gradient_sync(enabled, recurse=False)


def take_unsharded_grad(fsdp_param) -> torch.Tensor | None:
    """The unsharded gradient FSDP2 accumulated for ``fsdp_param`` since its last reduction (None: none), handed
    over: FSDP2 holds none after it."""
    grad = fsdp_param.unsharded_accumulated_grad
    if grad is not None:  # a reduce dtype other than the parameter's (half-precision masters)
        fsdp_param.unsharded_accumulated_grad = None
        return grad
    if not hasattr(fsdp_param, "_unsharded_param") or fsdp_param.unsharded_param.grad is None:
        return None
    grad, fsdp_param.unsharded_param.grad = fsdp_param.unsharded_param.grad, None
    return grad


def reduce_scatter_to_shards(grads: list[torch.Tensor], sharded: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The whole gradients ``grads`` of every process (one dtype), summed over them and divided by their number as
    FSDP2 does, as this process's shards of the ``sharded`` parameters (DTensors of one mesh, laid out by
    ``fully_shard``: dim-0 chunks of ceil(rows / W), the last ones shorter or empty): one ``reduce_scatter_tensor``
    for them all, rank r's chunk of every parameter side by side in its block of the input (FSDP2's own layout)."""
    from torch.distributed.tensor import DTensor

    mesh = sharded[0].device_mesh
    world = mesh.size(-1)  # the shard dimension (hsdp: the processes of a node)
    chunks = []  # per parameter: [W, ceil(rows / W) x the other dims], zero-padded
    for g in grads:
        per = -(-g.shape[0] // world)
        padded = g.new_zeros((per * world, *g.shape[1:]))
        padded[: g.shape[0]] = g
        chunks.append(padded.view(world, -1))
    out = grads[0].new_empty(sum(c.shape[1] for c in chunks))
    torch.distributed.reduce_scatter_tensor(out, torch.cat(chunks, dim=1).reshape(-1), group=mesh.get_group(-1))
    if mesh.ndim > 1:  # hsdp: the shards summed across the replicas too
        torch.distributed.all_reduce(out, group=mesh.get_group(0))
    out.div_(mesh.size())
    shards = []
    for part, g, p in zip(out.split([c.shape[1] for c in chunks]), grads, sharded):
        local = part.view(-1, *g.shape[1:])[: p.to_local().shape[0]].to(p.dtype)
        shards.append(DTensor.from_local(local, mesh, p.placements, shape=p.shape, stride=p.stride()))
    return shards


def _reduce_scatter_units(policy, whole_grad) -> int:
    """Reduce-scatter ``whole_grad(fsdp_param)`` (this process's whole gradient of that parameter, or None: none)
    into each sharded parameter's ``.grad`` (added to what is there): one ``reduce_scatter_tensor`` per unit and
    dtype, as FSDP2 reduces a unit after a backward. Returns how many it ran."""
    collectives = 0
    for group in param_groups(policy):
        by_dtype: dict[torch.dtype, list] = {}
        for fsdp_param in group:
            if (grad := whole_grad(fsdp_param)) is not None:
                by_dtype.setdefault(grad.dtype, []).append((fsdp_param.sharded_param, grad))
        for pairs in by_dtype.values():
            params = [p for p, _ in pairs]
            for p, shard in zip(params, reduce_scatter_to_shards([g for _, g in pairs], params)):
                p.grad = shard if p.grad is None else p.grad + shard
            collectives += 1
    return collectives


def reduce_scatter_accumulated(policy) -> int:
    """Every unit's accumulated unsharded gradients (:func:`take_unsharded_grad`) reduce-scattered into their sharded
    parameters' ``.grad`` (:func:`_reduce_scatter_units`); returns how many collectives it ran."""
    return _reduce_scatter_units(policy, take_unsharded_grad)


def take_whole_grads(policy, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    """The unsharded gradients FSDP2 accumulated (its sync off) for the sharded ``params``, in their order, handed
    over (FSDP2 holds none after it): what a backward left of each parameter's whole gradient on this process."""
    taken = {id(fp.sharded_param): take_unsharded_grad(fp) for group in param_groups(policy) for fp in group}
    return [taken.get(id(p)) for p in params]


def reduce_scatter_whole(policy, params: list[torch.nn.Parameter], flat: torch.Tensor) -> int:
    """A whole gradient of the sharded ``params`` (``flat``, in their order) reduce-scattered into their ``.grad``
    (:func:`_reduce_scatter_units`); returns how many collectives it ran."""
    whole = dict(zip((id(p) for p in params), flat.split([p.numel() for p in params])))

    def grad_of(fsdp_param) -> torch.Tensor | None:
        p = fsdp_param.sharded_param
        part = whole.get(id(p))
        return None if part is None else part.view(p.shape).to(torch.promote_types(p.dtype, flat.dtype))

    return _reduce_scatter_units(policy, grad_of)


def check_config(cfg, world_size: int | None = None) -> None:
    """hsdp: the replicas divide the processes, and each replica's processes hold whole sequence-parallel groups."""
    from lean.config import ConfigError

    p = cfg.parallel
    if p.shard != HSDP or not world_size or world_size < 2:
        return
    replicas = replica_count(p.replicas)
    if world_size % replicas or (world_size // replicas) % p.sequence_parallel:
        raise ConfigError(
            "parallel.replicas",
            replicas,
            f"must divide the {world_size} processes into replicas of whole sequence-parallel groups of "
            f"{p.sequence_parallel}",
        )
