"""
MMLU scoring: 100 test questions (4 choices, 5-shot prompts in lm-evaluation-harness's
format, stratified over subjects as evaluate.py picks them) scored by
evaluate.score_choices, which runs each prompt once and copies its KV cache to the four
continuations, against the per-choice way of lm-evaluation-harness: each
prompt-plus-choice string is its own sequence through transformers' Qwen3ForCausalLM,
batched, with logits only for the continuation tokens. Same random Qwen3-0.6B-shape
weights. The real MMLU files are read from --data-dir (default $STATES_DATA, else
../shared/data); the Qwen tokenizer cannot be fetched here, so a BPE tokenizer is trained
on those files (vocabulary 16,384; prompts come out about as long as with Qwen's).
Prints questions per second, the ratio (higher is better) and the largest difference
between the two sets of log-likelihoods.

    python bench/mmlu.py
    python bench/mmlu.py --dtypes bf16 --questions 20
"""
import argparse
import os
import tempfile

import torch

from common import DATA, M, add_args, build, markdown, setup, timed
import data  # noqa: E402  (common put the repository on the path)
from evaluate import score_choices  # noqa: E402


def per_choice_loop(ref, tok, contexts, choices, batch_size):
    """Every (context, choice) pair as its own full sequence, the way lm-evaluation-harness
    scores multiple choice. Left-padded, so every continuation ends in the last column and
    transformers' logits_to_keep returns logits for the continuations only: the loop
    differs from score_choices in running each prompt once per choice, and in nothing else
    that costs time or memory."""
    device = ref.device
    requests = []
    for ctx, opts in zip(contexts, choices):
        n_ctx = len(tok.encode(ctx))
        for whole in tok.encode_batch([ctx + o for o in opts]):
            requests.append((whole, len(whole) - n_ctx))
    sums = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        ids, mask = M.left_pad([w for w, _ in batch], tok.pad_id, device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max(n for _, n in batch) + 1
        logits = ref(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep).logits
        logp = logits[:, :-1].float().log_softmax(-1)  # the state before each of the last keep-1 tokens
        for row, (whole, n_cont) in enumerate(batch):
            targets = torch.tensor(whole[-n_cont:], device=device)
            sums.append(logp[row, -n_cont:].gather(-1, targets[:, None]).sum().item())
    return [sums[i:i + len(c)] for i, c in zip(range(0, len(sums), 4), choices)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--data-dir", default=DATA)
    p.add_argument("--questions", type=int, default=100)
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--scoring", default="letter", choices=["letter", "text"])
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch for ours; sequences per batch for the loop")
    args = p.parse_args()
    device = setup(args)
    dev, test = data.load_mmlu("dev", args.data_dir), data.load_mmlu("test", args.data_dir)
    rows = data.mmlu_subset(test, args.questions)
    contexts = [data.mmlu_prompt(r, dev[r["subject"]][:args.shots]) for r in rows]
    choices = [data.mmlu_continuations(r, args.scoring) for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        texts = contexts + [q for rs in dev.values() for q in map(data.mmlu_question, rs)]
        vocab = min(16384, M.read_config(args.config).vocab_size)  # ids must exist in the model's vocabulary
        tok = M.Tokenizer(M.train_tokenizer(texts, os.path.join(tmp, "tokenizer.json"), vocab_size=vocab), eos_id=0)
    lengths = [len(tok.encode(c)) for c in contexts]
    print(f"{len(rows)} questions, prompts {min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.0f})")
    table = []
    for dtype_name in args.dtypes.split(","):
        _, dtype = M.resolve_device(device, dtype_name)
        ours, ref = build(args.config, dtype, device)
        with torch.no_grad():
            score_choices(ours, tok, contexts[:2], choices[:2], args.batch_size)  # warm-up
            per_choice_loop(ref, tok, contexts[:2], choices[:2], args.batch_size)
            t_ours, ll_ours = timed(lambda: score_choices(ours, tok, contexts, choices, args.batch_size), device)
            t_ref, ll_ref = timed(lambda: per_choice_loop(ref, tok, contexts, choices, args.batch_size), device)
        diff = max(abs(a - b) for x, y in zip(ll_ours, ll_ref) for a, b in zip(x, y))
        table.append((dtype_name, len(rows), args.scoring, f"{len(rows) / t_ours:.2f}", f"{len(rows) / t_ref:.2f}",
                      f"{t_ref / t_ours:.2f}x", f"{diff:.3g}"))
        print(" ".join(map(str, table[-1])), flush=True)
        del ours, ref
    print()
    print(markdown(["dtype", "questions", "scoring", "ours q/s", "per-choice loop q/s", "ratio", "max |Δ loglik|"], table))


if __name__ == "__main__":
    main()
