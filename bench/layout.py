"""
What model.lay_out_weights buys on this machine: our own model with every linear weight
row-major, as checkpoints store it (out, in), against the very same values column-major
(the order load() picks on the CPU in fp32 where MKL multiplies; on AMD CPUs the weights
that go to oneDNN are row-major unless wider in than out), the two taking turns in one
run. Greedy decode at 1 and 8 rows (as bench/sample.py) and 64 rows (RL's 8 x 8 group
sampling), and one LoRA forward and backward at 4 x 256 tokens (as bench/train_step.py,
without the optimizer). Prints seconds (each order's fastest round) and the ratio
row-major / column-major (above 1: column-major is faster), the median over rounds of the
ratio of two runs made back to back, with its range. Which order is faster is a property
of the CPU's matrix kernels, so on other hardware run this before trusting the choice
load() makes.

In bf16 a second table: greedy decode on the row-major model (bf16's order) with every
product as F.linear computes it, against model.linear's forms for a few rows (the weight
first, a matrix-vector product for one row; forced on here, where by default only a CPU
with AMX takes them) and against the decoder layers' weights packed and stacked
(M.packed_weights; with the output layer as this CPU computes it by default, this is what
sample.generate runs on the CPU in bf16), the three taking turns; a ratio above 1 means
that form is faster than F.linear.

    python bench/layout.py
    python bench/layout.py --dtypes fp32,bf16 --batches 8
"""
import argparse

import torch

from common import M, NoStopTokenizer, add_args, build, markdown, ours_on, race, random_ids, setup
import lora  # noqa: E402  (common put the repository on the path)
from sample import generate


def lora_forward_backward(model, ids, rank):
    torch.manual_seed(0)
    lora.add_lora(model, rank, 2 * rank)
    model.train()
    seqs = ids.tolist()

    def step():
        loss = -M.sequence_logprobs(model, seqs, [1] * len(seqs))[0].mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()
    return step


def with_forms(few_row_forms, pack, fn):
    """fn run with model.linear's few-row forms on, off or as this CPU picks them (None),
    and with M.packed_weights on or off."""
    def run():
        kept, M.FEW_ROW_FORMS, M.PACK_ON_CPU = (M.FEW_ROW_FORMS, M.PACK_ON_CPU), few_row_forms, pack
        try:
            return fn()
        finally:
            M.FEW_ROW_FORMS, M.PACK_ON_CPU = kept
    return run


# the last is what sample.generate runs on this CPU: the output layer in model.linear's few-row
# forms where the CPU has AMX, else in F.linear's
FORMS = {"F.linear": (False, False), "few-row forms": (True, False), "packed": (None, True)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p, dtypes="fp32")
    p.add_argument("--batches", default="1,8,64", help="rows decoded at once")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--train", default="4x256", help="batch x length of the LoRA forward and backward; 0 to skip")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds, the two layouts taking turns")
    args = p.parse_args()
    device = setup(args)
    rows, forms = [], []
    for dtype_name in args.dtypes.split(","):
        _, dtype = M.resolve_device(device, dtype_name)
        _, ref = build(args.config, dtype, device)
        # our model on ref's values, every linear weight in the one order, then in the other
        models = [M.lay_out_weights(ours_on(ref, args.config), column_major) for column_major in (False, True)]
        del ref
        with torch.no_grad():
            for B in map(int, args.batches.split(",")):
                prompts = random_ids(args.config, (B, 32), seed=B).tolist()
                runs = [lambda m=m: generate(m, NoStopTokenizer(), prompts, max_new_tokens=args.new_tokens,
                                             temperature=0) for m in models]
                for run in runs:
                    run()  # warm-up
                timing = race(runs, device, args.repeats)
                (t_row, t_col), (out_row, out_col) = timing.best, timing.results
                same = [r.completion_ids for r in out_row] == [r.completion_ids for r in out_col]
                rows.append((dtype_name, f"decode, batch {B}", f"{t_row:.2f}", f"{t_col:.2f}",
                             *timing.ratio_cells(0, 1), "yes" if same else "no"))
                print(*rows[-1], flush=True)
                if dtype == torch.bfloat16 and device.type == "cpu":
                    runs = [with_forms(*settings, runs[0]) for settings in FORMS.values()]
                    timing = race(runs, device, args.repeats)
                    tokens = [[r.completion_ids for r in out] for out in timing.results]
                    for i, form in enumerate(FORMS):
                        forms.append((dtype_name, f"decode, batch {B}", form, f"{timing.best[i]:.2f}",
                                      *timing.ratio_cells(0, i), "yes" if tokens[i] == tokens[0] else "no"))
                        print(*forms[-1], flush=True)
        if args.train != "0":
            batch, length = map(int, args.train.split("x"))
            ids = random_ids(args.config, (batch, length), seed=1).to(device)
            steps = [lora_forward_backward(m, ids, args.rank) for m in models]
            losses = [step() for step in steps]  # warm-up
            timing = race(steps, device, args.repeats)
            t_row, t_col = timing.best
            rows.append((dtype_name, f"LoRA forward+backward, {args.train}", f"{t_row:.2f}", f"{t_col:.2f}",
                         *timing.ratio_cells(0, 1), "yes" if abs(losses[0] - losses[1]) < 1e-4 else "no"))
            print(*rows[-1], flush=True)
        del models
    print()
    print(markdown(["dtype", "work", "row-major s", "column-major s", "ratio", "ratio's range", "same result"],
                   rows))
    if forms:
        print()
        print(markdown(["dtype", "work", "products", "s", "F.linear s / this", "ratio's range",
                        "same tokens as F.linear"], forms))


if __name__ == "__main__":
    main()
