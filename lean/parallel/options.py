"""The ``parallel`` section: where the samples, the weights and the tokens live (registered with
``lean.config.sections``)."""

from __future__ import annotations

from dataclasses import dataclass

from lean.config.checks import check_positive, choice, choices
from lean.config.sections import register_options


@register_options("parallel")
@dataclass
class ParallelConfig:
    """Where the samples, the weights and the tokens live (docs/parallelism.md); the processes come from
    ``lean launch`` (Accelerate)."""

    layout: str = choice("layout")
    """Which samples a process holds and when its schedule finishes them: a name of ``lean.parallel.layout.LAYOUTS``
    (shared: LeanGRPO's, the ranks share each prompt's samples, Q = G / W each, finished prompt by prompt, so Retain
    holds Q trajectories' graphs; group: whole prompt groups, each finished as soon as it is scored, so Retain holds
    one group's; slice: a contiguous share, finished after the whole rollout; auto: group where it applies)."""
    grad_sync: str = choice("grad sync")
    """When the trained weights' gradients cross processes: a name of ``lean.parallel.grad_sync.GRAD_SYNCS``
    (per_update: once per optimizer step, after the schedule accumulated and corrected them, the paper's coalesced
    sync; per_backward: after every backward, as DDP and FSDP do, the paper's Native; auto: per_update, or FSDP's
    per_backward under a sharded full fine-tune)."""
    shard: str = choice("shard")
    """How the policy is spread over the processes: a name of ``lean.parallel.sharding.SHARDS`` (none: a whole copy
    each; fsdp: FSDP2 ``fully_shard`` of the transformer blocks; the frozen base, and under full fine-tuning the trained
    weights, gradients and AdamW state; hsdp: the same within each node, replicated across ``replicas`` nodes)."""
    replicas: int | None = None
    """Under ``shard: hsdp``: the groups of consecutive processes the weights are replicated across (each sharded
    within), the nodes of a multi-node launch; None: the launch's nodes (``lean launch --nnodes``)."""
    sequence_parallel: int = 1
    """Processes that split each trajectory's tokens (Ulysses attention, ``lean.models.sequence_parallel``): groups of
    this many consecutive processes hold the same samples, so ``lean launch -n 4`` with 2 is 2 data-parallel x 2
    sequence-parallel. The heads and the tokens (FLUX: the text tokens too) must divide by it."""
    split_decode: bool = True
    """Under sequence parallelism, each process of a group decodes and scores its share of the group's samples and
    the rewards are all-gathered (``lean.run.async_scoring``): the VAE decode and the rewards run once per sample, not
    once per process. false: every process decodes and scores all of them."""
    overlap: str = choice("overlap method", "flash")
    """How sequence parallelism's all-to-alls run beside the projections' GEMMs: a name of
    ``lean.parallel.overlap.METHODS`` (collective: one all-to-all after the projection; sliced; flash: one P2P step per
    peer, each head block sent as soon as it is computed)."""

    def validate(self) -> None:
        choices(self, "parallel")
        check_positive("parallel.sequence_parallel", self.sequence_parallel)
        if self.replicas is not None:
            check_positive("parallel.replicas", self.replicas)

    def data_parallel_size(self, world_size: int | None) -> int:
        """Data-parallel ranks of ``world_size`` processes (None: not known yet, as if one)."""
        return max(1, (world_size or self.sequence_parallel) // self.sequence_parallel)
