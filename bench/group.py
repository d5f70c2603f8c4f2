"""
Group sampling as rl.py does it: 8 prompts x 8 samples, 128 new tokens, temperature 1.
Ours prefills each prompt once and copies its KV cache to the 8 samples
(sample.generate(n=8)); transformers' generate(num_return_sequences=8) repeats each prompt
8 times and prefills all 64 rows. Same random Qwen3-0.6B-shape weights, both dtypes.
Prompts are random ids, 96 tokens by default: about the length of a zero-shot GSM8K
question in rl.py's format. Prints samples per second (each side's fastest round) and the
ratio (higher is better): the median over rounds of the ratio within a round, with its
range.

As in rl.py, the policy carries a LoRA adapter (rank 16 on all seven linear layers of
every block; --rank 0 for the plain model): ours from lora.add_lora, transformers' from
peft. Ours is timed as generate runs it, the adapter folded into a copy of the weights
(lora.folded_adapter), and with the adapter's own products (fold_adapter=False). Our
adapter's B matrices are random, so folding has something to fold.

Random weights never end a sample, so by default every row runs to the last token. Real
rollouts end at different lengths; with --finish-every K every token id divisible by K
ends its row on both sides (an end-of-text id for transformers, a stop string for ours),
so rows end after K tokens on average, at random. Each side then draws its own samples,
and the table gives both sides' mean length.

    python bench/group.py                 # each dtype in a process of its own
    python bench/group.py --dtypes bf16 --new-tokens 32
    python bench/group.py --dtypes bf16 --finish-every 64
"""
import argparse
import subprocess
import sys

import torch

from common import M, NoStopTokenizer, add_args, build, decode_modes, markdown, race, random_ids, setup
from sample import generate
import lora  # noqa: E402  (common put the repository on the path)


class EndsAtMultiples(NoStopTokenizer):
    """Decodes each id divisible by `every` to "|", the stop string the benchmark gives
    generate, and any other to a letter."""

    def __init__(self, every):
        self.every = every

    def decode(self, ids, skip_special_tokens=True):
        return "".join("|" if t % self.every == 0 else "a" for t in ids)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--modes", default=None, help="decode loops of ours to time, e.g. dropping,fixed "
                                                 "(default: graph,dropping on CUDA, dropping elsewhere)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the policy's adapter (0: no adapter)")
    p.add_argument("--repeats", type=int, default=1, help="timed rounds, implementations taking turns")
    p.add_argument("--finish-every", type=M.number(int, 0), default=0,
                   help="end a row at a token id divisible by this (0: no row ends before --new-tokens)")
    args = p.parse_args()
    dtype_names = args.dtypes.split(",")
    if len(dtype_names) > 1:
        # transformers' side holds about 20 GB at its peak on the CPU in bf16 (its prefill of 64
        # rows), and after an fp32 run in the same process a 24 GB machine killed it for memory:
        # each dtype runs in a process of its own, nothing of the one before resident
        for name in dtype_names:
            subprocess.run([sys.executable, sys.argv[0], *sys.argv[1:], "--dtypes", name], check=True)
        return
    device = setup(args)
    B, n, T = args.prompts, args.samples, args.new_tokens
    prompts = random_ids(args.config, (B, args.prompt_tokens), seed=0)
    ids = prompts.to(device)
    modes = decode_modes(device, args.modes)
    every = args.finish_every
    tokenizer, stop = (EndsAtMultiples(every), ("|",)) if every else (NoStopTokenizer(), ())
    # (decode loop, adapter folded): every loop folded as generate does by default, then the
    # first loop with the adapter's own products
    settings = [(mode, True) for mode in modes] + ([(modes[0], False)] if args.rank else [])
    rows = []
    for dtype_name in dtype_names:
        _, dtype = M.resolve_device(device, dtype_name)
        ours, ref = build(args.config, dtype, device)
        if args.rank:
            from peft import LoraConfig, get_peft_model
            lora.add_lora(ours, args.rank, 2 * args.rank)
            generator = torch.Generator(device).manual_seed(0)
            with torch.no_grad():  # B != 0, so that folding has something to fold
                for B_matrix in lora.lora_parameters(ours)[1::2]:
                    B_matrix.normal_(0, 0.01, generator=generator)
            ref = get_peft_model(ref, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                 target_modules=list(lora.TARGETS))).eval()
        ends = dict(eos_token_id=list(range(0, ours.config.vocab_size, every))) if every else \
            dict(eos_token_id=None, min_new_tokens=T)
        run_ref = lambda: ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                       num_return_sequences=n, temperature=1.0, top_k=0, top_p=1.0,
                                       max_new_tokens=T, pad_token_id=0, **ends)
        runs = [lambda mode=mode, fold=fold: generate(ours, tokenizer, prompts.tolist(), n=n, max_new_tokens=T,
                                                      temperature=1.0, seed=0, decode=mode, fold_adapter=fold, stop=stop)
                for mode, fold in settings]
        with torch.no_grad():
            # warm-up at a few tokens: kernels chosen, memory pools grown
            ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, num_return_sequences=n,
                         max_new_tokens=2, pad_token_id=0, eos_token_id=None)
            for mode, fold in settings:
                generate(ours, tokenizer, prompts.tolist(), n=n, max_new_tokens=2, seed=0, decode=mode,
                         fold_adapter=fold, stop=stop)
            timing = race([run_ref] + runs, device, args.repeats)
        (t_ref, *t_ours), (out_ref, *out_ours) = timing.best, timing.results
        new_ref = out_ref[:, args.prompt_tokens:]
        if every:
            # a row's first multiple of K is its end (transformers pads after it with pad id 0, a multiple too)
            ended = new_ref % every == 0
            ref_length = torch.where(ended.any(-1), ended.int().argmax(-1) + 1, T)
        else:
            assert new_ref.shape == (B * n, T)
            ref_length = torch.full((B * n,), T)
        for i, ((mode, fold), t, out) in enumerate(zip(settings, t_ours, out_ours), start=1):
            lengths = [len(r.completion_ids) for r in out]
            assert every or lengths == [T] * len(out)
            # same seeds, and folding changes the weights' rounding only, so every setting should
            # draw the same samples (in bf16 rounding can part a few)
            same = sum(a.completion_ids == b.completion_ids for a, b in zip(out_ours[0], out)) / len(out)
            adapter = f"rank {args.rank}, " + ("folded" if fold else "own products") if args.rank else "none"
            rows.append((dtype_name, f"{B}x{n}", T, f"{sum(lengths) / len(lengths):.0f} / {ref_length.float().mean():.0f}",
                         mode, adapter, f"{B * n / t:.2f}", f"{B * n / t_ref:.2f}",
                         *timing.ratio_cells(0, i), f"{same:.0%}"))
            print(*rows[-1], flush=True)
        del ours, ref
    print()
    print(markdown(["dtype", "prompts x samples", "new tokens", "mean length, ours / transformers", "ours: decode",
                    "adapter", "ours samples/s", "transformers samples/s", "ratio", "ratio's range",
                    "samples equal to the first row's"], rows))


if __name__ == "__main__":
    main()
