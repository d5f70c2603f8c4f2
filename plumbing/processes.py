"""
More than one process: under `torchrun --nproc-per-node N`, every process takes a share of
each step's batch and the adapter's gradients are summed over them; one process (RANK 0)
writes the run folder. A plain `python` run is WORLD 1 and none of this does anything.
"""
import atexit
import os
import sys

import torch
import torch.distributed as dist

from plumbing.files import InputError

RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def join_processes(device):
    """Join torchrun's process group (NCCL on CUDA, gloo on the CPU); returns the device this
    process runs on, on CUDA its own GPU."""
    if WORLD == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        # left for the interpreter's own teardown, gloo's threads can abort the process (SIGABRT)
        # after a run has finished, which torchrun then reports as a failure
        atexit.register(dist.destroy_process_group)
    return device


def leave_processes():
    """End a process of torchrun's that finished its work: once every process has, the group
    is taken down and the process exits 0 at once. Left to the interpreter's teardown, gloo's
    threads (still held by the C++ runtime as it exits) abort a finished process now and
    then, SIGABRT with "terminate called without an active exception", which torchrun
    reports as a failed run; os._exit skips that teardown. Every file is written by now."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def split(n, flag=None):
    """(first, last): this process's contiguous share of n items, in rank order, so that the
    shares joined are the whole. Where a flag sets n, it must split evenly, so that every
    process takes the same share and N processes make the update one makes."""
    if flag and n % WORLD:
        raise InputError(f"{flag} {n} does not split evenly over {WORLD} processes; pass a "
                         f"multiple of {WORLD}, or run fewer processes")
    return RANK * n // WORLD, (RANK + 1) * n // WORLD


def joined(part):
    """Every process's list, joined in rank order (split's inverse)."""
    if WORLD == 1:
        return list(part)
    parts = [None] * WORLD
    dist.all_gather_object(parts, list(part))
    return [x for p in parts for x in p]


def summed(*values):
    """Each number summed over the processes."""
    return [sum(column) for column in zip(*joined([values]))]
