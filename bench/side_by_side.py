"""
What `reproduce.py --jobs` buys on a CPU: two runs of the toy study (--pair: RL or stress
SFT, each cut to a few steps), one at a time on every thread against side by side on an
equal share of the threads, as reproduce.py runs its conditions. Each round runs both ways,
in turn, in fresh folders; prints each way's wall time and how many times as fast side by
side ran (median over rounds, range). The two ways train the same adapters
(tests/test_reproduce.py compares them).

    python bench/side_by_side.py      # the toy world and its shipped base in out/bench-toy
    python bench/side_by_side.py --repeats 3 --pair sft,sft --sft-steps 40
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

import torch

from common import ROOT, ratio
import reproduce  # noqa: E402  (common put the repository on the path)
from plumbing import cli  # noqa: E402
from study import organism  # noqa: E402


def runs(out, model, data_dir, pair, sft_steps, rl_steps):
    """The pair's two commands (sft: the toy preset's stress SFT; rl: its RL), each writing a
    run folder of its own under out."""
    train = reproduce.PRESETS["toy"]["train"]
    flags = {"sft": [*train["sft"], "--preset", "stress", *train["stress"], "--max-steps",
                     str(sft_steps)],
             "rl": [*train["rl"], "--max-steps", str(rl_steps)]}
    return [[sys.executable, os.path.join(ROOT, f"{name}.py"), *flags[name], "--seed", str(i),
             "--out", f"{out}/{name}-{i}", "--model", model, "--data-dir", data_dir]
            for i, name in enumerate(pair.split(","))]


def wall(commands, threads, side_by_side):
    """Seconds until every command has ended, each run with `threads` threads."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    if side_by_side:
        procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for c in commands]
        codes = [p.wait() for p in procs]
    else:
        codes = [subprocess.run(c, env=env, capture_output=True).returncode for c in commands]
    if any(codes):
        raise SystemExit(f"a run failed ({codes}); run its command by hand to see why: {commands}")
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/bench-toy")
    p.add_argument("--repeats", type=int, default=2, help="rounds, the two ways taking turns")
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--rl-steps", type=int, default=8)
    p.add_argument("--pair", default="rl,rl", help="the two runs: rl,rl, sft,sft or sft,rl (a pair "
                   "of unequal runs measures, side by side, the wait for the longer)")
    args = p.parse_args()
    # the world and the shipped base: a second
    data_dir, model = organism.pretrain(args.out, cli.parsed(organism.add_toy_args, []))
    threads = torch.get_num_threads()  # as reproduce.py shares them out
    print(f"{threads} threads; side by side: 2 runs of {max(1, threads // 2)} each", flush=True)
    rounds = []
    for r in range(args.repeats):
        rounds.append({})
        for way in ("one at a time", "side by side"):
            folder = os.path.join(args.out, "runs")
            shutil.rmtree(folder, ignore_errors=True)
            commands = runs(folder, model, data_dir, args.pair, args.sft_steps, args.rl_steps)
            side = way == "side by side"
            rounds[-1][way] = wall(commands, max(1, threads // 2) if side else threads, side)
            print(f"round {r + 1}, {way}: {rounds[-1][way]:.1f} s", flush=True)
    median, spread = ratio(rounds, "one at a time", "side by side")
    print(f"side by side ran {median} as fast as one at a time ({spread})")


if __name__ == "__main__":
    main()
