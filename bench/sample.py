"""
Decode speed of sample.generate against transformers' generate: same random weights with
the exact Qwen3-0.6B shape (shared in memory, not copied), greedy, 64 new tokens, batch 1
and 8, fp32 and bf16, on whatever device is present. Prints a table with the ratio
(ours / transformers tokens per second; higher is better). Not a test: nothing fails.

    python bench/sample.py                 # all four settings
    python bench/sample.py --dtypes bf16 --batches 8 --new-tokens 32
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
from sample import generate  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "qwen3-0.6b-base")


class NoStopTokenizer:
    """Ids in, ids out; an end-of-text id that random weights never produce, so both
    implementations decode exactly the same number of tokens."""
    eos_id, pad_id = -1, 0

    def decode(self, ids, skip_special_tokens=True):
        return ""


def build(config_dir, dtype, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    ref = Qwen3ForCausalLM(Qwen3Config.from_pretrained(config_dir)).to(device=device, dtype=dtype).eval()
    ours_cfg = M.read_config(config_dir)
    with torch.device("meta"):
        ours = M.Qwen3(ours_cfg)
    # the same tensors back both models: identical weights, no second copy in memory
    M.load_weights(ours, {k: v for k, v in ref.state_dict().items()}, "transformers model")
    return ours.eval(), ref


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG, help="folder with the official config.json")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--device", default=None)
    args = p.parse_args()
    device, _ = M.resolve_device(args.device)
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    rows = []
    for dtype_name in args.dtypes.split(","):
        _, dtype = M.resolve_device(device, dtype_name)
        torch.manual_seed(0)
        ours, ref = build(args.config, dtype, device)
        for B in map(int, args.batches.split(",")):
            g = torch.Generator().manual_seed(B)
            prompts = torch.randint(1000, 100000, (B, args.prompt_tokens), generator=g)
            ids = prompts.to(device)
            n = args.new_tokens
            run_ref = lambda: ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
            run_ours = lambda: generate(ours, NoStopTokenizer(), prompts.tolist(), max_new_tokens=n, temperature=0)
            with torch.no_grad():
                run_ref(), run_ours()  # warm-up
                t_ref, out_ref = timed(run_ref, device)
                t_ours, out_ours = timed(run_ours, device)
            same = [r.completion_ids for r in out_ours] == out_ref[:, args.prompt_tokens:].tolist()
            rows.append((dtype_name, B, B * n / t_ours, B * n / t_ref, t_ref / t_ours, same))
            print(f"{dtype_name} batch {B}: ours {B * n / t_ours:.1f} tok/s, transformers {B * n / t_ref:.1f} tok/s", flush=True)
        del ours, ref
    print("\n| dtype | batch | ours tok/s | transformers tok/s | ratio | same tokens |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f}x | {'yes' if r[5] else 'no'} |")


if __name__ == "__main__":
    main()
