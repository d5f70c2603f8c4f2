"""
Decode speed of sample.generate against transformers' generate: same random weights with
the exact Qwen3-0.6B shape (shared in memory, not copied), greedy, 64 new tokens, batch 1
and 8, fp32 and bf16, on whatever device is present. On CUDA, ours is timed with its
captured decode step (decode="graph", the default there) and without it ("dropping").
Prints a table of tokens per second (each side's fastest round) and the ratio, ours over
transformers (higher is better): the median of the rounds' ratios, each taken between
two runs made back to back, with its range over the rounds. With --shared-prefix N every
prompt opens with the same N tokens before its own, as few-shot evaluation's prompts open
with their shots: ours runs them once (sample.prefill), transformers once per prompt.

    python bench/sample.py                 # all four settings
    python bench/sample.py --dtypes bf16 --batches 8 --new-tokens 32
    python bench/sample.py --dtypes bf16 --batches 8 --shared-prefix 700 --prompt-tokens 100 --new-tokens 16
"""
import argparse

import torch

from common import (M, NoStopTokenizer, add_args, build, decode_modes, markdown, products_alone, race, random_ids,
                    setup)
from sample import generate


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt opens with, before its own")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, implementations taking turns")
    args = p.parse_args()
    device = setup(args)
    modes = decode_modes(device)
    rows, steps = [], []
    for dtype_name in args.dtypes.split(","):
        _, dtype = M.resolve_device(device, dtype_name)
        ours, ref = build(args.config, dtype, device)
        for B in map(int, args.batches.split(",")):
            prompts = random_ids(args.config, (B, args.prompt_tokens), seed=B)
            prompts = torch.cat([random_ids(args.config, (1, args.shared_prefix), seed=0).expand(B, -1), prompts], 1)
            ids, n = prompts.to(device), args.new_tokens
            run_ref = lambda n=n: ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                               max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
            runs = [lambda mode=mode, n=n: generate(ours, NoStopTokenizer(), prompts.tolist(), max_new_tokens=n,
                                                    temperature=0, decode=mode) for mode in modes]
            # with one new token a run is its prefill (and one draw) and no decode step
            prefills = [lambda: run_ref(n=1)] + [lambda run=run: run(n=1) for run in runs]
            fns = [run_ref] + runs + prefills + [products_alone(ours, B)]
            with torch.no_grad():
                for fn in fns:
                    fn()  # warm-up
                timing = race(fns, device, args.repeats)
            times, results = timing.best, timing.results
            full = 1 + len(modes)  # transformers, then ours in each decode mode
            (t_ref, *t_ours), (out_ref, *out_ours) = times[:full], results[:full]
            step_ms = [1e3 * (t - t1) / max(n - 1, 1) for t, t1 in zip(times[:full], times[full:2 * full])]
            t_products = 1e3 * times[-1]
            for mode, ms in zip(modes, step_ms[1:]):
                steps.append((dtype_name, B, mode, f"{ms:.2f}", f"{step_ms[0]:.2f}", f"{t_products:.2f}",
                              f"{t_products / ms:.0%}", f"{step_ms[0] / t_products:.2f}x"))
            for i, (mode, t, out) in enumerate(zip(modes, t_ours, out_ours), start=1):
                same = [r.completion_ids for r in out] == out_ref[:, prompts.shape[1]:].tolist()
                rows.append((dtype_name, B, mode, f"{B * n / t:.1f}", f"{B * n / t_ref:.1f}", *timing.ratio_cells(0, i),
                             "yes" if same else "no"))
                print(*rows[-1], flush=True)
        del ours, ref
    print()
    print(markdown(["dtype", "batch", "ours: decode", "ours tok/s", "transformers tok/s", "ratio", "ratio's range",
                    "same tokens"], rows))
    print()
    print(markdown(["dtype", "batch", "ours: decode", "ours ms/step", "transformers ms/step", "products alone ms",
                    "products' share of ours", "ceiling: transformers / products"], steps))


if __name__ == "__main__":
    main()
