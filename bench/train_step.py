"""
One LoRA training step against transformers + peft: batch 4 x 256 tokens, rank 16 on all
seven linear layers of every block, forward, backward and AdamW step, on the same random
Qwen3-0.6B-shape weights. Ours is what sft.py runs: hidden states from the body, then
log-probs in vocabulary chunks (model.token_logprobs), never the full [B, T, 151,936]
logits; it runs twice, as sft.py runs by default and with --recompute (each layer keeps
only its weight products and attention outputs for the backward pass). The reference is
peft's get_peft_model on Qwen3ForCausalLM with labels, transformers' own loss.

All three run in one process on the same base weights (both of ours on one copy laid out
as model.load() lays it out, column-major on the CPU in fp32; peft on transformers' own
tensors) and take turns step by step, so a slow spell of the machine hits each of them.
The table gives each one's fastest step and the speed ratio, peft over ours: the median
over rounds of the ratio of the two's steps in the same round, with its range. Peak
memory is the most held at once during a step beyond what was held before it: on CUDA
the allocator's count, on the CPU the profiler's record of every allocation and free.
The first-step losses must agree (the LoRA B matrices start at zero, so all see the base
model).

A second table says where a step's time goes: the step's matrix products with the
model's frozen weights run alone (each linear layer's and the output layer's forward
product over the batch's tokens and its product for the gradient with respect to its
input), work no implementation of this step can skip. peft's step over that time
("ceiling") is the most ours could gain over peft by cutting everything else.

With --gsm8k-batch N the batch is instead sft.py's first batch of N GSM8K training
examples at their own lengths (question, answer and the loss on the answer tokens, as
sft.py trains; lengths in tokens are the texts' characters over 4, since Qwen3's tokenizer
is not at hand offline: the spread of lengths is what matters here). It times ours with
short sequences sharing rows (model.training_rows, what the scripts run), ours with one row
per sequence, right-padded, and peft on the same right-padded batch with its attention
mask and the padding and prompts left out of the loss, as TRL pads a batch
(--without-peft: the first two alone, the second the reference). --group-size K makes it
rl.py's batch, K samples of each of the N questions, and --cuts C opd.py's, each sample
continued from C points of its answer: sequences with long common prefixes, which ours
lays out once in a row (model.training_rows).

    python bench/train_step.py
    python bench/train_step.py --dtypes bf16 --steps 1
    python bench/train_step.py --dtypes bf16 --gsm8k-batch 16 --steps 3
    python bench/train_step.py --dtypes bf16 --gsm8k-batch 2 --group-size 8 --without-peft
"""
import argparse

import torch

from common import DATA, M, add_args, build, markdown, ours_on, products_alone, race, random_ids, setup, step_peak_memory
import lora  # noqa: E402  (common put the repository on the path)


def our_step(base, config_dir, seqs, starts, rank, recompute, dropout, share_rows=True):
    """sft.py's step on our model, reading base's (frozen) weights, with its own adapter."""
    model = ours_on(base, config_dir)
    torch.manual_seed(0)
    lora.add_lora(model, rank, 2 * rank, dropout)
    model.train()
    model.recompute = recompute  # sft.py --recompute
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-4)
    return training_step(lambda: -M.sequence_logprobs(model, seqs, starts, share_rows=share_rows)[0].mean(), optimizer)


def peft_step(ref, ids, rank, dropout, attention_mask=None, labels=None):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = get_peft_model(ref, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout,
                                           target_modules=list(lora.TARGETS)))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    labels = ids if labels is None else labels
    return training_step(lambda: model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss, optimizer)


def gsm8k_batch(config_dir, n, data_dir, group_size=1, cuts=0, continuation=32):
    """sft.py's first batch of n examples: random ids at the lengths of their texts (4
    characters to a token), and where each one's answer starts. With group_size, rl.py's
    batch instead: group_size samples of each question, each as long as another example's
    answer; with cuts, opd.py's: each sample cut at that many random points of its answer
    and continued by `continuation` tokens, trained on those alone."""
    import random
    import data
    rows = data.load_gsm8k("train", data_dir)
    batch = [rows[i] for i in data.batch_indices(len(rows), 0, n * group_size, seed=0)]
    prompts = [data.gsm8k_prompt(r["question"]) for r in batch]
    prompt_lengths = [round(len(p) / 4) for p in prompts]
    lengths = [round(len(p + " " + r["answer"]) / 4) + 1 for p, r in zip(prompts, batch)]  # + end-of-text
    answer_lengths = [length - prompt for length, prompt in zip(lengths, prompt_lengths)]
    group_prompt = [prompt_lengths[i - i % group_size] for i in range(len(batch))]  # the group's first question's
    width = max(p + a for p, a in zip(group_prompt, answer_lengths)) + (continuation if cuts else 0)
    ids = random_ids(config_dir, (len(batch), width), seed=1).tolist()
    seqs, starts, rng = [], [], random.Random(0)
    for i, row in enumerate(ids):
        prompt = ids[i - i % group_size][:group_prompt[i]]
        sample = prompt + row[len(prompt):len(prompt) + answer_lengths[i]]
        if not cuts:
            seqs.append(sample)
            starts.append(len(prompt))
        for t in sorted(rng.sample(range(answer_lengths[i]), min(cuts, answer_lengths[i]))):
            seqs.append(sample[:len(prompt) + t] + row[-continuation:])
            starts.append(len(prompt) + t)
    return seqs, starts


def ragged(args, device):
    """The --gsm8k-batch table: rows shared, one row each, peft; all on the same batch."""
    rows = []
    for dtype_name in args.dtypes.split(","):
        _, dtype = M.resolve_device(device, dtype_name)
        base, ref = build(args.config, dtype, device)
        if args.without_peft:
            ref = None  # in fp32 on the CPU ours holds its own copy of the weights (column-major): free the other
        seqs, starts = gsm8k_batch(args.config, args.gsm8k_batch, args.data_dir, args.group_size, args.cuts)
        ids, mask = M.left_pad([s[::-1] for s in seqs], 0)  # right padding: each row reversed, padded, reversed back
        ids, mask = ids.flip(1).to(device), mask.flip(1).to(device)
        labels = ids.masked_fill(mask == 0, -100)
        for row, start in enumerate(starts):
            labels[row, :start] = -100  # a token is learned where it is the answer's, as in sft.py
        steps = [our_step(base, args.config, seqs, starts, args.rank, False, args.dropout, share)
                 for share in (True, False)]
        if not args.without_peft:
            steps.append(peft_step(ref, ids, args.rank, args.dropout, mask, labels))
        first_losses = [step() for step in steps]
        timing = race(steps, device, args.steps)
        peaks = [step_peak_memory(step, device) for step in steps]
        lengths = [len(s) for s in seqs]
        packed = M.training_rows(seqs, device)[0]
        n_rows, in_rows, row_length = len(packed), sum(map(len, packed)), max(map(len, packed))
        shared = (f"{n_rows} shared row{'s' * (n_rows > 1)} of {row_length:,}" if n_rows < len(seqs)
                  else f"{n_rows} rows (none fit two sequences)")
        if in_rows < sum(lengths):
            shared += f", {in_rows:,} of {sum(lengths):,} tokens (prefixes shared)"
        # the reference: peft, else ours with a row per sequence (whose row then reads 1.00x)
        ref_i = 1 if args.without_peft else 2
        peft_seconds, peft_peak = (("-", "-") if args.without_peft else
                                   (f"{timing.best[2]:.3f}", f"{peaks[2] / 2**20:.0f}"))
        for i, (layout, real) in enumerate(((shared, in_rows / M.laid_out(packed)),
                                            (f"{len(seqs)} rows", sum(lengths) / M.laid_out(seqs)))):
            rows.append((dtype_name, f"{len(seqs)}, {min(lengths)} to {max(lengths)}",
                         f"{real:.0%}", layout,
                         f"{timing.best[i]:.3f}", peft_seconds,
                         *timing.ratio_cells(ref_i, i), f"{peaks[i] / 2**20:.0f}",
                         peft_peak, f"{peaks[i] / peaks[ref_i]:.2f}x",
                         f"{first_losses[i]:.4f} / {first_losses[ref_i]:.4f}"))
            print(" ".join(rows[-1]), flush=True)
        del steps, base, ref
    print()
    reference = "ours, a row each" if args.without_peft else "peft"
    print(markdown(["dtype", "sequences, tokens each", "real tokens", "ours", "ours s/step", "peft s/step",
                    f"speed ratio against {reference}", "its range", "ours peak MiB", "peft peak MiB",
                    f"memory ratio against {reference}", f"first loss ours / {reference}"], rows))


def training_step(compute_loss, optimizer):
    """One step as a function of no arguments: loss, backward, AdamW; returns the loss."""
    def step():
        loss = compute_loss()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout on both sides (sft.py's default: 0.05)")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each after one warm-up step, taken in turns")
    p.add_argument("--gsm8k-batch", type=int, default=0,
                   help="instead of --batch x --length: sft.py's first N GSM8K examples at their own lengths")
    p.add_argument("--group-size", type=int, default=1,
                   help="--gsm8k-batch as rl.py's: N questions, this many samples of each (sharing the question)")
    p.add_argument("--cuts", type=int, default=0,
                   help="--gsm8k-batch as opd.py's: each sample cut at this many points and continued by 32 tokens")
    p.add_argument("--without-peft", action="store_true",
                   help="--gsm8k-batch against ours with a row per sequence alone (peft at 16 GSM8K examples needs "
                        "more than 24 GB on the CPU)")
    p.add_argument("--data-dir", default=DATA,
                   help="GSM8K files for --gsm8k-batch (default: $STATES_DATA, else ../shared/data)")
    args = p.parse_args()
    device = setup(args)
    if args.gsm8k_batch:
        return ragged(args, device)
    rows, anatomy = [], []
    for dtype_name in args.dtypes.split(","):
        _, dtype = M.resolve_device(device, dtype_name)
        base, ref = build(args.config, dtype, device)
        ids = random_ids(args.config, (args.batch, args.length), seed=1).to(device)
        # ours first: peft wraps ref's modules in place
        seqs = ids.tolist()
        steps = [our_step(base, args.config, seqs, [1] * len(seqs), args.rank, recompute, args.dropout)
                 for recompute in (False, True)]
        steps.append(peft_step(ref, ids, args.rank, args.dropout))
        first_losses = [step() for step in steps]  # warm-up; creates the optimizer states, which all then hold
        products = products_alone(base, args.batch * args.length, backward=True)
        products()  # warm-up
        timing = race(steps + [products], device, args.steps)
        seconds = timing.best
        anatomy.append((dtype_name, f"{args.batch}x{args.length}", *(f"{seconds[i]:.4g}" for i in (0, 2, 3)),
                        f"{seconds[3] / seconds[0]:.0%}", f"{seconds[3] / seconds[2]:.0%}",
                        f"{seconds[2] / seconds[3]:.2f}x"))
        peaks = [step_peak_memory(step, device) for step in steps]
        for i, recompute in enumerate(("no", "yes")):
            rows.append((dtype_name, f"{args.batch}x{args.length}", recompute, f"{seconds[i]:.3f}", f"{seconds[2]:.3f}",
                         *timing.ratio_cells(2, i), f"{peaks[i] / 2**20:.0f}", f"{peaks[2] / 2**20:.0f}",
                         f"{peaks[i] / peaks[2]:.2f}x", f"{first_losses[i]:.4f} / {first_losses[2]:.4f}"))
            print(" ".join(rows[-1]), flush=True)
        del steps, products, base, ref
    print()
    print(markdown(["dtype", "batch", "recompute", "ours s/step", "peft s/step", "speed ratio", "speed ratio's range",
                    "ours peak MiB", "peft peak MiB", "memory ratio", "first loss ours / peft"], rows))
    print()
    print(markdown(["dtype", "batch", "ours s/step", "peft s/step", "products alone s", "products' share of ours",
                    "products' share of peft", "ceiling: peft / products"], anatomy))


if __name__ == "__main__":
    main()
