"""Data parallelism over torch.distributed: every rank takes its share of the work, sums are all-reduced.

    devices = dist.init(["cuda:0", "cuda:1"])   # joins the group torchrun describes; this rank's devices
    mine = dist.shard(items)                    # this rank's items: items[rank::world]
    dist.all_reduce_(t)                         # t summed over all ranks, in place
    everything = dist.gather(results)           # rank 0: every rank's results in the order of items

Run a script with `torchrun --nproc-per-node N script.py ...`; torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and init() reads them. In one process
(no WORLD_SIZE) every function here is a no-op: rank 0 of a world of 1. The process group is
"cpu:gloo,cuda:nccl" when CUDA is there (a CPU tensor goes through gloo, a CUDA one through NCCL),
else gloo. This file is a thin layer over torch.distributed, nothing more.
"""
import os

import torch
import torch.distributed as td

from kvt.config import KvtError


def check_devices(devices):
    """Every device named must exist here: a one-line error for a typo or a GPU this machine lacks."""
    for d in devices:
        try:
            dev = torch.device(d)
        except RuntimeError:
            raise KvtError(f"unknown device {d!r}; use cpu, cuda or cuda:N")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise KvtError(f"--device {d}: CUDA is not available on this machine; use --device cpu")
        if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
            raise KvtError(f"--device {d}: this machine has {torch.cuda.device_count()} CUDA devices")
        if dev.type not in ("cpu", "cuda", "meta", "mps"):
            raise KvtError(f"device {d!r} is not one kvt runs on; use cpu or cuda:N")


def init(devices=("cpu",)):
    """Join the process group when launched by torchrun; return this rank's share of `devices`.

    Ranks on one node split a list of CUDA devices evenly: `cuda:0..7` with 4 ranks per node gives
    rank r `cuda:2r, cuda:2r+1` (each rank can then split its models across its share with
    loading.place). A bare "cuda" means cuda:LOCAL_RANK. CPU ranks all share the host's memory."""
    devices = [str(d) for d in devices]
    w, local_w, local_r = (int(os.environ.get(k, d)) for k, d in
                           (("WORLD_SIZE", 1), ("LOCAL_WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    if w == 1:
        return devices
    if devices == ["cuda"]:
        devices = [f"cuda:{local_r}"]
    elif any(torch.device(d).type == "cuda" for d in devices):
        if len(devices) % local_w:
            raise KvtError(f"--devices lists {len(devices)} devices for {local_w} ranks per node; "
                           f"give a multiple of {local_w}, or --nproc-per-node that divides {len(devices)}")
        per = len(devices) // local_w
        devices = devices[local_r * per:(local_r + 1) * per]
    if not td.is_initialized():
        cuda = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
        if cuda:
            torch.cuda.set_device(cuda[0])  # NCCL talks through this rank's first GPU
        td.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return devices


def close():
    """Leave the process group (at the end of a torchrun script)."""
    if td.is_initialized():
        td.destroy_process_group()


def rank():
    return td.get_rank() if td.is_initialized() else 0


def world():
    return td.get_world_size() if td.is_initialized() else 1


def shard(items):
    """This rank's part of a list (or tensor): every world()-th item from rank() on. Strided, so long
    and short items spread evenly; gather() puts the results back in the original order."""
    return items[rank()::world()]


def all_reduce_(t):
    """Sum tensor t over all ranks, in place (its dtype, on its device). Returns t."""
    if world() > 1:
        td.all_reduce(t)
    return t


def gather(records):
    """Every rank's list of records (picklable), on rank 0, in the order of the list shard() split:
    rank r's j-th record was item r + j * world. Other ranks get None."""
    if world() == 1:
        return list(records)
    parts = [None] * world() if rank() == 0 else None
    td.gather_object(list(records), parts, dst=0)
    if rank() != 0:
        return None
    longest = max(len(p) for p in parts)
    return [p[j] for j in range(longest) for p in parts if j < len(p)]   # undo the stride


def barrier():
    """Wait for every rank (e.g. until all have written their share of the records)."""
    if world() > 1:
        td.barrier()
