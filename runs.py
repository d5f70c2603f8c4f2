"""
What a training run needs around its loop, shared by sft.py, rl.py and opd.py (and the flags
and errors also by evaluate.py, drift.py, reproduce.py and toy.py): the command-line flags,
the device, run folders with atomic checkpoints and resume, the folder lock, a stop between
steps on a signal, the learning-rate schedule, token-bounded micro-batches, and one-line
errors for the user's mistakes. The model does not import it.

A run folder, out/<run>/: run.json (every argument, the git commit), log.jsonl (one line a
step), the latest adapter (PEFT format), checkpoint/ (adapter + optimizer state + step)
and, with --snapshot-every, snapshots/step-N/ (each a finished run folder of its own).
"""
import argparse
import atexit
import contextlib
import errno
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

import lora
from model import DEFAULT_MODEL, InputError, read_json, read_safetensors_file, write_atomic, write_json

try:
    import fcntl
except ImportError:  # Windows: no flock, so nothing is held there
    fcntl = None


# -----------------------------------------------------------------------------
# flags, device and errors

def number(kind, minimum, above=False, below=None, why=""):
    """An argparse type: a value of kind (int or float) at least minimum (above it, with
    above=True) and below `below` when given; anything else is argparse's one-line error,
    ending with why (the reason for the bound) when given."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if not (value > minimum if above else value >= minimum) or (below is not None and not value < below):
            bound = f"{'above' if above else 'at least'} {minimum}" + (f" and below {below}" if below is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}" + (f": {why}" if why else ""))
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def add_model_args(p, model_help=f"base model: a hub id or a local folder (default: the one the run folders given "
                                  f"were trained on, else {DEFAULT_MODEL})"):
    """The flags every entry point shares: which model, which data, which device."""
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--data-dir", default=None, help="dataset folder (default: the run folders', else $STATES_DATA, "
                                                     "else fetched once into ~/.cache/states)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: $STATES_DEVICE, else cuda when present)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default: bf16 on cuda, fp32 on cpu")


def model_and_data_from(args, *folders):
    """--model and --data-dir, where not given, from the run.json of the first of folders (a
    teacher, a run to resume or evaluate) that names them, else the defaults; printed with
    where they came from."""
    for name in ("model", "data_dir"):
        source = "given" if getattr(args, name) is not None else "default"
        if getattr(args, name) is None:
            for folder in filter(None, folders):
                value = (read_run_json(folder) or {}).get(name)
                if value is not None:
                    setattr(args, name, value)
                    source = f"from {os.path.join(folder, 'run.json')}"
                    break
        if getattr(args, name) is None and name == "model":
            args.model = DEFAULT_MODEL
        print(f"--{name.replace('_', '-')} {getattr(args, name)} ({source})")
    return args


def resolve_device(device=None, dtype=None):
    """(torch.device, torch.dtype) from --device (else $STATES_DEVICE, else cuda when present)
    and --dtype (else bf16 on cuda, fp32 elsewhere)."""
    source = "--device" if device else "$STATES_DEVICE" if os.environ.get("STATES_DEVICE") else None
    device = device or os.environ.get("STATES_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise InputError(f"{source} {device!r} is not a device; use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{source} {device}, but torch finds no CUDA device (no GPU, no driver, or a CPU-only torch); "
                         f"{'unset $STATES_DEVICE' if source == '$STATES_DEVICE' else 'leave out --device'} to run on the CPU")
    if dtype not in ("fp32", "bf16", None):
        raise InputError(f"--dtype {dtype!r} is not a dtype this code runs in; use fp32 or bf16")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[dtype]
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def device_from_args(args):
    """resolve_device for --device and --dtype, printing what was picked and why; under
    torchrun, this process's own GPU."""
    device, dtype = resolve_device(args.device, args.dtype)
    device = join_processes(device)
    source = "given" if args.device else "from $STATES_DEVICE" if os.environ.get("STATES_DEVICE") else "default"
    print(f"device {device} ({source}), dtype {dtype} ({'given' if args.dtype else 'default for ' + device.type})")
    return device, dtype


def run_script(main, memory_fix="rerun with smaller settings"):
    """A script's entry point: main(argv) on the command line's arguments. A mistake in the
    user's input (InputError, a missing file), a device too small for the settings (with
    memory_fix, the flags that need less), a full disk or a folder without permission ends
    the run with one line; any other exception is a bug and keeps its traceback."""
    try:
        main(sys.argv[1:])
    except (InputError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    except torch.OutOfMemoryError as e:
        raise SystemExit(f"error: the GPU ran out of memory ({str(e).strip().splitlines()[0]}); {memory_fix}") from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SystemExit(f"error: could not write {e.filename or 'a file'} ({e.strerror}); make room, then run it "
                             f"again") from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise SystemExit(f"error: {e.filename or 'a file'}: {e.strerror}; check its permissions, or pass a folder "
                             f"you can write to") from None
        raise
    except RuntimeError as e:  # the CPU's allocator raises a plain RuntimeError
        if "DefaultCPUAllocator: can't allocate memory" not in str(e):
            raise
        raise SystemExit(f"error: the CPU ran out of memory ({str(e).split('DefaultCPUAllocator: ')[-1].splitlines()[0]}"
                         f"); {memory_fix}") from None


def add_training_args(p, lr, rank, alpha, dropout=0.0, warmup=0.03):
    """The flags every training script shares; each script passes its own defaults."""
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
                   help="most tokens, padding included, in one forward and backward pass; each step's sequences are "
                        "split under it (0 = no bound)")
    p.add_argument("--recompute", action="store_true",
                   help="keep only each layer's input for the backward pass and run the layer again there: less "
                        "activation memory for about a third more time, the same gradients")
    p.add_argument("--max-steps", type=number(int, 0), default=0, help="stop after this many steps (0 = the full run)")
    p.add_argument("--save-every", type=number(int, 1), default=50, help="write a checkpoint every N steps")
    p.add_argument("--snapshot-every", type=number(int, 0), default=0,
                   help="also keep the adapter every N steps in <out>/snapshots/step-N, a run folder of its own for "
                        "evaluate.py and drift.py (0 = none)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of data order, sampling and dropout")


# what a training script's out-of-memory error says to do: the flags above that need less
MEMORY_FIX = "rerun with --resume and a smaller --micro-batch-tokens, or --recompute"


# -----------------------------------------------------------------------------
# more than one process: under `torchrun --nproc-per-node N`, every process takes a share
# of each step's batch and the adapter's gradients are summed over them; one process (RANK
# 0) writes the run folder. A plain `python` run is WORLD 1 and none of this does anything.

RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def join_processes(device):
    """Join torchrun's process group (NCCL on CUDA, gloo on the CPU); returns the device this
    process runs on, on CUDA its own GPU."""
    if WORLD == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        # left for the interpreter's own teardown, gloo's threads can abort the process (SIGABRT)
        # after a run has finished, which torchrun then reports as a failure
        atexit.register(dist.destroy_process_group)
    return device


def split(n, flag=None):
    """(first, last): this process's contiguous share of n items, in rank order, so that the
    shares joined are the whole. Where a flag sets n, it must split evenly, so that every
    process takes the same share and N processes make the update one makes."""
    if flag and n % WORLD:
        raise InputError(f"{flag} {n} does not split evenly over {WORLD} processes; pass a multiple of {WORLD}, or "
                         f"run fewer processes")
    return RANK * n // WORLD, (RANK + 1) * n // WORLD


def joined(part):
    """Every process's list, joined in rank order (split's inverse)."""
    if WORLD == 1:
        return list(part)
    parts = [None] * WORLD
    dist.all_gather_object(parts, list(part))
    return [x for p in parts for x in p]


def summed(*values):
    """Each number summed over the processes."""
    return [sum(column) for column in zip(*joined([values]))]


# -----------------------------------------------------------------------------
# the training step: micro-batches, schedule, optimizer

def micro_batches(lengths, grad_accum=1, max_tokens=0):
    """Index lists splitting a step's sequences (of these lengths) into forward and backward
    passes: at least grad_accum of them (where there are as many sequences), longest first
    so that sequences of like length pad together, each at most max_tokens tokens padding
    included (0: no bound); a sequence longer than the bound runs alone. The scripts weigh
    each pass by its share of the step's tokens, so any split gives the same update up to
    float rounding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n, parts = len(order), min(grad_accum, len(order))
    passes = []
    for k in range(parts):
        first = len(passes)  # where this part's passes start
        for i in order[k * n // parts:(k + 1) * n // parts]:
            last = passes[-1] if len(passes) > first else None
            if last and (not max_tokens or (len(last) + 1) * lengths[last[0]] <= max_tokens):
                last.append(i)  # its first is its longest: rows x that length is the padded size
            else:
                passes.append([i])
    return passes


SHARED_MIN = 16  # tokens a sequence must share with a row to be laid out in it beyond the longest's length


def common_length(a, b):
    """How many tokens two token lists share at their start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def walk(trie, s):
    """The columns of the longest start of s that a row already holds (trie: (parent column,
    token) -> column, the root's parent -1)."""
    path = []
    while len(path) < len(s) and (path[-1] if path else -1, s[len(path)]) in trie:
        path.append(trie[path[-1] if path else -1, s[len(path)]])
    return path


def shared_rows(sequences):
    """How a training pass lays token lists out: in rows of prefix trees, each token computed
    once for every sequence that opens with the tokens before it (RL's samples of one prompt,
    OPD's continuations of one rollout's cuts), short sequences side by side in a row up to
    the longest's length, longest first. Returns (rows of token ids, each row's parent
    column of every token, -1 at a tree's root, the row and columns of each sequence)."""
    cap = max(map(len, sequences))
    rows, parents, tries, placed = [], [], [], [None] * len(sequences)
    for b in sorted(range(len(sequences)), key=lambda i: -len(sequences[i])):
        s, best = sequences[b], None
        for r, trie in enumerate(tries):  # the row sharing most of s, of those with room for its rest
            path = walk(trie, s)
            if (len(rows[r]) + len(s) - len(path) <= cap or len(path) >= SHARED_MIN) and (
                    best is None or len(path) > len(best[1])):
                best = (r, path)
        if best is None:
            rows.append([]), parents.append([]), tries.append({})
            best = (len(rows) - 1, [])
        r, columns = best[0], list(best[1])
        for token in s[len(columns):]:
            parent = columns[-1] if columns else -1
            tries[r][parent, token] = len(rows[r])
            columns.append(len(rows[r]))
            rows[r].append(token), parents[r].append(parent)
        placed[b] = (r, columns)
    return rows, parents, placed


def sequence_states(model, sequences, starts, pad_id=0):
    """The final hidden state at every state seq[:t] whose next token seq[t] is trained on,
    for t in [start, len(seq)) of each token list. Returns (states (N, hidden), targets
    (N,), the sequence of each (N,)), sequence by sequence. Rows are laid out by
    shared_rows and right-padded; a token attends to the tokens on its path from its
    tree's root and counts its position from there, so each sequence computes what it
    would alone. Where every row holds one sequence, causal attention alone does that."""
    device = model.lm_head.weight.device
    for b, (s, start) in enumerate(zip(sequences, starts)):
        if not 1 <= start <= len(s):
            raise ValueError(f"sequence {b}: start {start} outside [1, {len(s)}]")
    rows, parents, placed = shared_rows(sequences)
    R, T = len(rows), max(map(len, rows))
    ids = torch.full((R, T), pad_id, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
    ids = ids.to(device)
    if R == len(sequences):  # no common prefix, no two side by side
        hidden = model(ids, hidden_only=True)
    else:
        positions, visible = torch.zeros(R, T, dtype=torch.long), torch.eye(T, dtype=torch.bool).repeat(R, 1, 1)
        for r, row_parents in enumerate(parents):
            for c, p in enumerate(row_parents):
                if p >= 0:  # what its parent sees, and itself
                    visible[r, c] |= visible[r, p]
                    positions[r, c] = positions[r, p] + 1
        hidden = model.body(ids, positions.to(device), visible[:, None].to(device), None)
    trained = [(r, columns[t - 1], columns[t], b) for b, ((r, columns), start) in enumerate(zip(placed, starts))
               for t in range(start, len(columns))]
    row, state, target, which = torch.tensor(trained, dtype=torch.long, device=device).view(-1, 4).T
    return hidden[row, state], ids[row, target], which


def sequence_logprobs(model, sequences, starts, pad_id=0):
    """log p(seq[t] | seq[:t]) in fp32 for t in [start, len(seq)), flat (N,), and the index of
    each one's sequence (N,): the training pass's view of the policy that sample.py samples."""
    states, targets, which = sequence_states(model, sequences, starts, pad_id)
    return model.token_logprobs(states, targets), which


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
    if WORLD > 1:  # each process divided its loss by the whole step's tokens: the sum is the step's gradient
        for p in params:
            p.grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(p.grad)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf")).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, grad_norm


# -----------------------------------------------------------------------------
# run folders

HELD = {}  # real path -> its open .lock file (None where it could take none), for the folders this process holds


def hold(folder, instead=", or pass another --out"):
    """Hold folder for this process, or stop with one line if another process holds it: two
    runs writing one folder would interleave their logs and overwrite each other's
    checkpoints. The lock is the operating system's (flock on folder/.lock), so it ends
    with the process however that ends. Holding a folder this process holds does nothing,
    and so does every process of torchrun's but the one that writes (RANK 0)."""
    key = os.path.realpath(folder)
    if key in HELD or RANK:
        return
    os.makedirs(folder, exist_ok=True)
    if fcntl is None:
        HELD[key] = None
        return
    lock = open(os.path.join(folder, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise InputError(f"{folder} is in use by another process (pid {holder}); wait for it to end{instead}") from None
    except OSError as e:  # a file system without locks (some network mounts)
        lock.close()
        print(f"note: cannot lock {folder} ({e.strerror or e}); run one script at a time in it")
        HELD[key] = None
        return
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    HELD[key] = lock


def let_go(folder):
    lock = HELD.pop(os.path.realpath(folder), None)
    if lock is not None:
        lock.close()  # closing the file ends its flock


@contextlib.contextmanager
def holding(*folders, instead=", or pass another --out"):
    """hold each folder for a with block; at its end let go of those it took."""
    took = [f for f in folders if os.path.realpath(f) not in HELD]
    try:
        for folder in folders:
            hold(folder, instead)
        yield
    finally:
        for folder in took:
            let_go(folder)


def held_elsewhere(folder):
    """The pid of another process that holds folder, else None."""
    path = os.path.join(folder, ".lock")
    if fcntl is None or os.path.realpath(folder) in HELD or not os.path.isfile(path):
        return None
    with open(path) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken only where no process holds it
        except BlockingIOError:
            return lock.read().strip() or "unknown"
        except OSError:
            return None
    return None


def read_run_json(folder):
    path = os.path.join(folder, "run.json")
    return read_json(path) if os.path.isfile(path) else None


def read_log(path):
    """The records of a log.jsonl, leaving out a last line cut short by a killed run."""
    with open(path) as f:
        lines = f.read().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def run_finished(folder):
    return "finished_steps" in (read_run_json(folder) or {})


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def same_model(a, b):
    """Whether --model a and b name one model: two folders by where they resolve, two hub ids
    by name; None where that cannot be told (a folder gone since, a folder against a hub id)."""
    local = os.path.isdir(a), os.path.isdir(b)
    if local == (True, True):
        return os.path.realpath(a) == os.path.realpath(b)
    if local == (False, False) and not os.path.isabs(a) and a.count("/") == 1:
        return a == b
    return None


def check_same_base(folder, model):
    """Stop when the run in folder was trained on another base than `model`: its adapter on
    another base of the same shapes would load without a word and give numbers that mean
    nothing. A folder without run.json (a peft adapter) is not checked."""
    trained_on = (read_run_json(folder) or {}).get("model")
    same = same_model(trained_on, model) if trained_on else True
    if same is None:
        print(f"note: {folder} was trained on base {trained_on}, which cannot be compared with --model {model} "
              f"here; make sure they are the same model")
    elif not same:
        raise InputError(f"{folder} was trained on base {trained_on}, but --model is {model}; pass --model {trained_on}")


def check_run_folder(folder, model, also=""):
    """Stop unless folder holds a run's adapter, trained on `model` and not in use by another
    process (a run still training, an evaluation writing it); also names what else the
    caller takes in place of a run folder."""
    if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
        if any(os.path.exists(os.path.join(folder, f)) for f in (".lock", "run.json", "log.jsonl")):
            raise InputError(f"{folder} holds a run that never trained to its first checkpoint (no adapter); train it "
                             f"again, or delete the folder")
        raise InputError(f"{folder} is not a run folder (no adapter_config.json); name a folder written by sft.py, "
                         f"rl.py or opd.py{also}")
    holder = held_elsewhere(folder)
    if holder:
        raise InputError(f"{folder} is in use by another process (pid {holder}), which trains or evaluates it; wait "
                         f"for it to end")
    check_same_base(folder, model)
    if read_run_json(folder) is not None and not run_finished(folder):
        print(f"note: the run in {folder} has not finished (stopped before its last step); using its last adapter")


def changed_settings(folder, args, ignore=("resume",)):
    """'--flag old -> new' for each setting in args whose value differs from run.json's."""
    before = read_run_json(folder) or {}
    return [f"--{k.replace('_', '-')} {before[k]} -> {v}" for k, v in vars(args).items()
            if k not in ignore and k in before and before[k] != v]


def teacher_changed(folder, teacher_sha256=None):
    """Whether the run in folder was distilled from a run-folder teacher whose adapter is not
    the one there now (or, given, not teacher_sha256): run.json keeps its sha256."""
    run = read_run_json(folder) or {}
    recorded = run.get("teacher_sha256")
    return recorded is not None and recorded != (teacher_sha256 or lora.adapter_sha256(run["teacher"]))


class RunFolder:
    """A training run's folder. Every file is written atomically and checkpoint/ and each
    snapshot are replaced as a whole, so an interrupted run always has one whole
    checkpoint; run.json comes with the first, so a run that fails before it leaves no
    folder behind (or, killed, one without run.json, which other scripts name as such)."""

    def __init__(self, folder, args):
        self.folder, self.args = folder, args
        self.ckpt, self.log_path = os.path.join(folder, "checkpoint"), os.path.join(folder, "log.jsonl")
        self.snapshots = os.path.join(folder, "snapshots")
        self.stop_requested = None  # the name of the signal that asked the run to stop
        if os.path.isfile(os.path.join(folder, "config.json")):
            raise InputError(f"--out {folder} is a model folder (config.json); pass a folder of its own for the run")
        self.created = not os.path.isdir(folder)
        hold(folder)  # until finish, a failure in the loop, or the end of this process
        if self.created:  # however the process ends before its first checkpoint, the folder goes with it
            atexit.register(self.discard_if_untrained)
        try:
            self.check_start()
        except BaseException:
            self.discard_if_untrained()
            raise
        teacher = getattr(args, "teacher", None)  # which adapter a run-folder teacher (opd.py) held
        self.record = {**vars(args), "git_commit": git_commit(),
                       **({"teacher_sha256": lora.adapter_sha256(teacher)} if teacher else {})}

    def check_start(self):
        """A fresh run, or a resume that continues the same run: anything else stops here."""
        folder, args = self.folder, self.args
        has_checkpoint = self.last_checkpoint() is not None
        if not args.resume and has_checkpoint:
            raise InputError(f"{folder} already holds a trained run; pass --resume to continue it or --out for a new folder")
        if not args.resume and os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
            raise InputError(f"{folder} already holds a trained adapter (and no checkpoint to continue it from); pass "
                             f"--out for a new folder, or delete {folder} to train it again")
        if args.resume and not has_checkpoint:
            raise InputError(f"{folder} has no checkpoint to resume from; drop --resume to start the run")
        if not args.resume:
            if not RANK:  # what a run killed before its first checkpoint left; under torchrun one process removes it
                for leftover in (self.log_path, os.path.join(folder, "run.json")):
                    if os.path.isfile(leftover):
                        os.remove(leftover)
                shutil.rmtree(self.snapshots, ignore_errors=True)
            return
        check_same_base(folder, args.model)
        teacher = getattr(args, "teacher", None)
        if teacher_changed(folder, lora.adapter_sha256(teacher) if teacher else None):
            raise InputError(f"{folder} was distilled from another adapter than {teacher} holds now (trained further "
                             f"or again since); put back the teacher it started from, or start a new run with --out")
        reshaped = changed_settings(folder, argparse.Namespace(rank=args.rank, alpha=args.alpha))
        if reshaped:  # the checkpoint's adapter has its rank, and its alpha set the scale it was trained under
            raise InputError(f"{folder}'s adapter was trained with other LoRA settings ({'; '.join(reshaped)}); resume "
                             f"with its own, or start a new run with --out")
        changed = changed_settings(folder, args)
        if changed:
            print(f"note: resuming {folder} with changed settings: {'; '.join(changed)}")

    def discard_if_untrained(self):
        """Let the folder go, and delete it where this run made it and wrote no checkpoint."""
        if os.path.realpath(self.folder) not in HELD:  # let go already: another run may hold it now
            return
        let_go(self.folder)
        if self.created and self.last_checkpoint() is None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def last_checkpoint(self):
        """checkpoint/, or checkpoint.old/ where a save stopped between its two renames; None before the first."""
        return next((f for f in (self.ckpt, self.ckpt + ".old") if os.path.isdir(f)), None)

    def resume(self, model, optimizer, name="default"):
        """Load the last checkpoint into model and optimizer; returns the step to start at."""
        folder = self.last_checkpoint()
        state = torch.load(os.path.join(folder, "trainer.pt"), map_location="cpu", weights_only=True)
        weights = os.path.join(folder, "adapter_model.safetensors")
        lora.assign_adapter_tensors(model, read_safetensors_file(weights), name, weights)
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        if not RANK:  # the process that writes
            if os.path.isfile(self.log_path):  # forget the log lines of steps after the checkpoint
                text = "".join(json.dumps(r) + "\n" for r in read_log(self.log_path) if r["step"] <= step)
                write_atomic(self.log_path, lambda p: open(p, "w").write(text))
            for entry in os.listdir(self.snapshots) if os.path.isdir(self.snapshots) else []:
                found = re.fullmatch(r"step-(\d+)(\.tmp)?", entry)  # and snapshots of later steps, whole or half-written
                if found and (found[2] or int(found[1]) > step):
                    shutil.rmtree(os.path.join(self.snapshots, entry))
            write_json(os.path.join(self.folder, "run.json"), self.record)
        print(f"resuming {self.folder} at step {step}")
        return step

    def save(self, model, optimizer, step, name="default"):
        if RANK:  # under torchrun, one process writes
            return
        tmp, old = self.ckpt + ".tmp", self.ckpt + ".old"
        shutil.rmtree(tmp, ignore_errors=True)
        lora.save_adapter(model, tmp, name)
        torch.save({"optimizer": optimizer.state_dict(), "step": step}, os.path.join(tmp, "trainer.pt"))
        if os.path.isdir(self.ckpt):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.ckpt, old)
        os.replace(tmp, self.ckpt)
        shutil.rmtree(old, ignore_errors=True)
        lora.save_adapter(model, self.folder, name)
        if read_run_json(self.folder) is None:  # the run's first checkpoint
            write_json(os.path.join(self.folder, "run.json"), self.record)

    @contextlib.contextmanager
    def stop_between_steps(self):
        """Around a training loop: Ctrl-C (SIGINT) or SIGTERM, what a cluster's scheduler sends
        before it takes the machine back, lets the current step finish, and end_step then
        writes its checkpoint and ends the run, so nothing trained is lost. A second signal
        stops at once, back at the last checkpoint (under torchrun, which passes its signal on
        to its processes, only its SIGKILL 30 s later does). A loop that ends in an exception lets
        the folder go (and deletes it, where the run made it and never checkpointed)."""
        def request_stop(signum, frame):
            if self.stop_requested and WORLD > 1:  # torchrun passing on the signal its processes had already
                return
            if self.stop_requested:
                raise KeyboardInterrupt
            self.stop_requested = signal.Signals(signum).name
            print(f"\n{self.stop_requested}: {self.folder} stops after this step with a checkpoint of it; Ctrl-C "
                  f"again to stop now, back at the last checkpoint", file=sys.stderr, flush=True)

        previous = {}
        if threading.current_thread() is threading.main_thread():  # only there can a handler be set
            previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        except BaseException:
            self.discard_if_untrained()
            raise
        finally:
            for s, handler in previous.items():
                if handler is not None:  # None: set outside Python, which Python cannot set back
                    signal.signal(s, handler)

    def end_step(self, model, optimizer, step, end):
        """After step `step` of a run ending at `end`: a snapshot every --snapshot-every steps, a
        checkpoint every --save-every steps, at the end, and where a stop was asked for."""
        # under torchrun every process stops after the same step, where any was asked to
        stopping = summed(self.stop_requested is not None)[0] > 0 and step < end
        try:
            if self.args.snapshot_every and step % self.args.snapshot_every == 0:
                self.snapshot(model, step)
            if step % self.args.save_every == 0 or step == end or stopping:
                self.save(model, optimizer, step)
        except OSError as e:  # a full disk, above all: each write is whole or absent, so say which is left
            left = ("the last checkpoint written is intact: make room, then continue with --resume"
                    if self.last_checkpoint() is not None else "no checkpoint was written before it: make room, then "
                    "start the run again")
            raise InputError(f"could not write step {step}'s adapter to {self.folder} ({e.strerror or e}); {left}") from None
        if stopping:
            raise SystemExit(f"stopped by {self.stop_requested or 'a signal'} after step {step} of {end}, its checkpoint "
                             f"written to {self.ckpt}; continue with --resume (reproduce.py resumes by itself)")

    def snapshot(self, model, step, name="default"):
        """The adapter after `step` steps in snapshots/step-<step>, with run.json and the log so
        far: a finished run folder of its own, which evaluate.py and drift.py take."""
        if RANK:
            return
        folder = os.path.join(self.snapshots, f"step-{step:06d}")
        shutil.rmtree(folder + ".tmp", ignore_errors=True)
        lora.save_adapter(model, folder + ".tmp", name)
        write_json(os.path.join(folder + ".tmp", "run.json"), {**self.record, "finished_steps": step})
        shutil.copy(self.log_path, os.path.join(folder + ".tmp", "log.jsonl"))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(folder + ".tmp", folder)

    def finish(self, step):
        """Mark the run complete in run.json (reproduce.py skips finished runs) and let the
        folder go; a stop asked for during the last step ends the program here."""
        if not RANK:
            write_json(os.path.join(self.folder, "run.json"), {**self.record, "finished_steps": step})
        let_go(self.folder)
        if self.stop_requested is not None:
            raise SystemExit(f"stopped by {self.stop_requested} at the run's last step; {self.folder} is complete")

    def log(self, record):
        if RANK:
            return
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def check_finite(self, step, loss):
        if not math.isfinite(loss):
            raise SystemExit(f"step {step}: loss is {loss}; stopped. The last good checkpoint in {self.ckpt} is intact: "
                             f"lower --lr and continue with --resume")
