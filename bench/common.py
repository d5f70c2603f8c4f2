"""What the benchmarks share: transformers' Qwen3 with random weights of the official
Qwen3-0.6B shape, ours reading the very same tensors, and timing that takes turns between
the implementations round by round, so that a slow spell of a shared machine slows both
sides of a round's ratio. Benchmarks print tables; they never pass or fail."""
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import model as M  # noqa: E402
from plumbing import cli  # noqa: E402

CONFIG = os.path.join(ROOT, "tests", "qwen3-0.6b-base")  # Qwen3-0.6B-Base's config.json


class NoStopTokenizer:
    """Ids in, ids out, and an end-of-text id that no model produces: both implementations
    decode exactly as many tokens."""
    eos_id, pad_id = -1, 0

    def decode(self, ids, skip_special_tokens=True):
        return ""


def add_args(p, dtypes="fp32,bf16"):
    p.add_argument("--config", default=CONFIG, help="folder with the config.json of the shape to build")
    p.add_argument("--dtypes", default=dtypes, help="comma-separated: fp32, bf16")
    p.add_argument("--device", default=None, help="cuda or cpu (default: $STATES_DEVICE, else cuda when present)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds, the implementations taking turns")


def setup(args):
    device, _ = cli.resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"device {device} ({name}), torch {torch.__version__}", flush=True)
    return device


def build(config_dir, dtype, device, seed=0):
    """(ours, transformers') on the same random weights, in dtype on device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        ref = Qwen3ForCausalLM(Qwen3Config.from_pretrained(config_dir)).to(dtype).eval()
    return ours_on(ref, config_dir), ref.requires_grad_(False)


def ours_on(ref, config_dir):
    """Our model reading the very tensors of transformers' model ref: no copy."""
    with torch.device("meta"):
        ours = M.Qwen3(M.read_config(config_dir))
    M.load_weights(ours, dict(ref.state_dict()), "the reference model")
    return ours.eval().requires_grad_(False)


def random_ids(config_dir, shape, seed):
    return torch.randint(0, M.read_config(config_dir).vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def race(fns, device, repeats):
    """Each function once to warm up, then `repeats` rounds in which they take turns (in
    reverse order every other round). Returns (seconds[round][function], last results)."""
    results = [fn() for fn in fns]
    rounds = []
    for r in range(repeats):
        times = [None] * len(fns)
        for i in (range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))):
            synchronize(device)
            t0 = time.perf_counter()
            results[i] = fns[i]()
            synchronize(device)
            times[i] = time.perf_counter() - t0
        rounds.append(times)
    return rounds, results


def ratio(rounds, slow, fast):
    """How many times faster function `fast` ran than `slow`: the median over rounds of the
    ratio within a round, and its range, as two table cells."""
    ratios = sorted(times[slow] / times[fast] for times in rounds)
    return f"{statistics.median(ratios):.2f}x", f"{ratios[0]:.2f}x to {ratios[-1]:.2f}x"


def peak_memory(step, device):
    """The most bytes held at once during step() beyond what was held before it. CUDA: the
    allocator's count. CPU: the running sum of every allocation and free the profiler
    records (the resident set would count memory that malloc keeps after a free)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    held = peak = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return peak


def markdown(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])
