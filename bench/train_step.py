"""
One LoRA training step against transformers + peft: batch 4 x 256 tokens, rank 16 on all
seven linear layers of every block, forward, backward and AdamW step, on the same random
Qwen3-0.6B-shape weights. Ours is what sft.py runs: hidden states from the body, then
log-probs in vocabulary chunks (model.token_logprobs), never the full [B, T, 151,936]
logits; it runs twice, as sft.py runs by default and with --recompute (each layer keeps
only its matrix products and attention outputs for the backward pass). The reference is
peft's get_peft_model on Qwen3ForCausalLM with labels, transformers' own loss. Each side
runs in its own process. Peak memory is the most held at once during a step beyond what
was held before it: on CUDA the allocator's count, on the CPU the profiler's record of
every allocation and free. The first-step losses of the two must agree (the LoRA B matrices start at zero, so both see the base model).

    python bench/train_step.py
    python bench/train_step.py --dtypes bf16 --steps 1
"""
import argparse
import json
import subprocess
import sys

import torch

from common import M, add_args, build, markdown, random_ids, setup, synchronize, timed
import lora  # noqa: E402  (common put the repository on the path)


def worker(args, device):
    _, dtype = M.resolve_device(device, args.dtypes)
    ours, ref = build(args.config, dtype, device)
    ids = random_ids(args.config, (args.batch, args.length), seed=1).to(device)
    if args.worker in ("ours", "ours-recompute"):
        del ref
        torch.manual_seed(0)
        lora.add_lora(ours, args.rank, 2 * args.rank)
        ours.train()
        ours.recompute = args.worker == "ours-recompute"  # sft.py --recompute
        optimizer = torch.optim.AdamW(lora.lora_parameters(ours), lr=1e-4)
        seqs = ids.tolist()

        def step():
            logp, _ = M.sequence_logprobs(ours, seqs, [1] * len(seqs))
            loss = -logp.mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()
    else:
        from peft import LoraConfig, get_peft_model
        del ours
        torch.manual_seed(0)
        model = get_peft_model(ref, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                               target_modules=list(lora.TARGETS)))
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

    first_loss = step()  # warm-up; creates the optimizer state, which both sides then hold
    seconds, _ = timed(step, device, args.steps)
    print(json.dumps(dict(seconds=seconds, peak=step_peak_memory(step, device), first_loss=first_loss)))


def step_peak_memory(step, device):
    """Most bytes held at once during one step beyond what was held before it (activations,
    logits, gradients, temporaries). CUDA: the caching allocator's own count. CPU: the
    running sum of every allocation and free the profiler records (the resident set would
    count memory that malloc keeps after a free)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    held = peak = 0
    for _, change in sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage):
        held += change
        peak = max(peak, held)
    return peak


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step; the best counts")
    p.add_argument("--rounds", type=int, default=2, help="worker processes per side, taking turns; the fastest counts")
    p.add_argument("--worker", choices=["ours", "ours-recompute", "ref"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args, M.resolve_device(args.device)[0])
    device = setup(args)
    rows = []
    for dtype_name in args.dtypes.split(","):
        result = {}
        for _ in range(args.rounds):  # the two sides take turns, so a slow spell of the machine hits both
            for side in ("ours", "ours-recompute", "ref"):
                cmd = [sys.executable, __file__, "--worker", side, "--dtypes", dtype_name, "--config", args.config,
                       "--device", str(device), "--batch", str(args.batch), "--length", str(args.length),
                       "--rank", str(args.rank), "--steps", str(args.steps)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{side} worker failed:\n{out.stderr[-3000:]}")
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if side not in result or got["seconds"] < result[side]["seconds"]:
                    result[side] = got
        r = result["ref"]
        for side, recompute in (("ours", "no"), ("ours-recompute", "yes")):
            o = result[side]
            rows.append((dtype_name, f"{args.batch}x{args.length}", recompute, f"{o['seconds']:.3f}", f"{r['seconds']:.3f}",
                         f"{r['seconds'] / o['seconds']:.2f}x", f"{o['peak'] / 2**20:.0f}", f"{r['peak'] / 2**20:.0f}",
                         f"{o['peak'] / r['peak']:.2f}x", f"{o['first_loss']:.4f} / {r['first_loss']:.4f}"))
            print(" ".join(rows[-1]), flush=True)
    print()
    print(markdown(["dtype", "batch", "recompute", "ours s/step", "peft s/step", "speed ratio", "ours peak MiB",
                    "peft peak MiB", "memory ratio", "first loss ours / peft"], rows))


if __name__ == "__main__":
    main()
