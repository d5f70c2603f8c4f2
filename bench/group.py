"""
Group sampling as rl.py does it: 8 prompts x 8 samples at temperature 1 from a policy with a
rank-16 LoRA adapter on all seven linear layers of every block. Ours prefills each prompt
once and copies its KV cache to its 8 samples (sample.Sampling(n=8)); transformers + peft
repeat each prompt 8 times and prefill 64 rows (generate(num_return_sequences=8)). Same
random Qwen3-0.6B-shape weights and the same adapter. Prints samples per second (each
side's fastest round) and the ratio ours / theirs (median over rounds, range). Each dtype
runs in a process of its own: transformers' 64-row prefill alone can take most of a
24 GB machine in bf16.

    python bench/group.py
    python bench/group.py --dtypes bf16 --new-tokens 32
    python bench/group.py --config out/toy/base-model --dtypes fp32   # the toy study's shape
"""
import argparse
import subprocess
import sys

import torch

from common import NoStopTokenizer, add_args, build, markdown, race, random_ids, ratio, setup
import lora  # noqa: E402  (common put the repository on the path)
from sample import Sampling, generate  # noqa: E402


def row_of(args, name, device):
    from peft import LoraConfig, get_peft_model
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
    ours, ref = build(args.config, dtype, device)
    lora.add_lora(ours, args.rank, 2 * args.rank)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B random too, so that the adapter changes the policy
        for p in lora.lora_parameters(ours):
            p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    theirs = get_peft_model(ref, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=list(lora.TARGETS)))
    lora_state = lora.adapter_state(ours)
    for n, p in theirs.named_parameters():
        if "lora_" in n:
            p.data = lora_state[n.replace(".default.", ".")].to(p.dtype).to(device)
    ours.eval(), theirs.eval()
    ids = random_ids(args.config, (args.prompts, args.prompt_tokens), seed=0).to(device)
    n, k = args.new_tokens, args.samples
    mine = lambda: generate(ours, NoStopTokenizer(), ids.tolist(), Sampling(n=k, max_new_tokens=n, temperature=1.0, seed=0))
    peft_side = lambda: theirs.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                        num_return_sequences=k, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                                        eos_token_id=None, top_k=0, top_p=1.0, temperature=1.0)
    with torch.no_grad():
        rounds, _ = race([peft_side, mine], device, args.repeats)
    best = [min(t) for t in zip(*rounds)]
    samples = args.prompts * k
    return (name, f"{args.prompts} x {k}", n, f"{samples / best[1]:.2f}", f"{samples / best[0]:.2f}", *ratio(rounds, 0, 1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=96, help="about a 0-shot GSM8K question in rl.py's format")
    p.add_argument("--rank", type=int, default=16)
    args, argv = p.parse_args(), sys.argv[1:]
    dtypes = args.dtypes.split(",")
    if len(dtypes) > 1:  # a process each
        for name in dtypes:
            subprocess.run([sys.executable, __file__, *argv, "--dtypes", name], check=True)
        return
    device = setup(args)
    header = ["dtype", "prompts x samples", "new tokens", "ours samples/s", "transformers + peft samples/s", "ratio",
              "ratio's range"]
    print(markdown(header, [row_of(args, dtypes[0], device)]), flush=True)


if __name__ == "__main__":
    main()
