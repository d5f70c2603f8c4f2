"""
One LoRA training step against transformers + peft: a batch of 4 x 256 tokens, rank 16 on
all seven linear layers of every block, forward, backward and an AdamW step, on the same
random Qwen3-0.6B-shape weights. Ours is what the training scripts run: hidden states from
the model, then log-probs a chunk of states at a time (model.token_logprobs), never the
(tokens, 151,936) logits; once as by default and once with --recompute. The reference is
peft's get_peft_model on Qwen3ForCausalLM with labels, transformers' own loss. Prints each
one's fastest step, the speed ratio peft / ours (median over rounds, range), the peak
memory of a step beyond what was held before it, and the first-step losses, which agree
(LoRA's B starts at zero, so all three see the base model).

    python bench/train_step.py
    python bench/train_step.py --dtypes bf16 --repeats 2
"""
import argparse

import torch

from common import add_args, build, markdown, ours_on, peak_memory, race, random_ids, ratio, setup
import lora  # noqa: E402  (common put the repository on the path)
import train  # noqa: E402


def adam_step(loss_fn, params):
    """A training step: loss_fn(), backward, an AdamW step; returns the loss."""
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step():
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def our_step(model, ids, recompute, dropout):
    """An adapter on our model, and its training step as the scripts take it."""
    torch.manual_seed(0)
    lora.add_lora(model, 16, 32, dropout)
    model.train()
    model.recompute = recompute
    sequences = ids.tolist()
    return adam_step(lambda: -train.sequence_logprobs(model, sequences, [1] * len(sequences))[0].mean(),
                     lora.lora_parameters(model))


def peft_step(ref, ids, dropout):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = get_peft_model(ref, LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=list(lora.TARGETS)))
    model.train()
    return adam_step(lambda: model(input_ids=ids, labels=ids).loss, [p for p in model.parameters() if p.requires_grad])


def rows_of(args, name, device):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
    ours, ref = build(args.config, dtype, device)
    recomputing = ours_on(ref, args.config)  # before peft wraps ref's layers
    ids = random_ids(args.config, (args.batch, args.length), seed=0).to(device)
    steps = {"transformers + peft": peft_step(ref, ids, args.dropout), "ours": our_step(ours, ids, False, args.dropout),
             "ours --recompute": our_step(recomputing, ids, True, args.dropout)}
    first = {k: step() for k, step in steps.items()}  # the first step, of the base model
    memory = {k: peak_memory(step, device) for k, step in steps.items()}
    rounds, _ = race(list(steps.values()), device, args.repeats)
    best = [min(t) for t in zip(*rounds)]
    rows = []
    for i, k in enumerate(steps):
        speed = ratio(rounds, 0, i) if i else ("1.00x", "-")
        rows.append((name, k, f"{best[i]:.2f}", *speed, f"{memory[k] / 2 ** 30:.2f}",
                     f"{memory[k] / memory['transformers + peft']:.2f}x", f"{first[k]:.4f}"))
        print(*rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (sft.py's is 0.05)")
    args = p.parse_args()
    device = setup(args)
    rows = [row for name in args.dtypes.split(",") for row in rows_of(args, name, device)]
    print()
    print(markdown(["dtype", "step", "fastest s", "speed vs peft", "range", "peak GiB", "memory vs peft",
                    "first loss"], rows))


if __name__ == "__main__":
    main()
