"""What every benchmark shares: the reference model built from the official Qwen3-0.6B
config with random weights, our model on the very same tensors, and timing that waits for
the device and pairs the implementations round by round. Benchmarks print tables; they
never pass or fail."""
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import model as M  # noqa: E402

CONFIG = os.path.join(ROOT, "..", "shared", "qwen3-0.6b-base")
# the dataset files (bench/mmlu.py, bench/train_step.py --gsm8k-batch): $STATES_DATA, else the offline copies
DATA = os.environ.get("STATES_DATA") or os.path.join(ROOT, "..", "shared", "data")


class NoStopTokenizer:
    """Ids in, ids out; an end-of-text id that random weights never produce, so both
    implementations decode exactly the same number of tokens."""
    eos_id, pad_id = -1, 0

    def decode(self, ids, skip_special_tokens=True):
        return ""


def add_args(p, dtypes="fp32,bf16"):
    p.add_argument("--config", default=CONFIG, help="folder with the official Qwen3-0.6B config.json")
    p.add_argument("--dtypes", default=dtypes, help="comma-separated: fp32, bf16")
    p.add_argument("--device", default=None, help="cuda or cpu (default: $STATES_DEVICE, else cuda when present)")


def setup(args):
    if not os.path.isfile(os.path.join(args.config, "config.json")):
        raise SystemExit(f"{args.config}: no config.json; pass --config with the folder holding Qwen3-0.6B's config.json")
    device, _ = M.resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"device {device} ({name}), torch {torch.__version__}", flush=True)
    return device


def build(config_dir, dtype, device, seed=0):
    """transformers' Qwen3ForCausalLM with random weights, and ours on the same values
    (see ours_on)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):  # random init where the model lives: seconds on a GPU, not a minute
        ref = Qwen3ForCausalLM(Qwen3Config.from_pretrained(config_dir))
    ref = ref.to(dtype).eval()
    return ours_on(ref, config_dir), ref


def ours_on(ref, config_dir):
    """Our model reading the tensors of model ref (transformers' or ours; the names are the
    same): the very same tensors where the memory layouts agree, else its own copy laid
    out as model.load() lays it out (column-major on the CPU in fp32 where MKL multiplies,
    see model.lay_out_weights), as a user gets it."""
    with torch.device("meta"):
        ours = M.Qwen3(M.read_config(config_dir))
    M.load_weights(ours, dict(ref.state_dict()), "reference model")
    return ours.eval()


def products_alone(model, rows, backward=False):
    """The products with the model's weights and nothing else, as a function of no
    arguments: every linear layer, the output layer included, applied to `rows` states of
    its input width (a decode step's products at rows = batch) and, with backward, also
    the product that carries a gradient of its output width to its input (a frozen-weight
    training step's products at rows = tokens). Forward products take the form sample.generate
    gives them: packed and stacked where M.packed_weights applies (bf16 on the CPU, fp32 on
    AMD CPUs), through model.linear elsewhere."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    w = model.lm_head.weight
    widths = {n for m in linears for n in ((m.in_features, m.out_features) if backward else (m.in_features,))}
    states = {n: torch.randn(rows, n, dtype=w.dtype, device=w.device) for n in widths}
    packed = []
    if not backward and M.can_pack(w):
        packed = [M.PackedWeights(*layers) for named in M.packing_groups(model).values() for layers in named.values()]
        linears = []

    @torch.no_grad()
    def run():
        for group in packed:
            group(states[group.layers[0].in_features])
        for m in linears:
            M.linear(states[m.in_features], m.weight, m.bias)
            if backward:  # the input's gradient, in the form the step computes it
                if M.fp32_by_onednn(m.weight):
                    M.onednn_product(states[m.out_features], m.weight.t())
                else:
                    states[m.out_features] @ m.weight
    return run


def decode_modes(device, given=None):
    """Which of sample.generate's decode loops a benchmark times: the given comma-separated
    list, else the captured graph and the eager loop on CUDA, the eager loop elsewhere."""
    return given.split(",") if given else ["graph", "dropping"] if device.type == "cuda" else ["dropping"]


def random_ids(config_dir, shape, seed):
    """Token ids for random-weight models: any id in the vocabulary will do."""
    return torch.randint(0, M.read_config(config_dir).vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats=1):
    """Best wall time of `repeats` calls (after the caller's warm-up), and the last result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


class Race:
    """What race() measured: rounds[r][i] is function i's seconds in round r, and results[i]
    function i's last result."""

    def __init__(self, rounds, results):
        self.rounds, self.results = rounds, results

    @property
    def best(self):
        """Each function's fastest round."""
        return [min(times) for times in zip(*self.rounds)]

    def ratio(self, slow, fast):
        """How many times faster function `fast` ran than function `slow`: the median over
        rounds of the two's ratio within a round, and the lowest and highest of those
        ratios. Within a round the two ran one soon after the other, so a slow spell of a
        shared machine (a 2-core cloud machine's speed can swing twofold within a minute)
        mostly slows both sides of that round's ratio, where it moves a ratio of each side's
        best time taken from different rounds."""
        ratios = sorted(times[slow] / times[fast] for times in self.rounds)
        return statistics.median(ratios), ratios[0], ratios[-1]

    def ratio_cells(self, slow, fast):
        """ratio() as two table cells: the median, and the range over rounds."""
        median, low, high = self.ratio(slow, fast)
        return f"{median:.2f}x", f"{low:.2f}x to {high:.2f}x"


def race(fns, device, repeats=3):
    """Time each function in each of `repeats` rounds, the functions taking turns within a
    round so that a slow spell of a shared machine hits all of them, in the given order in
    even rounds and in reverse in odd ones, so that no function always runs in the wake of
    the same one (its leftover memory, its cache contents). Call each once beforehand to
    warm up. Returns a Race."""
    rounds, results = [], [None] * len(fns)
    for r in range(repeats):
        times = [None] * len(fns)
        for i in (range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))):
            times[i], results[i] = timed(fns[i], device)
        rounds.append(times)
    return Race(rounds, results)


def step_peak_memory(step, device):
    """Most bytes held at once during one step beyond what was held before it (activations,
    logits, gradients, temporaries). CUDA: the caching allocator's own count. CPU: the
    running sum of every allocation and free the profiler records (the resident set would
    count memory that malloc keeps after a free)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # each allocation (+bytes) and free (-bytes) at its own time. The per-operator sums of
    # prof.events() would book a free made inside an operator at the operator's start,
    # before its children's allocations, and so miss what a custom autograd Function
    # (HeadLogprob) allocates and frees within its forward.
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    held = peak = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return peak


def markdown(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
