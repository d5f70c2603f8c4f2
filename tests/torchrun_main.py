"""A training script's main as the distributed tests launch it under torchrun: rl.py rewards
each prompt's first sample (a random model's answers are never right, so it would have
nothing to learn); after every optimizer step the processes compare their trained weights
and fail unless they are equal to the bit; with $STOP_AT_STEP the writing process sends
SIGTERM to torchrun amid that step, as a cluster's scheduler does to a job, with
$FAIL_AT_STEP the other one fails there, and with $ABORT_IN_TEARDOWN every process aborts
if it reaches the interpreter's teardown, as gloo's threads now and then make it do.
    torchrun --standalone --nproc-per-node 2 tests/torchrun_main.py rl --model ... --out ..."""
import atexit
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import opd  # noqa: E402
import rl  # noqa: E402
import sft  # noqa: E402
import train  # noqa: E402
from plumbing import cli, processes  # noqa: E402

stop_at, fail_at = int(os.environ.get("STOP_AT_STEP", "-1")), int(os.environ.get("FAIL_AT_STEP", "-1"))
if os.environ.get("ABORT_IN_TEARDOWN"):
    atexit.register(os.abort)
batch_indices, optimizer_step = data.batch_indices, train.optimizer_step  # the scripts' own


def batch_indices_then_signal(n, step, *args):
    if step == stop_at and processes.RANK == 0:
        os.kill(os.getppid(), signal.SIGTERM)  # torchrun passes it on to every process
        time.sleep(2)  # before this step ends, however fast: a scheduler's signal comes amid a step
    if step == fail_at and processes.RANK == 1:
        raise RuntimeError(f"process 1 failed at step {step + 1}")
    return batch_indices(n, step, *args)


def optimizer_step_then_compare(optimizer, step, *args):
    result = optimizer_step(optimizer, step, *args)
    mine = torch.cat([p.detach().flatten() for group in optimizer.param_groups for p in group["params"]])
    everyone = [torch.empty_like(mine) for _ in range(processes.WORLD)]
    dist.all_gather(everyone, mine)
    if not all(torch.equal(mine, theirs) for theirs in everyone):
        raise RuntimeError(f"the processes' trained weights differ after step {step + 1}")
    return result


data.batch_indices, train.optimizer_step = batch_indices_then_signal, optimizer_step_then_compare
MAINS = {"sft": sft.main, "opd": opd.main,
         "rl": lambda argv: rl.main(argv, reward_fn=lambda rollout, row: float(rollout.sample_index == 0))}
cli.run_script(lambda argv: MAINS[sys.argv[1]](argv[1:]))
