"""
Supervised fine-tuning: off-policy state fitting.

State source:  fixed dataset trajectories, d_data. Every training state is a prefix of a
               GSM8K train solution, "Question: ...\\nAnswer:" plus the first t gold answer
               tokens; the learner's own behaviour never decides which states it sees.
Signal source: the gold next token at each of those states (cross-entropy on the answer
               tokens only; the prompt is masked; end-of-text appended so the model learns
               to stop).

Presets (docs/paper.md): `mild` (1 epoch, lr 1e-4, rank 16, alpha 32; this project's
choice, the paper gives none) and `stress` (the paper's 5 epochs, lr 5e-4, rank 64,
alpha 128). Any flag overrides its preset's value.

    python sft.py --preset stress               # -> out/stress
    python sft.py --preset mild --max-steps 20  # a short look
"""
import argparse
import math
import time

import torch
from tqdm import tqdm

import data
import lora
import model as M
import runs

PRESETS = {
    "mild": dict(epochs=1, lr=1e-4, rank=16, alpha=32),
    "stress": dict(epochs=5, lr=5e-4, rank=64, alpha=128),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="mild", help="hyperparameter set; flags override it")
    p.add_argument("--out", default=None, help="run folder (default: out/<preset>)")
    p.add_argument("--epochs", type=runs.number(float, 0, above=True), default=None, help="passes over the training set")
    p.add_argument("--batch-size", type=runs.number(int, 1), default=16, help="sequences per optimizer step")
    p.add_argument("--max-length", type=runs.number(int, 2), default=512,
                   help="longest training sequence in tokens (longer ones are cut)")
    p.add_argument("--train-limit", type=runs.number(int, 0), default=0,
                   help="use the first N GSM8K train examples (0 = all 7,473)")
    runs.add_training_args(p, lr=None, rank=None, alpha=None, dropout=0.05)
    preset = p.parse_known_args(argv)[0].preset
    p.set_defaults(**PRESETS[preset])  # a flag given on the command line still wins
    args = p.parse_args(argv)
    args.out = args.out or f"out/{preset}"
    return args


def sft_loss(token_logprobs):
    """(loss, metrics): mean NLL over the answer tokens given (the caller weighs each
    micro-batch by its share of the step's tokens, so every token of a step weighs the same)."""
    nll = -token_logprobs
    return nll.mean(), dict(tokens=nll.numel())


def main(argv=None):
    args = parse_args(argv)
    runs.model_and_data_from(args, args.out if args.resume else None)
    print(vars(args))
    device, dtype = runs.device_from_args(args)
    run = runs.RunFolder(args.out, args)
    model, tok = M.load(args.model, device, dtype)
    torch.manual_seed(args.seed)  # the initial LoRA A matrices
    lora.add_lora(model, args.rank, args.alpha, args.lora_dropout)
    model.recompute = args.recompute

    # the state source: (prompt, gold answer + end-of-text) pairs from the dataset
    rows = data.load_gsm8k("train", args.data_dir)
    rows = rows[:args.train_limit] if args.train_limit > 0 else rows
    examples = []
    for r in rows:
        prompt_ids, answer_ids = data.gsm8k_gold_ids(tok, r)
        examples.append(((prompt_ids + answer_ids)[:args.max_length], len(prompt_ids)))
    kept = [e for e in examples if e[1] < len(e[0])]  # a prompt that fills --max-length leaves nothing to learn
    if not kept:
        raise M.InputError(f"--max-length {args.max_length} cuts every example before its answer (the shortest prompt "
                           f"has {min(p for _, p in examples)} tokens); raise it")
    if len(kept) < len(examples):
        print(f"left out {len(examples) - len(kept)} of {len(examples)} examples whose prompt fills --max-length")
    examples = kept
    steps_per_epoch = math.ceil(len(examples) / args.batch_size)
    total = math.ceil(args.epochs * steps_per_epoch)  # the schedule's length; --max-steps only stops early
    end = min(total, args.max_steps) if args.max_steps else total

    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr, weight_decay=args.weight_decay)
    start = run.resume(model, optimizer) if args.resume else 0
    bar = tqdm(range(start, end), initial=start, total=end, desc="sft", disable=runs.RANK > 0)
    with run.stop_between_steps():  # a stop signal ends the run after a whole step, saved
        for step in bar:
            t0 = time.time()
            torch.manual_seed(args.seed * 1_000_003 + step)  # dropout; per step, so a resumed run matches
            batch = [examples[i] for i in data.batch_indices(len(examples), step, args.batch_size, args.seed)]
            n_tokens = sum(len(s) - p for s, p in batch)
            batch = batch[slice(*runs.split(len(batch), "--batch-size"))]  # under torchrun, this process's share

            model.train()
            loss_sum = 0.0
            for part in runs.micro_batches([len(s) for s, _ in batch], args.grad_accum, args.micro_batch_tokens):
                logp, _ = runs.sequence_logprobs(model, [batch[i][0] for i in part], [batch[i][1] for i in part],
                                              tok.pad_id)
                loss, _ = sft_loss(logp)
                (loss * logp.numel() / n_tokens).backward()  # token-weighted over the whole step
                loss_sum += loss.item() * logp.numel()
            loss = runs.summed(loss_sum)[0] / n_tokens
            run.check_finite(step + 1, loss)
            lr, grad_norm = runs.optimizer_step(optimizer, step, total, args)

            # the states SFT trains on are dataset prefixes, so their NLL under the learner is the loss itself
            run.log(dict(step=step + 1, epoch=step * args.batch_size / len(examples), loss=loss, state_nll=loss,
                         lr=lr, grad_norm=grad_norm, tokens=n_tokens, seconds=time.time() - t0))
            bar.set_postfix(loss=f"{loss:.4f}")
            run.end_step(model, optimizer, step + 1, end)
    run.finish(end)
    print(f"done: adapter in {args.out}")


if __name__ == "__main__":
    runs.run_script(main, runs.MEMORY_FIX)
