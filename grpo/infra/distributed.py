"""Running under `torchrun`: the process group, which prompts each rank takes, and combining tensors and
metrics across ranks. Without torchrun (or with a single process) `setup()` returns a `Distributed` of world
size 1 whose every operation hands its input back unchanged."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..settings.plan import ranks_from_env


@dataclass(frozen=True)
class Distributed:
    """This process's place among the ranks, and the collectives the trainer needs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes metrics, completions and checkpoints."""
        return self.rank == 0

    def shard(self, columns: dict[str, list]) -> dict[str, list]:
        """This rank's contiguous share of rows that every rank drew identically (whole prompts, so a
        prompt's group of completions never straddles ranks)."""
        if self.world_size == 1:
            return columns
        n = len(next(iter(columns.values())))
        if n % self.world_size:
            raise ValueError(f"{n} rows cannot be split evenly over {self.world_size} ranks")
        k = n // self.world_size
        return {name: values[self.rank * k:(self.rank + 1) * k] for name, values in columns.items()}

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all) concatenated along dim 0 in rank order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def local(self, gathered: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor built from `gather`ed ones."""
        if self.world_size == 1:
            return gathered
        return gathered.chunk(self.world_size)[self.rank]

    def gather_objects(self, items: list) -> list:
        """Every rank's list of picklable items, concatenated in rank order."""
        if self.world_size == 1:
            return items
        parts = [None] * self.world_size
        dist.all_gather_object(parts, items)
        return [item for part in parts for item in part]

    def gather_to_main(self, obj) -> list | None:
        """Every rank's picklable `obj` (tensors moved to the CPU), on rank 0 in rank order; None elsewhere."""
        parts = [None] * self.world_size if self.is_main else None
        dist.gather_object(_to_cpu(obj), parts, dst=0)
        return parts

    def agree_on_signal(self, received: int | None) -> int | None:
        """A stop signal any rank received (ranks see signals at different moments; all must stop together)."""
        if self.world_size == 1:
            return received
        return int(self.reduce({"signal": received or 0}, "max")["signal"]) or None

    def reduce(self, values: dict[str, float], op: str = "sum") -> dict[str, float]:
        """`values` combined over ranks key by key ("sum" or "max"); every rank must pass the same keys."""
        if self.world_size == 1 or not values:
            return values
        keys = sorted(values)
        packed = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)  # [K]
        dist.all_reduce(packed, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return dict(zip(keys, packed.tolist()))

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def setup() -> Distributed:
    """Join the process group torchrun describes (once; later calls reuse it). NCCL carries GPU tensors and
    gloo CPU ones, so the small CPU-side reductions need no copies to the GPU."""
    if dist.is_available() and dist.is_initialized():
        return Distributed(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    world_size = ranks_from_env()
    if world_size == 1:
        return Distributed()
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # "cuda" then means this rank's GPU, e.g. in load_model
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank)


def shutdown() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
