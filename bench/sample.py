"""
Decoding speed of sample.generate against transformers' generate: the same random weights
of Qwen3-0.6B's shape, greedy, batch 1 and 8, fp32 and bf16. Prints tokens per second
(each side's fastest round), the ratio ours / transformers' (median over rounds, range),
and whether both decoded the same tokens. On CUDA ours replays its captured decode step
(decode="graph", the default there).

With --adapter-rank R it times instead what sampling exactly the trained policy costs: ours
with a rank-R adapter on every linear layer running its own products, as the training
pass does (what generate does outside fp32), against the same adapter merged into the
weights (lora.merge), which in bf16 rounds away updates below half a weight's spacing.

    python bench/sample.py
    python bench/sample.py --dtypes bf16 --batches 8 --new-tokens 32
    python bench/sample.py --dtypes bf16 --adapter-rank 16
"""
import copy
import argparse

import torch

from common import NoStopTokenizer, add_args, build, markdown, race, random_ids, ratio, setup
from sample import Sampling, generate


def rows_of(args, name, device):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
    ours, ref = build(args.config, dtype, device)
    rows = []
    for B in map(int, args.batches.split(",")):
        ids = random_ids(args.config, (B, args.prompt_tokens), seed=B).to(device)
        n = args.new_tokens
        theirs = lambda: ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        mine = lambda: generate(ours, NoStopTokenizer(), ids.tolist(), Sampling(max_new_tokens=n, temperature=0))
        with torch.no_grad():
            rounds, (out_ref, out_ours) = race([theirs, mine], device, args.repeats)
        best = [min(t) for t in zip(*rounds)]
        same = [r.completion_ids for r in out_ours] == out_ref[:, ids.shape[1]:].tolist()
        rows.append((name, B, f"{B * n / best[1]:.1f}", f"{B * n / best[0]:.1f}", *ratio(rounds, 0, 1),
                     "yes" if same else "no"))
        print(*rows[-1], flush=True)
    return rows


def adapter_rows_of(args, name, device):
    import lora
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
    ours, _ = build(args.config, dtype, device)
    lora.add_lora(ours, args.adapter_rank, 2 * args.adapter_rank)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora.lora_parameters(ours):
            p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    ours.eval()
    merged = copy.deepcopy(ours)  # a copy of the weights of its own to merge into
    lora.merge(merged)
    rows = []
    for B in map(int, args.batches.split(",")):
        ids = random_ids(args.config, (B, args.prompt_tokens), seed=B).tolist()
        n = args.new_tokens
        # generate folds in fp32: lora.merge stands for it there too
        run = lambda m: lambda: generate(m, NoStopTokenizer(), ids, Sampling(max_new_tokens=n, temperature=0))
        with torch.no_grad():
            rounds, _ = race([run(merged), run(ours)], device, args.repeats)
        best = [min(t) for t in zip(*rounds)]
        rows.append((name, B, args.adapter_rank, f"{B * n / best[1]:.1f}", f"{B * n / best[0]:.1f}",
                     *ratio(rounds, 0, 1)))
        print(*rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--adapter-rank", type=int, default=0, help="time the adapter's own products against it merged")
    args = p.parse_args()
    device = setup(args)
    if args.adapter_rank:
        rows = [row for name in args.dtypes.split(",") for row in adapter_rows_of(args, name, device)]
        print()
        print(markdown(["dtype", "batch", "rank", "own products tok/s", "merged tok/s", "ratio", "ratio's range"], rows))
        return
    rows = [row for name in args.dtypes.split(",") for row in rows_of(args, name, device)]
    print()
    print(markdown(["dtype", "batch", "ours tok/s", "transformers tok/s", "ratio", "ratio's range", "same tokens"], rows))


if __name__ == "__main__":
    main()
