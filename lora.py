"""
Hand-rolled LoRA (Hu et al. 2021, arXiv 2106.09685): y = W x + (alpha / r) * B A dropout(x),
A Kaiming-uniform, B zero, so a fresh adapter leaves the model unchanged.

A LoRALinear keeps the base layer's `weight` (and `bias`) under their own names, so the
base state dict is untouched, and holds any number of named adapters beside it. One
adapter (or none) is active at a time for the whole model: a teacher (base + its adapter)
and a student (base + another) share one copy of the frozen base weights.

Files are PEFT's format (adapter_config.json + adapter_model.safetensors with keys like
base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight), so
peft.PeftModel.from_pretrained opens our adapters and load_adapter opens theirs.
"""
import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import InputError, laid_out, linear, number, read_json, read_safetensors_file, training_rows

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.lora_A = nn.ParameterDict()  # name -> (r, in)
        self.lora_B = nn.ParameterDict()  # name -> (out, r)
        self.dropout = {}  # name -> p; applied with this layer's train/eval mode
        self.scaling = {}
        self.active = None  # name of the adapter in use, or None for the plain base
        self.merged = None  # name of the adapter folded into weight, if any

    def add(self, name, rank, alpha, dropout):
        if not name.isidentifier() or hasattr(nn.ParameterDict, name):
            raise ValueError(f"adapter name {name!r} is not allowed; use a plain identifier such as 'teacher'")
        A = torch.empty(rank, self.in_features, device=self.weight.device, dtype=torch.float32)
        nn.init.kaiming_uniform_(A, a=math.sqrt(5))  # same init as nn.Linear and PEFT
        self.lora_A[name] = nn.Parameter(A)
        self.lora_B[name] = nn.Parameter(torch.zeros(self.out_features, rank, device=self.weight.device))
        self.dropout[name] = dropout
        self.scaling[name] = alpha / rank

    def delta_weight(self, name):
        return (self.lora_B[name] @ self.lora_A[name]) * self.scaling[name]  # (out, in)

    def forward(self, x):
        y = linear(x, self.weight, self.bias)
        name = self.active
        if name is None or name == self.merged:
            return y
        # LoRA parameters stay fp32 (the optimizer state too). Their products run in the
        # activations' dtype, like every other product in the model: casting two (rank, in)
        # matrices is cheap, casting the (tokens, in) activations would not be, and its fp32
        # copy would be kept for the backward pass
        A, B = self.lora_A[name].to(x.dtype), self.lora_B[name].to(x.dtype)
        p = self.dropout[name]
        # (dropout at p=0 would still copy x)
        down = DroppedDown.apply(x, A, p) if p > 0 and self.training else F.linear(x, A)
        # scale the (tokens, rank) product rather than the (tokens, out) one: the same result
        # for an elementwise pass over rank columns instead of out, forward and backward
        return y + F.linear(down * self.scaling[name], B)

    @torch.no_grad()
    def merge(self):
        if self.active is None or self.merged is not None:
            return
        self.weight += self.delta_weight(self.active).to(self.weight.dtype)
        self.merged = self.active

    @torch.no_grad()
    def unmerge(self):
        if self.merged is None:
            return
        self.weight -= self.delta_weight(self.merged).to(self.weight.dtype)
        self.merged = None

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, adapters={list(self.lora_A)}, active={self.active}"


def lora_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def wrap(model, targets=TARGETS):
    """Replace the targeted nn.Linear layers of every block by LoRALinear (idempotent)."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                wrapped = LoRALinear(child)
                wrapped.train(child.training)  # a new module starts in train mode; keep the model's mode
                setattr(module, child_name, wrapped)
    return lora_layers(model)


def keep_mask(x, p):
    """A bool tensor of x's shape, each element True with probability 1 - p, independently:
    where dropout keeps its input. Each element compares 32 random bits with p's share of
    2^32 (1 - p to within 2^-32), the bits taken 64 at a time from the device's default
    generator. torch's bernoulli_, which F.dropout draws with, took 2.2 to 2.4 times as
    long on the CPU (at 1,024 x 1,024 and 1,024 x 3,072), and at sft.py's dropout a
    Qwen3-0.6B step draws 10 million elements a layer: its bf16 step over 4 x 256 tokens
    took a fifth less time with this mask (bench/README.md)."""
    n = x.numel()
    words = torch.empty((n + 1) // 2, dtype=torch.int64, device=x.device).random_(-2**63, None)  # every bit random
    dropped_below = min(-2**31 + round(p * 2**32), 2**31 - 1)  # an int32 (p under 1 - 2^-33 never needs the cap)
    return (words.view(torch.int32)[:n] >= dropped_below).view(x.shape)


class DroppedDown(torch.autograd.Function):
    """LoRA's down product over dropped-out inputs, F.linear(F.dropout(x, p), A), keeping for
    the backward pass x, which the down products without dropout keep too (q, k and v share
    it), and a one-byte mask (keep_mask). Autograd would also keep the dropped copy of x
    and the dropout's noise: a Qwen3-0.6B step in bf16 at SFT's dropout of 0.05 kept 2.06
    MiB per token that way, 1.52 this way, 1.24 without dropout. The noise takes the values
    F.dropout's does (1 / (1 - p) rounded to x's dtype, or 0), and both gradients are formed
    as autograd forms them, so for the same mask they are the same to the bit."""

    @staticmethod
    def forward(ctx, x, A, p):
        kept = keep_mask(x, p)
        ctx.scale = torch.ones((), dtype=x.dtype, device=x.device).div_(1 - p)
        # under autocast (CUDA training) the product ran in its dtype: so must the backward's
        ctx.autocast = dict(device_type=x.device.type, enabled=torch.is_autocast_enabled(x.device.type),
                            dtype=torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(x, kept, A)
        return F.linear(x * (kept * ctx.scale), A)

    @staticmethod
    def backward(ctx, grad):
        x, kept, A = ctx.saved_tensors
        noise = kept * ctx.scale
        grad = grad.reshape(-1, grad.shape[-1])  # (tokens, rank)
        with torch.autocast(**ctx.autocast):
            d_x = grad.mm(A).view(x.shape) * noise if ctx.needs_input_grad[0] else None
            d_A = grad.t().mm((x * noise).reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return d_x, d_A, None


def add_lora(model, rank=16, alpha=32, dropout=0.0, targets=TARGETS, name="default", activate=True):
    """Add a fresh adapter named `name` to the targeted layers; afterwards only the
    parameters of that adapter require grad."""
    layers = {n: m for n, m in wrap(model, targets).items() if n.rsplit(".", 1)[-1] in targets}
    if not layers:
        raise ValueError(f"no linear layer named any of {targets} in the model")
    for layer in layers.values():
        if name in layer.lora_A:
            raise ValueError(f"adapter {name!r} exists already; pick another name")
        layer.add(name, rank, alpha, dropout)
    model.requires_grad_(False)
    for layer in layers.values():
        layer.lora_A[name].requires_grad_(True)
        layer.lora_B[name].requires_grad_(True)
    model.lora_config = getattr(model, "lora_config", {})
    model.lora_config[name] = dict(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=sorted(
        {n.rsplit(".", 1)[-1] for n in layers}))
    if activate:
        set_adapter(model, name)
    return model


def set_adapter(model, name):
    """Make `name` the adapter in use everywhere; None means the plain base model."""
    for layer in lora_layers(model).values():
        if layer.merged is not None and layer.merged != name:
            raise RuntimeError("an adapter is merged into the weights; unmerge before switching adapters")
        layer.active = name if name in layer.lora_A else None
    return model


class use_adapter:
    """with use_adapter(model, "teacher"): ... switches and restores the active adapter."""

    def __init__(self, model, name):
        self.model, self.name = model, name

    def __enter__(self):
        layers = list(lora_layers(self.model).values())
        self.previous = next((l.active for l in layers if l.active is not None), None)
        set_adapter(self.model, self.name)
        return self.model

    def __exit__(self, *exc):
        set_adapter(self.model, self.previous)


class folded_adapter:
    """with folded_adapter(model): ... runs each layer's active adapter folded into a copy of
    its weight, W + (alpha / r) B A, made on entry and dropped on exit. A forward pass then
    costs one product per layer instead of three: the adapter's two thin products cost
    far more than their arithmetic on the CPU in bf16 (a quarter of a decode step at batch
    8), and on a GPU they are two more kernel launches each. The model's own weight
    tensors are never written to (a frozen base may be shared with a teacher), so leaving
    restores them exactly, unlike merge() and unmerge(), whose subtraction rounds. Costs
    one copy of the adapted weights while inside. A layer in train mode with adapter
    dropout is left unfolded, as dropout has no folded form."""

    def __init__(self, model):
        self.model, self.swapped = model, []

    @torch.no_grad()
    def __enter__(self):
        for layer in lora_layers(self.model).values():
            name = layer.active
            if name is None or layer.merged is not None or (layer.training and layer.dropout[name] > 0):
                continue
            dtype = layer.weight.dtype
            weight = torch.empty_like(layer.weight)  # with the strides load() chose
            # W + (s B) A in one pass over W, A and B in W's dtype as forward() casts them
            torch.addmm(layer.weight, (layer.lora_B[name] * layer.scaling[name]).to(dtype),
                        layer.lora_A[name].to(dtype), out=weight)
            self.swapped.append((layer, layer.weight))
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.merged = name
        return self.model

    def __exit__(self, *exc):
        for layer, weight in self.swapped:
            layer.weight, layer.merged = weight, None
        self.swapped = []


def lora_parameters(model, name="default"):
    return [p for layer in lora_layers(model).values() if name in layer.lora_A
            for p in (layer.lora_A[name], layer.lora_B[name])]


def merge(model):
    for layer in lora_layers(model).values():
        layer.merge()


def unmerge(model):
    for layer in lora_layers(model).values():
        layer.unmerge()


# -----------------------------------------------------------------------------
# PEFT file format

def adapter_state(model, name="default"):
    """Tensors of one adapter under PEFT's key names."""
    state = {}
    for path, layer in lora_layers(model).items():
        if name in layer.lora_A:
            state[f"{PEFT_PREFIX}{path}.lora_A.weight"] = layer.lora_A[name].detach().float().contiguous()
            state[f"{PEFT_PREFIX}{path}.lora_B.weight"] = layer.lora_B[name].detach().float().contiguous()
    return state


def write_atomic(path, write):
    """write(tmp_path) then rename: a crash never leaves a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_adapter(model, folder, name="default", base_model=None):
    from safetensors.torch import save_file
    if name not in getattr(model, "lora_config", {}):
        raise ValueError(f"model has no adapter named {name!r}")
    os.makedirs(folder, exist_ok=True)
    cfg = model.lora_config[name]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or getattr(model, "name_or_path", None),
        "r": cfg["r"], "lora_alpha": cfg["lora_alpha"], "lora_dropout": cfg["lora_dropout"],
        "target_modules": cfg["target_modules"], "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None,
    }
    state = adapter_state(model, name)
    write_atomic(os.path.join(folder, "adapter_model.safetensors"), lambda p: save_file(state, p))
    write_atomic(os.path.join(folder, "adapter_config.json"),
                 lambda p: open(p, "w").write(json.dumps(config, indent=2) + "\n"))


def assign_adapter_tensors(model, state, name, source):
    """Copy PEFT-keyed tensors into adapter `name`, checking every key and shape."""
    layers = lora_layers(model)
    found = 0
    for key, tensor in state.items():
        if not key.startswith(PEFT_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise InputError(f"{source}: unexpected tensor {key}; not a PEFT LoRA adapter")
        path, kind = key[len(PEFT_PREFIX):].rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        if path not in layers or name not in layers[path].lora_A:
            raise InputError(f"{source}: tensor {key} names a layer the base model does not have; "
                             f"was the adapter trained on another base model?")
        param = getattr(layers[path], kind)[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise InputError(f"{source}: {key} has shape {tuple(tensor.shape)} but the base model needs "
                             f"{tuple(param.shape)}; the adapter was trained on another base model")
        with torch.no_grad():
            param.copy_(tensor)
        found += 1
    if found != 2 * sum(name in l.lora_A for l in layers.values()):
        raise InputError(f"{source}: some LoRA tensors are missing for adapter {name!r}")


def read_adapter(folder):
    """(adapter_config.json, tensors under PEFT's key names, the weights file's sha256) of a
    PEFT-format adapter folder. The tensors and the digest come from the same bytes, so the
    digest names the adapter that was read even while a training run replaces the file."""
    config_path = os.path.join(folder, "adapter_config.json")
    weights_path = os.path.join(folder, "adapter_model.safetensors")
    if not (os.path.isfile(config_path) and os.path.isfile(weights_path)):
        raise FileNotFoundError(f"{folder}: no adapter_config.json + adapter_model.safetensors; is this a run folder?")
    cfg = read_json(config_path)
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise InputError(f"{config_path}: only plain LoRA adapters are supported (no DoRA, no rsLoRA)")
    with open(weights_path, "rb") as f:
        raw = f.read()
    state = read_safetensors_file(weights_path, raw=raw)
    # peft writes keys without the adapter name; other tools sometimes keep ".default"
    return cfg, {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
                 for k, v in state.items()}, hashlib.sha256(raw).hexdigest()


def adapter_sha256(folder):
    """The sha256 of folder's adapter weights: which adapter an eval.json or drift.json
    measured (load_adapter records it as lora_config[name]["sha256"]), so that a result of
    an adapter trained further since is told from a result of the adapter there now; None
    where the folder holds no adapter."""
    path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def update_norm(folder):
    """||delta W||_F over every layer the adapter in folder adapts: how far training moved the
    weights, the parameter-space counterpart of drift.py's state-space MMD. Per layer
    ||s B A||_F^2 = s^2 tr((B^T B)(A A^T)), two rank x rank products instead of the
    out x in matrix; in float64, as the terms of the sum span orders of magnitude."""
    cfg, state, _ = read_adapter(folder)
    total = 0.0
    for key, A in state.items():
        if key.endswith(".lora_A.weight"):
            B = state.get(key[:-len(".lora_A.weight")] + ".lora_B.weight")
            if B is None:
                raise InputError(f"{folder}: {key} has no lora_B beside it; the adapter file is incomplete")
            A, B = A.double(), B.double()
            total += torch.trace((B.T @ B) @ (A @ A.T)).item()
    return cfg["lora_alpha"] / cfg["r"] * total ** 0.5


def load_adapter(model, folder, name="default", activate=True, trainable=False):
    """Open a PEFT-format adapter folder (ours or peft's) as adapter `name`."""
    cfg, state, digest = read_adapter(folder)
    run = read_run_json(folder)
    if run is not None and "finished_steps" not in run:
        # a teacher or an evaluation taken from a run that is still training, or that stopped, is rarely meant
        print(f"note: the run in {folder} has not finished (still training, or stopped); using its last saved adapter")
    targets = cfg["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    was_trainable = {p: p.requires_grad for p in model.parameters()}
    add_lora(model, cfg["r"], cfg["lora_alpha"], cfg.get("lora_dropout", 0.0), tuple(targets), name, activate=False)
    assign_adapter_tensors(model, state, name, os.path.join(folder, "adapter_model.safetensors"))
    for p, flag in was_trainable.items():
        p.requires_grad_(flag)
    for p in lora_parameters(model, name):
        p.requires_grad_(trainable)
    model.lora_config[name].update(base_model_name_or_path=cfg.get("base_model_name_or_path"), sha256=digest)
    if activate:
        set_adapter(model, name)
    return model


# -----------------------------------------------------------------------------
# training an adapter: run folders, checkpoints, schedule

def write_json(path, obj):
    write_atomic(path, lambda p: open(p, "w").write(json.dumps(obj, indent=2) + "\n"))


HELD = {}  # real path -> its open .lock file (None where it could take none), for the folders this process holds


def hold(folder, instead=", or pass another --out"):
    """Hold folder for this process, or stop with one line if another process holds it: two
    runs writing one folder would interleave their logs and overwrite each other's
    checkpoints. The lock is the operating system's (flock on folder/.lock), so it ends with
    the process however that ends, and a killed run leaves none behind. Asking again for a
    folder this process holds does nothing: it is the same work going on (a stage of
    reproduce.py in its --out, a run resumed in the same process)."""
    key = os.path.realpath(folder)
    if key in HELD:
        return
    os.makedirs(folder, exist_ok=True)
    if fcntl is None:  # Windows has no flock: nothing is held there
        return
    lock = open(os.path.join(folder, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise InputError(f"{folder} is in use by another process (pid {holder}); wait for it to end{instead}") from None
    except OSError as e:  # a file system without locks (some network and FUSE mounts)
        lock.close()
        print(f"note: cannot lock {folder} ({e.strerror or e}); run one script at a time in it")
        HELD[key] = None  # said once: this process goes on without a lock
        return
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    HELD[key] = lock


@contextlib.contextmanager
def holding(*folders, instead=", or pass another --out"):
    """hold each folder for a with block, and let go at its end however it ends of those
    this process did not hold before the block."""
    took = [f for f in folders if os.path.realpath(f) not in HELD]
    try:
        for folder in folders:
            hold(folder, instead)
        yield
    finally:
        for folder in took:
            let_go(folder)


def held_elsewhere(folder):
    """The pid of another process that holds folder (hold), else None: a run still training
    there, whose adapter a reader would catch half way, or an evaluation writing it."""
    path = os.path.join(folder, ".lock")
    if fcntl is None or os.path.realpath(folder) in HELD or not os.path.isfile(path):
        return None
    with open(path) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken only if no process holds it; closing ends it
        except BlockingIOError:
            return lock.read().strip() or "unknown"
        except OSError:  # a file system without locks: hold took none either
            return None
    return None


def let_go(folder):
    """End this process's hold on folder (hold)."""
    lock = HELD.pop(os.path.realpath(folder), None)
    if lock is not None:
        lock.close()  # closing the file ends its flock


def git_commit():
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def lr_at(step, total_steps, peak_lr, warmup_frac):
    """Linear warmup over the first warmup_frac of the steps, then cosine decay to zero."""
    warmup = max(1, round(warmup_frac * total_steps)) if warmup_frac > 0 else 0
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak_lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def optimizer_step(optimizer, step, total_steps, args):
    """Scheduled learning rate, gradient clipping, one AdamW step; returns (lr, grad_norm)."""
    lr = lr_at(step, total_steps, args.lr, args.warmup)
    for group in optimizer.param_groups:
        group["lr"] = lr
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf")).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, grad_norm


def micro_batches(sequences, grad_accum, max_tokens, device):
    """[lo, hi) ranges splitting a step's sequences (token lists), in their order, into the
    micro-batches that each run one forward and backward pass: at least grad_accum of
    them, and each at most max_tokens tokens as sequence_states lays it out on the device,
    padding included (0: no bound): short sequences share rows, and common prefixes are
    laid out once (model.training_rows), so that OPD's continuations of one rollout, or RL's
    samples of one prompt, fit more to a pass than their lengths alone would. A sequence
    longer than the bound runs alone. The scripts weigh each micro-batch by its share of
    the step's tokens, so any split gives the same update up to float rounding."""
    most_sequences = math.ceil(len(sequences) / grad_accum)

    def fits(lo, hi):
        return hi - lo <= most_sequences and (max_tokens == 0 or hi - lo == 1
                                              or laid_out(training_rows(sequences[lo:hi], device)[0]) <= max_tokens)

    ranges, lo = [], 0
    while lo < len(sequences):
        # the longest run of sequences from lo that fits: doubling, then halving the gap,
        # lays out O(log n) candidates rather than one for each sequence added
        good, step = lo + 1, 1
        while good + step <= len(sequences) and fits(lo, good + step):
            good, step = good + step, step * 2
        bad = min(good + step, len(sequences) + 1)
        while bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if fits(lo, middle) else (good, middle)
        ranges.append((lo, good))
        lo = good
    return ranges


def add_training_args(p, lr, rank, alpha, dropout=0.0, warmup=0.03):
    """The flags every training script shares; each script passes its own defaults."""
    from model import add_model_args
    add_model_args(p)
    p.add_argument("--lr", type=number(float, 0, above=True), default=lr, help="peak learning rate of the LoRA parameters")
    p.add_argument("--rank", type=number(int, 1), default=rank, help="LoRA rank")
    p.add_argument("--alpha", type=number(float, 0, above=True), default=alpha, help="LoRA alpha (scale = alpha / rank)")
    p.add_argument("--lora-dropout", type=number(float, 0, below=1), default=dropout, help="dropout on the LoRA path")
    p.add_argument("--weight-decay", type=number(float, 0), default=0.0, help="AdamW weight decay")
    p.add_argument("--warmup", type=number(float, 0, below=1), default=warmup,
                   help="fraction of steps with linear warmup, then cosine decay")
    p.add_argument("--grad-clip", type=number(float, 0), default=1.0, help="clip the global gradient norm (0 = off)")
    p.add_argument("--grad-accum", type=number(int, 1), default=1, help="micro-batches per optimizer step (at least)")
    p.add_argument("--micro-batch-tokens", type=number(int, 0), default=8192,
                   help="most tokens, padding included, in one forward and backward pass; a step's sequences are split "
                        "into micro-batches under it (0 = no bound). 8192 holds Qwen3-0.6B's bf16 activations to "
                        "about 10 GB, 12 GB with SFT's LoRA dropout")
    p.add_argument("--recompute", action="store_true",
                   help="keep only each layer's matrix products and attention outputs for the backward pass and "
                        "recompute the rest: less activation memory for a little more time, the same gradients")
    p.add_argument("--max-steps", type=number(int, 0), default=0,
                   help="stop after this many optimizer steps (0 = the full run)")
    p.add_argument("--save-every", type=number(int, 1), default=50, help="write a checkpoint every N steps")
    p.add_argument("--snapshot-every", type=number(int, 0), default=0,
                   help="also keep the adapter every N steps in <out>/snapshots/step-N, a run folder of its own for "
                        "evaluate.py and drift.py: how forgetting and drift grow over training (0 = none)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of data order, sampling and dropout")


# what a training script's GPU out of memory says to do (model.run_script): the flags above that need less
MEMORY_FIX = "rerun with --resume and a smaller --micro-batch-tokens, or --recompute"


def check_run_folder(folder, model, also=""):
    """Stop unless folder holds a run's adapter trained on the base model (check_same_base)
    and no other process is training or evaluating it; also names what else the caller accepts in
    place of a run folder."""
    if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
        raise InputError(f"{folder} is not a run folder (no adapter_config.json); name a folder written by sft.py, "
                         f"rl.py or opd.py{also}")
    holder = held_elsewhere(folder)
    if holder:
        raise InputError(f"{folder} is in use by another process (pid {holder}), which trains or evaluates it; wait "
                         f"for it to end")
    check_same_base(folder, model)


def check_same_base(folder, model):
    """Stop when the run in folder was trained on another base model than model (the --model
    given now): its adapter on another base of the same shapes would load without a word and
    give numbers that mean nothing. Two folders are compared by where they resolve, two hub
    ids by name. A folder named in run.json that is gone (a study folder moved since), or a
    folder against a hub id, cannot be told apart: a note, not a stop. A folder without
    run.json (a peft adapter) is not checked."""
    trained_on = (read_run_json(folder) or {}).get("model")
    if not trained_on:
        return
    same = same_model(trained_on, model)
    if same is None:
        print(f"note: {folder} was trained on base {trained_on}, which cannot be compared with --model {model} "
              f"here; make sure they are the same model")
    elif not same:
        raise InputError(f"{folder} was trained on base {trained_on}, but --model is {model}; pass --model {trained_on}")


def same_model(a, b):
    """Whether --model a and --model b name one model: two folders by where they resolve, two
    hub ids by name; None where that cannot be told (a folder gone since, a folder against
    a hub id)."""
    local = os.path.isdir(a), os.path.isdir(b)
    if local == (True, True):
        return os.path.realpath(a) == os.path.realpath(b)
    if local == (False, False) and not os.path.isabs(a) and a.count("/") == 1:
        return a == b
    return None


def changed_settings(folder, args, ignore=("resume",)):
    """'--flag old -> new' for each setting in args (an argparse namespace) whose value
    differs from the one the run in folder recorded in its run.json; [] without one."""
    before = read_run_json(folder) or {}
    return [f"--{k.replace('_', '-')} {before[k]} -> {v}" for k, v in vars(args).items()
            if k not in ignore and k in before and before[k] != v]


def teacher_changed(folder, teacher_sha256=None):
    """Whether the run in folder was distilled from a teacher run folder whose adapter is
    not the one there now (or, given, not teacher_sha256): run.json keeps its sha256. A
    teacher given by model id or folder, and a run from before the sha256 was kept, have
    nothing to compare: False."""
    run = read_run_json(folder) or {}
    recorded = run.get("teacher_sha256")
    if recorded is None:
        return False
    return recorded != (teacher_sha256 or adapter_sha256(run["teacher"]))


def read_run_json(folder):
    """The run's recorded arguments (run.json), or None for a folder without one."""
    path = os.path.join(folder, "run.json")
    if not os.path.isfile(path):
        return None
    return read_json(path)


def read_log(path):
    """The records of a run's log.jsonl, one a step, leaving out a line cut short (a run
    killed while writing it, which can only be its last line, a step after its last
    checkpoint)."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def run_finished(folder):
    return "finished_steps" in (read_run_json(folder) or {})


class RunFolder:
    """out/<run>/: run.json, log.jsonl, the latest adapter (PEFT format), checkpoint/
    (adapter + optimizer state + step) and, with --snapshot-every, snapshots/. Every file
    is written atomically and checkpoint/ and each snapshot are replaced as a whole, so an
    interrupted run always has one complete checkpoint; one stopped by a signal inside
    stop_between_steps also has its last step's."""

    def __init__(self, folder, args, resume):
        self.folder = folder
        self.stop_requested = None  # the name of the signal that asked the run to stop
        self.save_every, self.snapshot_every = args.save_every, args.snapshot_every
        self.ckpt = os.path.join(folder, "checkpoint")
        self.log_path = os.path.join(folder, "log.jsonl")
        self.snapshots = os.path.join(folder, "snapshots")
        if os.path.isfile(os.path.join(folder, "config.json")):  # the run's files would go in among the model's
            raise InputError(f"--out {folder} is a model folder (config.json); pass a folder of its own for the run")
        held_before = os.path.realpath(folder) in HELD
        try:
            self.begin(args, resume)
        except BaseException:  # a refused start lets the folder go, also where the process lives on (a notebook)
            if not held_before:
                let_go(folder)
            raise

    def begin(self, args, resume):
        """Hold the folder, check that what it holds allows this start (a fresh run, or a
        resume that continues the same run) and write run.json for a fresh one."""
        folder = self.folder
        if os.path.isdir(folder):  # before reading what it holds: another run may be writing it
            hold(folder)
        has_checkpoint = self.last_checkpoint() is not None
        if not resume and has_checkpoint:
            raise InputError(f"{folder} already holds a trained run; pass --resume to continue it or --out for a new folder")
        if not resume and os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
            # a finished run whose checkpoint/ was deleted to save room: starting over would overwrite its adapter
            # and delete its snapshots
            raise InputError(f"{folder} already holds a trained adapter (and no checkpoint to continue it from); pass "
                             f"--out for a new folder, or delete {folder} to train it again")
        if resume and not has_checkpoint:
            raise InputError(f"{folder} has no checkpoint to resume from; drop --resume to start the run")
        hold(folder)  # until finish, a failure in the training loop, or the end of this process
        # which adapter a teacher run folder held (opd.py): a run resumed, or kept by reproduce.py,
        # after its teacher was trained further or again would mix two teachers' signals
        teacher = getattr(args, "teacher", None)
        teacher_sha256 = adapter_sha256(teacher) if teacher and os.path.isdir(teacher) else None
        if resume:  # refused: what would not continue the same run; named: what changes on purpose
            # a checkpoint's adapter continued on another base of the same shapes would load without a word
            check_same_base(folder, args.model)
            if teacher_changed(folder, teacher_sha256):
                raise InputError(f"{folder} was distilled from another adapter than {teacher} holds now (trained "
                                 f"further or again since); put back the teacher it started from, or start a new run "
                                 f"with --out")
            # the checkpoint's adapter is of its rank, and its alpha sets the scale its B A was trained under
            reshaped = changed_settings(folder, argparse.Namespace(rank=args.rank, alpha=args.alpha))
            if reshaped:
                raise InputError(f"{folder}'s adapter was trained with other LoRA settings ({'; '.join(reshaped)}); "
                                 f"resume with its own, or start a new run with --out")
            # --recompute, --grad-accum, --micro-batch-tokens or --max-steps may change on purpose, but a
            # changed --lr or --preset should not pass unseen
            changed = changed_settings(folder, args)
            if changed:
                print(f"note: resuming {folder} with changed settings: {'; '.join(changed)}")
        else:  # what a run that died before its first checkpoint left
            if os.path.isfile(self.log_path):
                os.remove(self.log_path)
            shutil.rmtree(self.snapshots, ignore_errors=True)
        taught = {"teacher_sha256": teacher_sha256} if teacher else {}
        self.record = {**vars(args), **taught, "git_commit": git_commit()}
        if not resume:  # a resumed run's, once its checkpoint has loaded (resume): a failed resume leaves it as it was
            write_json(os.path.join(folder, "run.json"), self.record)

    def last_checkpoint(self):
        """The folder of the last whole checkpoint: checkpoint/, or checkpoint.old/ where a
        save stopped between its two renames (save); None before the first."""
        return next((f for f in (self.ckpt, self.ckpt + ".old") if os.path.isdir(f)), None)

    def resume(self, model, optimizer, name="default"):
        """Load the last checkpoint into model and optimizer; returns the step to start at."""
        folder = self.last_checkpoint()
        state = torch.load(os.path.join(folder, "trainer.pt"), map_location="cpu", weights_only=True)
        weights = os.path.join(folder, "adapter_model.safetensors")
        assign_adapter_tensors(model, read_safetensors_file(weights), name, weights)
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        if os.path.isfile(self.log_path):  # forget log lines of steps after the checkpoint
            lines = [json.dumps(r) + "\n" for r in read_log(self.log_path) if r["step"] <= step]  # as log() writes them
            write_atomic(self.log_path, lambda p: open(p, "w").write("".join(lines)))
        for name in os.listdir(self.snapshots) if os.path.isdir(self.snapshots) else []:
            # and its snapshots of later steps, whole or half-written
            found = re.fullmatch(r"step-(\d+)(\.tmp)?", name)
            if found and (found[2] or int(found[1]) > step):
                shutil.rmtree(os.path.join(self.snapshots, name))
        write_json(os.path.join(self.folder, "run.json"), self.record)
        print(f"resuming {self.folder} at step {step}")
        return step

    def save(self, model, optimizer, step, name="default"):
        tmp, old = self.ckpt + ".tmp", self.ckpt + ".old"
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapter(model, tmp, name)
        torch.save({"optimizer": optimizer.state_dict(), "step": step}, os.path.join(tmp, "trainer.pt"))
        if os.path.isdir(self.ckpt):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.ckpt, old)
        os.replace(tmp, self.ckpt)
        shutil.rmtree(old, ignore_errors=True)
        save_adapter(model, self.folder, name)

    @contextlib.contextmanager
    def stop_between_steps(self):
        """Around a training loop: Ctrl-C (SIGINT) or SIGTERM, what a cluster's scheduler
        sends before it takes the machine back, lets the current step finish, and end_step
        then writes its checkpoint and ends the run, so nothing trained is lost (a step cut
        in two would leave the weights half updated, so none is). A second Ctrl-C (or
        SIGTERM) stops at once, as usual, back at the last checkpoint. The handlers that
        were there before come back on the way out, and a loop that ends in an exception
        lets the folder go (hold), also where the process lives on, as a notebook's does."""
        def request_stop(signum, frame):
            if self.stop_requested:  # the second signal, of either kind
                raise KeyboardInterrupt
            self.stop_requested = signal.Signals(signum).name
            print(f"\n{self.stop_requested}: {self.folder} stops after this step with a checkpoint of it; "
                  f"Ctrl-C again to stop now, back at the last checkpoint", file=sys.stderr, flush=True)

        previous = {}
        if threading.current_thread() is threading.main_thread():  # only there can a handler be set
            previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        except BaseException:  # a stop, a NaN or an error: what is written stays, and the folder is free again
            let_go(self.folder)
            raise
        finally:
            for s, handler in previous.items():
                if handler is not None:  # None: set outside Python, and Python cannot set it back
                    signal.signal(s, handler)

    def end_step(self, model, optimizer, step, end):
        """After step `step` of a run ending at `end`: a snapshot every --snapshot-every steps,
        a checkpoint every --save-every steps, at the end, and where a stop was asked for
        (stop_between_steps), which then ends the run."""
        stopping = self.stop_requested is not None and step < end
        try:
            if self.snapshot_every and step % self.snapshot_every == 0:
                self.snapshot(model, step)
            if step % self.save_every == 0 or step == end or stopping:
                self.save(model, optimizer, step)
        except OSError as e:  # a full disk, above all: each write is whole or absent, so say which is left and stop
            left = ("the last checkpoint written is intact: make room, then continue with --resume"
                    if self.last_checkpoint() is not None else
                    "no checkpoint was written before it: make room, then start the run again")
            raise InputError(f"could not write step {step}'s adapter to {self.folder} ({e.strerror or e}); {left}") from None
        if stopping:
            raise SystemExit(f"stopped by {self.stop_requested} after step {step} of {end}, its checkpoint written to "
                             f"{self.ckpt}; continue with --resume (reproduce.py resumes by itself)")

    def snapshot(self, model, step, name="default"):
        """The adapter after `step` steps in snapshots/step-<step>, with run.json and the log
        so far: a finished run folder of its own, which evaluate.py and drift.py take."""
        folder = os.path.join(self.snapshots, f"step-{step:06d}")
        tmp = folder + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapter(model, tmp, name)
        write_json(os.path.join(tmp, "run.json"), {**read_run_json(self.folder), "finished_steps": step})
        shutil.copy(self.log_path, os.path.join(tmp, "log.jsonl"))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)

    def finish(self, step):
        """Mark the run complete in run.json; reproduce.py skips finished runs. A stop asked
        for during the last step (stop_between_steps) ends the program here, once the run
        is complete, rather than being forgotten with the loop."""
        write_json(os.path.join(self.folder, "run.json"), {**read_run_json(self.folder), "finished_steps": step})
        let_go(self.folder)
        if self.stop_requested is not None:
            raise SystemExit(f"stopped by {self.stop_requested} at the run's last step; {self.folder} is complete")

    def log(self, record):
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def check_finite(self, step, loss):
        if not math.isfinite(loss):
            raise SystemExit(f"step {step}: loss is {loss}; stopped. The last good checkpoint in {self.ckpt} is intact: "
                             f"lower --lr and continue with --resume")
