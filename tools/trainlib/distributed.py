"""Process-group setup for torchrun, plain ``srun`` (one task per GPU), or a single process.

Rank / world size / local rank come from :class:`stager.world.World` (torchrun variables first,
then Slurm's). The rendezvous address is ``MASTER_ADDR`` or, under srun, the first host of
``SLURM_JOB_NODELIST`` (expanded with :func:`stager.world.expand_hostlist`); the port is
``MASTER_PORT`` or ``20000 + SLURM_JOB_ID % 20000`` so concurrent jobs sharing a node do not
collide. Backend: NCCL when CUDA is available, else gloo.

``--dist horovod``: Horovod instead of a torch.distributed group (``horovodrun``, or ``mpirun``/``srun
--mpi`` with a horovod built with MPI): ``hvd.init()`` numbers the ranks; stager's world detection
(HOROVOD_* or OMPI_*/PMI_* variables) must agree with it, and the collectives below go through
Horovod. docs/training.md has the build recipe (horovod 0.28.1 needs C++17 for torch >= 2.1).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stager.world import World, expand_hostlist

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistInfo:
    """What the training loop needs to know about its place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: no process group (single process or --independent)
    launcher: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def rendezvous(env: Mapping[str, str]) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` from torchrun's variables, else derived from Slurm's."""
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        hosts = expand_hostlist(nodelist) if nodelist else []
        addr = hosts[0] if hosts else "127.0.0.1"
    port_s = env.get("MASTER_PORT")
    if port_s:
        port = int(port_s)
    elif env.get("SLURM_JOB_ID", "").isdigit():
        port = 20000 + int(env["SLURM_JOB_ID"]) % 20000
    else:
        port = DEFAULT_PORT
    return addr, port


def pick_device(local_rank: int, want: str = "auto") -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available (or requested), else CPU."""
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but torch.cuda.is_available() is False")
    n = torch.cuda.device_count()
    # One task per GPU: with CUDA_VISIBLE_DEVICES restricted per task (some sites' gres binding)
    # the only visible device is 0.
    return torch.device("cuda", local_rank % n)


def _hvd() -> Any:
    import horovod.torch as hvd

    return hvd


def setup_horovod(device: str = "auto") -> DistInfo:
    """``hvd.init()``; the ranks it numbers must be the ones stager's world detection sees."""
    hvd = _hvd()
    hvd.init()
    world = World.detect()
    if (world.rank, world.world_size) != (hvd.rank(), hvd.size()):
        raise SystemExit(f"train.py: error: horovod says rank {hvd.rank()} of {hvd.size()}, the launcher's "
                         f"variables rank {world.rank} of {world.world_size} ({world.source}); start the job "
                         "with horovodrun, or mpirun/srun --mpi with an MPI-built horovod")
    dev = pick_device(hvd.local_rank(), device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return DistInfo(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), dev, "horovod", world.source)


def setup(*, independent: bool = False, device: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Initialise the default process group when the job has more than one rank.

    With ``independent`` every process trains alone: no process group, ``rank``/``world_size``
    are 0/1 for data partitioning, and ``local_rank`` picks the GPU and the sweep entry.
    """
    world = World.detect()
    dev = pick_device(world.local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if independent:
        return DistInfo(0, 1, world.local_rank, world.local_world_size, dev, None, world.source)
    if world.world_size == 1:
        return DistInfo(0, 1, 0, 1, dev, None, world.source)
    addr, port = rendezvous(os.environ)
    # torchrun already exported these; for srun we export them so init_method="env://" works.
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=world.rank,
        world_size=world.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=dev if dev.type == "cuda" else None,
    )
    return DistInfo(world.rank, world.world_size, world.local_rank, world.local_world_size, dev, backend, world.source)


def cleanup(info: DistInfo | None = None) -> None:
    if info is not None and info.backend == "horovod":
        _hvd().shutdown()
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum ``t`` over ranks in place (no-op for one process); returns ``t``."""
    if info.backend == "horovod":
        t.copy_(_hvd().allreduce(t, op=_hvd().Sum))
    elif info.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Element-wise max of ``t`` over ranks in place (no-op for one process); returns ``t``."""
    if info.backend == "horovod":
        t.copy_(_hvd().allreduce(t, op=_hvd().Max))
    elif info.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_gather_objects(obj: object, info: DistInfo) -> list[object]:
    """Every rank's ``obj`` in rank order (``[obj]`` for one process)."""
    if not info.distributed:
        return [obj]
    if info.backend == "horovod":
        return list(_hvd().allgather_object(obj))
    out: list[object] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.backend == "horovod":
        _hvd().barrier()
    elif info.distributed:
        dist.barrier()
