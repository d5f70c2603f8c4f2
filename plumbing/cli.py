"""
What every entry point shares (the training scripts, evaluate.py, drift.py, reproduce.py,
toy.py, results.py): its flags, the device it runs on, and one line for a user's mistake.
"""
import argparse
import errno
import os
import sys

import torch

from plumbing import processes, provenance
from plumbing.files import InputError

# what --model is where neither the command line nor a run folder names one
DEFAULT_MODEL = "Qwen/Qwen3-0.6B-Base"


# -----------------------------------------------------------------------------
# flags, device and errors

def number(kind, minimum, above=False, below=None, why="", most=None):
    """An argparse type: a value of kind (int or float) at least minimum (above it, with
    above=True), below `below` and at most `most` when given; anything else is argparse's
    one-line error, ending with why (the reason for the bound) when given."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        low_ok = value > minimum if above else value >= minimum
        high_ok = (below is None or value < below) and (most is None or value <= most)
        if not low_ok or not high_ok:
            bound = f"{'above' if above else 'at least'} {minimum}"
            bound += f" and below {below}" if below is not None else ""
            bound += f" and at most {most}" if most is not None else ""
            reason = f": {why}" if why else ""
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}{reason}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def mixture(text, names, flag):
    """A flag's weights of names: one name alone, or weights of them that sum to 1
    ("student=0.25,data=0.75"); anything else is a one-line error."""
    parts = [part.split("=") for part in text.split(",")] if "=" in text else [[text, "1"]]
    try:  # a weight that is no number, or a part that is not name=weight: none
        weights = {name.strip(): float(w) for name, w in parts}
    except ValueError:
        weights = {}
    w = list(weights.values())
    if not w or not set(weights) <= set(names) or min(w) < 0 or not abs(sum(w) - 1) <= 1e-6:
        raise InputError(f"{flag} {text!r}: give {', '.join(names[:-1])} or {names[-1]}, or "
                         f"weights of them that sum to 1, e.g. {names[0]}=0.25,{names[-1]}=0.75")
    return weights


def add_model_args(p, model_help=f"base model: a hub id or a local folder (default: the one the "
                                  f"run folders given were trained on, else {DEFAULT_MODEL})"):
    """The flags every entry point shares: which model, which data, which device."""
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--data-dir", default=None,
                   help="dataset folder (default: the run folders', else $STATES_DATA, else "
                        "fetched once into ~/.cache/states)")
    p.add_argument("--device", default=None,
                   help="cuda, cuda:N or cpu (default: $STATES_DEVICE, else cuda when present)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                   help="default: bf16 on cuda, fp32 on cpu")


def resolve_device(device=None, dtype=None):
    """(torch.device, torch.dtype) from --device (else $STATES_DEVICE, else cuda when present)
    and --dtype (else bf16 on cuda, fp32 elsewhere)."""
    source = "--device" if device else "$STATES_DEVICE" if os.environ.get("STATES_DEVICE") else None
    present = "cuda" if torch.cuda.is_available() else "cpu"
    device = device or os.environ.get("STATES_DEVICE") or present
    try:
        device = torch.device(device)
    except RuntimeError:
        raise InputError(f"{source} {device!r} is not a device; use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        fix = "unset $STATES_DEVICE" if source == "$STATES_DEVICE" else "leave out --device"
        raise InputError(f"{source} {device}, but torch finds no CUDA device (no GPU, no driver, "
                         f"or a CPU-only torch); {fix} to run on the CPU")
    if dtype not in ("fp32", "bf16", None):
        raise InputError(f"--dtype {dtype!r} is not a dtype this code runs in; use fp32 or bf16")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[dtype]
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def autocast_bf16(choice):
    """--bf16 if given, else whether the CPU has bf16 products (without, bf16 is slower than
    fp32)."""
    try:
        return bool(choice) if choice is not None else bool(torch.cpu._is_avx512_bf16_supported() or
                                                            torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private helpers of torch.cpu; without them, fp32
        return False


def device_from_args(args):
    """resolve_device for --device and --dtype, printing what was picked and why; under
    torchrun, this process's own GPU."""
    device, dtype = resolve_device(args.device, args.dtype)
    device = processes.join_processes(device)
    source = ("given" if args.device else "from $STATES_DEVICE" if os.environ.get("STATES_DEVICE")
              else "default")
    picked = "given" if args.dtype else "default for " + device.type
    print(f"device {device} ({source}), dtype {dtype} ({picked})")
    return device, dtype


def model_and_data_from(args, *records):
    """--model and --data-dir, where not given, from the first of records (the run.json of a
    run to resume, a teacher, runs to evaluate; None: none) that names them, else the
    defaults; printed with where they came from."""
    for name in ("model", "data_dir"):
        source = "given" if getattr(args, name) is not None else "default"
        for record in filter(None, records if getattr(args, name) is None else ()):
            if record.get(name) is not None:
                setattr(args, name, record[name])
                source = f"from the run.json of {record.get('out', 'a run')}"
                break
        if getattr(args, name) is None and name == "model":
            args.model = DEFAULT_MODEL
        print(f"--{name.replace('_', '-')} {getattr(args, name)} ({source})")
    return args


def left_unset(p, names):
    """The defaults of p's flags names, each set to None instead, so that unless_given can tell
    the flags a command line leaves out."""
    defaults = {name: p.get_default(name) for name in names}
    p.set_defaults(**dict.fromkeys(names))
    return defaults


def unless_given(args, defaults, record, where):
    """Each flag of defaults (name -> default) that the command line left None: record's value,
    printed where it is not the default and with where it came from, else the default."""
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, record.get(name, default))
            if getattr(args, name) != default:
                print(f"--{name.replace('_', '-')} {getattr(args, name)} (from {where})")


def resolve(args, *records):
    """A training script's start: model_and_data_from the run.json of the run to resume (with
    --resume) and of records (a teacher's), every setting printed, the device."""
    resumed = provenance.run_record(args.out) if args.resume else None
    model_and_data_from(args, resumed, *records)
    print(vars(args))
    return device_from_args(args)


def run_script(main, memory_fix="rerun with smaller settings"):
    """A script's entry point: main(argv) on the command line's arguments. A mistake in the
    user's input (InputError, a missing file), a device too small for the settings (with
    memory_fix, the flags that need less), a full disk or a folder without permission ends
    the run with one line; any other exception is a bug and keeps its traceback."""
    try:
        main(sys.argv[1:])
        if processes.WORLD > 1:
            processes.leave_processes()
    except (InputError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    except torch.OutOfMemoryError as e:
        what = str(e).strip().splitlines()[0]
        raise SystemExit(f"error: the GPU ran out of memory ({what}); {memory_fix}") from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            where = e.filename or "a file"
            raise SystemExit(f"error: could not write {where} ({e.strerror}); make room, then run "
                             f"it again") from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise SystemExit(f"error: {e.filename or 'a file'}: {e.strerror}; check its "
                             f"permissions, or pass a folder you can write to") from None
        raise
    except RuntimeError as e:  # the CPU's allocator raises a plain RuntimeError
        if "DefaultCPUAllocator: can't allocate memory" not in str(e):
            raise
        what = str(e).split("DefaultCPUAllocator: ")[-1].splitlines()[0]
        raise SystemExit(f"error: the CPU ran out of memory ({what}); {memory_fix}") from None


def parsed(add_args, argv):
    """A script's flags as it parses them (add_args: its add_*_args)."""
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(argv)


def add_training_args(p, lr, rank, alpha, dropout=0.0, warmup=0.03):
    """The flags every training script shares; each script passes its own defaults."""
    add_model_args(p)
    p.add_argument("--lr", type=number(float, 0, above=True), default=lr,
                   help="peak learning rate of the LoRA parameters")
    p.add_argument("--rank", type=number(int, 1), default=rank, help="LoRA rank")
    p.add_argument("--alpha", type=number(float, 0, above=True), default=alpha,
                   help="LoRA alpha (scale = alpha / rank)")
    p.add_argument("--lora-dropout", type=number(float, 0, below=1), default=dropout,
                   help="dropout on the LoRA path")
    p.add_argument("--weight-decay", type=number(float, 0), default=0.0, help="AdamW weight decay")
    p.add_argument("--warmup", type=number(float, 0, below=1), default=warmup,
                   help="fraction of steps with linear warmup, then cosine decay")
    p.add_argument("--grad-clip", type=number(float, 0), default=1.0,
                   help="clip the global gradient norm (0 = off)")
    p.add_argument("--grad-accum", type=number(int, 1), default=1,
                   help="micro-batches per optimizer step (at least)")
    p.add_argument("--micro-batch-tokens", type=number(int, 0), default=8192,
                   help="most tokens, padding included, in one forward and backward pass; each "
                        "step's sequences are split under it (0 = no bound)")
    p.add_argument("--max-update-norm", type=number(float, 0), default=0.0,
                   help="after each step, scale the adapter down to this update norm where it is "
                        "above (the table's column; 0 = no cap)")
    p.add_argument("--recompute", action="store_true",
                   help="keep only each layer's input for the backward pass and run the layer "
                        "again there: less activation memory for about a third more time, the "
                        "same gradients")
    p.add_argument("--max-steps", type=number(int, 0), default=0,
                   help="stop after this many steps (0 = the full run)")
    p.add_argument("--save-every", type=number(int, 1), default=50,
                   help="write a checkpoint every N steps")
    p.add_argument("--snapshot-every", type=number(int, 0), default=0,
                   help="also keep the adapter every N steps in <out>/snapshots/step-N, a run "
                        "folder of its own for evaluate.py and drift.py (0 = none)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the run folder's last checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of data order, sampling and dropout")


# what a training script's out-of-memory error says to do: the flags above that need less
MEMORY_FIX = "rerun with --resume and a smaller --micro-batch-tokens, or --recompute"
