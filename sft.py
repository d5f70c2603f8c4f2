"""
Supervised fine-tuning: off-policy state fitting.

State source:  fixed dataset trajectories, d_data. Every training state is a prefix of a
               GSM8K train solution, "Question: ...\\nAnswer:" plus the first t gold answer
               tokens; the learner's own behaviour never decides which states it sees.
Signal source: the gold next token at each of those states (cross-entropy on the answer
               tokens, the prompt masked, end-of-text appended so the model learns to stop).
--answers samples: rejection sampling (Yuan et al. 2023, arXiv 2308.01825): the same loss on
               the base's own right samples (--samples-per-prompt each, --max-new-tokens long).
--wrong-answers P: a share P of the gold answers given a wrong final number (P3's teacher).

Presets (docs/paper.md): `mild` (ours: the paper gives none) and `stress` (the paper's).

    python sft.py --preset stress               # -> out/stress
    python sft.py --preset mild --max-steps 20  # a short look
"""
import argparse
import math

import data
import lora
import model as M
import train
from plumbing import cli, processes, runs
from plumbing.files import InputError
from sample import Sampling, generate, tokens_before_stop

PRESETS = {"mild": dict(epochs=1, lr=1e-4, rank=16, alpha=32),
           "stress": dict(epochs=5, lr=5e-4, rank=64, alpha=128)}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="mild", help="flags override it")
    p.add_argument("--out", default=None, help="run folder (default: out/<preset>)")
    p.add_argument("--epochs", type=cli.number(float, 0, above=True), default=None)
    p.add_argument("--batch-size", type=cli.number(int, 1), default=16, help="sequences a step")
    p.add_argument("--max-length", type=cli.number(int, 2), default=512, help="longer ones cut")
    p.add_argument("--train-limit", type=cli.number(int, 0), default=0, help="first N (0: all)")
    p.add_argument("--answers", choices=["gold", "samples"], default="gold", help="(above)")
    p.add_argument("--samples-per-prompt", type=cli.number(int, 1), default=4, help="(above)")
    p.add_argument("--max-new-tokens", type=cli.number(int, 1), default=256, help="(above)")
    p.add_argument("--wrong-answers", type=cli.number(float, 0, most=1), default=0, help="(above)")
    cli.add_training_args(p, lr=None, rank=None, alpha=None, dropout=0.05)
    p.set_defaults(**PRESETS[p.parse_known_args(argv)[0].preset])  # a flag given still wins
    args = p.parse_args(argv)
    args.out = args.out or f"out/{args.preset}"
    return args


def main(argv=None):
    args = parse_args(argv)
    device, dtype = cli.resolve(args)
    run = runs.RunFolder(args.out, vars(args), lora)
    model, tok = M.load(args.model, device, dtype)
    optimizer = train.adapter_and_optimizer(model, args.rank, args.alpha, args.lora_dropout,
                                            args.lr, args.weight_decay, args.seed, args.recompute)

    # the state source: (prompt, answer + end-of-text) pairs, the dataset's or the base's own
    rows = data.load_gsm8k("train", args.data_dir)[:args.train_limit or None]  # 0: all
    gold = data.with_wrong_answers(rows, args.wrong_answers, args.seed)  # all right by default
    sampling = Sampling(n=args.samples_per_prompt, max_new_tokens=args.max_new_tokens,
                        temperature=1.0, stop=data.GSM8K_STOP, seed=args.seed)
    pairs = ([data.gsm8k_gold_ids(tok, r) for r in gold] if args.answers == "gold" else
             right_samples(model, tok, rows, sampling))
    examples = data.sft_examples(pairs, args.max_length)  # (ids, where the answer starts) each
    total = math.ceil(args.epochs * math.ceil(len(examples) / args.batch_size))  # the schedule
    passes = train.Passes(args.grad_accum, args.micro_batch_tokens)

    def loss_of(sequences, starts):  # the signal: cross-entropy on the gold next tokens
        logp, _ = train.sequence_logprobs(model, sequences, starts, tok.pad_id)
        return train.token_nll(logp)

    base_logp = {}  # example -> the base's log-probs of its answer: no step changes them
    for step in run.steps(model, optimizer, total, "sft"):
        picked = data.batch_indices(len(examples), step, args.batch_size, args.seed)
        picked = picked[slice(*processes.split(len(picked), "--batch-size"))]  # torchrun's share
        sequences, starts = [examples[i][0] for i in picked], [examples[i][1] for i in picked]

        model.train()
        loss, _, n_tokens = train.backward(loss_of, sequences, starts, passes)
        run.check_finite(step + 1, loss)
        lr, grad_norm = train.optimizer_step(optimizer, step, total, args.lr, args.warmup,
                                             args.grad_clip)
        norm = lora.cap_update_norm(model, args.max_update_norm)  # None: no --max-update-norm

        # SFT's states are dataset prefixes: their NLL under the learner is the loss itself
        new = [i for i in picked if i not in base_logp]
        seqs, sts = [examples[i][0] for i in new], [examples[i][1] for i in new]
        base_logp.update(zip(new, train.base_logprobs(model, seqs, sts, tok.pad_id, passes)))
        run.log(dict(step=step + 1, epoch=step * args.batch_size / len(examples), loss=loss,
                     state_nll=loss, lr=lr, grad_norm=grad_norm, tokens=n_tokens,
                     update_norm=norm),
                state_nll_base=train.base_nll([base_logp[i] for i in picked]))
    print(f"done: adapter in {args.out}")


def right_samples(model, tok, rows, sampling):
    """(prompt, answer + end-of-text) ids of the base's right samples (sampling.n a row), cut
    at a stop."""
    prompts = [data.gsm8k_prompt(r["question"]) for r in rows]
    with lora.use_adapter(model.eval(), None):
        drawn = generate(model, tok, prompts, sampling)
    right = [r for r in drawn if data.is_correct(r.text, rows[r.prompt_index]["gold"])]  # RL's
    print(f"--answers samples: {len(right)} of {len(drawn)} samples right")
    if not right:
        raise InputError("no sample of the base is right; raise --samples-per-prompt")
    answers = [tokens_before_stop(tok, r.completion_ids, data.GSM8K_STOP) for r in right]
    return [(r.prompt_ids, [t for t in a if t != tok.eos_id] + [tok.eos_id])
            for r, a in zip(right, answers)]


if __name__ == "__main__":
    cli.run_script(main, cli.MEMORY_FIX)
