"""
Run folders: what surrounds a training run's loop, shared by sft.py, rl.py and opd.py (and
read by evaluate.py, drift.py and reproduce.py). A run folder, out/<run>/, holds run.json
(every argument, the git commit), log.jsonl (one line a step), the latest adapter (PEFT
format), checkpoint/ (adapter + optimizer state + step) and, with --snapshot-every,
snapshots/step-N/ (each a finished run folder of its own). RunFolder keeps what
docs/runs.md promises: atomic checkpoints, resume to the same adapter, one process a
folder, a stop between steps on a signal. Whether a run is of the settings asked for is
provenance.py's question. The model does not import it.
"""
import atexit
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import torch
from tqdm import tqdm

import lora
from model import load, model_folder, read_config
from plumbing import processes, provenance
from plumbing.files import InputError, read_safetensors_file, write_atomic, write_json

try:
    import fcntl
except ImportError:  # Windows: no flock, so nothing is held there
    fcntl = None


# -----------------------------------------------------------------------------
# run folders

# the folders this process holds: real path -> its open .lock file (None where it took none)
HELD = {}


def hold(folder, instead=", or pass another --out"):
    """Hold folder for this process, or stop with one line if another process holds it: two
    runs writing one folder would interleave their logs and overwrite each other's
    checkpoints. The lock is the operating system's (flock on folder/.lock), so it ends
    with the process however that ends. Holding a folder this process holds does nothing,
    and so does every process of torchrun's but the one that writes (RANK 0)."""
    key = os.path.realpath(folder)
    if key in HELD or processes.RANK:
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
        raise InputError(f"{folder} is in use by another process (pid {holder}); wait for it to "
                         f"end{instead}") from None
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


def read_log(path):
    """The records of a log.jsonl, leaving out a last line cut short by a killed run."""
    records = []
    with open(path) as f:
        for line in f.read().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def condition(run_name):
    """The condition a run folder belongs to: 'stress-seed2' -> 'stress'."""
    return re.sub(r"-seed\d+$", "", run_name)


def last_checkpoint(folder):
    """checkpoint/, or checkpoint.old/ where a save stopped between its two renames; else None."""
    ckpt = os.path.join(folder, "checkpoint")
    return next((f for f in (ckpt, ckpt + ".old") if os.path.isdir(f)), None)


def run_finished(folder):
    return "finished_steps" in (provenance.run_record(folder) or {})


def git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, cwd=here).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def check_run_folder(folder, model, also=""):
    """Stop unless folder holds a run's adapter, trained on `model` and not in use by another
    process (a run still training, an evaluation writing it); also names what else the
    caller takes in place of a run folder."""
    if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
        left = set(os.listdir(folder)) if os.path.isdir(folder) else set()
        # a study's folder holds a .lock too (reproduce.py, evaluate.py base): never "delete it"
        if left & {"run.json", "log.jsonl"} or left == {".lock"}:
            raise InputError(f"{folder} holds a run that never trained to its first checkpoint (no "
                             f"adapter); train it again, or delete the folder")
        raise InputError(f"{folder} is not a run folder (no adapter_config.json); name a folder "
                         f"written by sft.py, rl.py or opd.py{also}")
    holder = held_elsewhere(folder)
    if holder:
        raise InputError(f"{folder} is in use by another process (pid {holder}), which trains or "
                         f"evaluates it; wait for it to end")
    provenance.check_same_base(folder, model)
    if provenance.run_record(folder) is not None and not run_finished(folder):
        print(f"note: the run in {folder} has not finished (stopped before its last step); using "
              f"its last adapter")


def check_teacher(teacher, base):
    """Stop unless --teacher is a run folder trained on base, a model folder or a hub id (whose
    files it fetches), before any model loads: a mistyped path is said first, not after the
    student's model is loaded, or fetched."""
    if not os.path.isdir(teacher):
        model_folder(teacher, "--teacher")
    elif not os.path.isfile(os.path.join(teacher, "config.json")):
        check_run_folder(teacher, base, also=", or a model folder (config.json)")


def load_teacher(model, tok, teacher, base):
    """(teacher model, its adapter), of a teacher check_teacher passed: adapter 'teacher' on the
    student's shared base, the base itself (adapter None), or another model of the same
    tokenizer in a copy of its own."""
    if os.path.isdir(teacher) and not os.path.isfile(os.path.join(teacher, "config.json")):
        lora.load_adapter(model, teacher, name="teacher", activate=False)
        return model, "teacher"
    if provenance.same_model(teacher, base):  # the base itself, however spelt: no second copy
        return model, None
    folder = model_folder(teacher, "--teacher")
    # token ids pass between the two models both ways, and their logits meet column by column
    mismatch = InputError(f"--teacher {teacher} has another tokenizer or vocabulary than "
                            f"--model {base}; pick a teacher of the student's model family")
    if read_config(folder).vocab_size != model.config.vocab_size:
        raise mismatch
    net, teacher_tok = load(folder, model.lm_head.weight.device, model.lm_head.weight.dtype)
    if teacher_tok.tok.get_vocab() != tok.tok.get_vocab():
        raise mismatch
    return net, None


class RunFolder:
    """A training run's folder. Every file is written atomically and checkpoint/ and each
    snapshot are replaced as a whole, so an interrupted run always has one whole
    checkpoint; run.json comes with the first, so a run that fails before it leaves no
    folder behind (or, killed, one without run.json, which other scripts name as such)."""

    def __init__(self, folder, settings):
        """settings: the run's flags by name (vars of its parsed arguments), kept in run.json."""
        self.folder, self.settings = folder, settings
        self.ckpt, self.log_path = (os.path.join(folder, f) for f in ("checkpoint", "log.jsonl"))
        self.snapshots = os.path.join(folder, "snapshots")
        self.stop_requested = None  # the name of the signal that asked the run to stop
        if os.path.isfile(os.path.join(folder, "config.json")):
            raise InputError(f"--out {folder} is a model folder (config.json); pass a folder of "
                             f"its own for the run")
        self.created = not os.path.isdir(folder)
        hold(folder)  # until finish, a failure in the loop, or the end of this process
        if self.created:  # however the process ends before its first checkpoint, the folder goes
            atexit.register(self.discard_if_untrained)
        try:
            self.check_start()
        except BaseException:
            self.discard_if_untrained()
            raise
        teacher = settings.get("teacher")  # which adapter a run-folder teacher (opd.py) held
        self.record = {**settings, "git_commit": git_commit(),
                       **({"teacher_sha256": lora.adapter_sha256(teacher)} if teacher else {})}

    def check_start(self):
        """A fresh run, or a resume that continues the same run: anything else stops here."""
        folder, settings, resume = self.folder, self.settings, self.settings["resume"]
        has_checkpoint = last_checkpoint(self.folder) is not None
        if not resume and has_checkpoint:
            raise InputError(f"{folder} already holds a trained run; pass --resume to continue "
                             f"it or --out for a new folder")
        if not resume and os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
            raise InputError(f"{folder} already holds a trained adapter (and no checkpoint to "
                             f"continue it from); pass --out for a new folder, or delete {folder} "
                             f"to train it again")
        if resume and not has_checkpoint:
            raise InputError(f"{folder} has no checkpoint to resume from; drop --resume to start "
                             f"the run")
        if not resume:
            if not processes.RANK:  # what a run killed before its first checkpoint left: one removes it
                for leftover in (self.log_path, os.path.join(folder, "run.json")):
                    if os.path.isfile(leftover):
                        os.remove(leftover)
                shutil.rmtree(self.snapshots, ignore_errors=True)
            return
        provenance.check_same_base(folder, settings["model"])
        teacher = settings.get("teacher")
        if provenance.teacher_changed(folder, lora.adapter_sha256(teacher) if teacher else None):
            raise InputError(f"{folder} was distilled from another adapter than {teacher} holds "
                             f"now (trained further or again since); put back the teacher it "
                             f"started from, or start a new run with --out")
        # the checkpoint's adapter has its rank, and its alpha set the scale it trained under
        shape = {k: settings[k] for k in ("rank", "alpha")}
        reshaped = provenance.changed_settings(folder, shape)
        if reshaped:
            raise InputError(f"{folder}'s adapter was trained with other LoRA settings "
                             f"({'; '.join(reshaped)}); resume with its own, or start a new run "
                             f"with --out")
        changed = provenance.changed_settings(folder, settings)
        if changed:
            print(f"note: resuming {folder} with changed settings: {'; '.join(changed)}")

    def discard_if_untrained(self):
        """Let the folder go, and delete it where this run made it and wrote no checkpoint."""
        if os.path.realpath(self.folder) not in HELD:  # let go already: another run may hold it now
            return
        let_go(self.folder)
        if self.created and last_checkpoint(self.folder) is None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def resume(self, model, optimizer, name="default"):
        """Load the last checkpoint into model and optimizer; returns the step to start at."""
        folder = last_checkpoint(self.folder)
        state = torch.load(os.path.join(folder, "trainer.pt"), map_location="cpu",
                           weights_only=True)
        weights = os.path.join(folder, "adapter_model.safetensors")
        lora.assign_adapter_tensors(model, read_safetensors_file(weights), name, weights)
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        if not processes.RANK:  # the process that writes
            if os.path.isfile(self.log_path):  # forget the log lines of steps after the checkpoint
                kept = [r for r in read_log(self.log_path) if r["step"] <= step]
                text = "".join(json.dumps(r) + "\n" for r in kept)
                write_atomic(self.log_path, lambda p: open(p, "w").write(text))
            for entry in os.listdir(self.snapshots) if os.path.isdir(self.snapshots) else []:
                # and snapshots of later steps, whole or half-written
                found = re.fullmatch(r"step-(\d+)(\.tmp)?", entry)
                if found and (found[2] or int(found[1]) > step):
                    shutil.rmtree(os.path.join(self.snapshots, entry))
            write_json(os.path.join(self.folder, "run.json"), self.record)
        print(f"resuming {self.folder} at step {step}")
        return step

    def save(self, model, optimizer, step, name="default"):
        if processes.RANK:  # under torchrun, one process writes
            return
        tmp, old = self.ckpt + ".tmp", self.ckpt + ".old"
        shutil.rmtree(tmp, ignore_errors=True)
        lora.save_adapter(model, tmp, name)
        torch.save({"optimizer": optimizer.state_dict(), "step": step},
                   os.path.join(tmp, "trainer.pt"))
        if os.path.isdir(self.ckpt):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.ckpt, old)
        os.replace(tmp, self.ckpt)
        shutil.rmtree(old, ignore_errors=True)
        lora.save_adapter(model, self.folder, name)
        if provenance.run_record(self.folder) is None:  # the run's first checkpoint
            write_json(os.path.join(self.folder, "run.json"), self.record)

    def step_seed(self, step):
        """The seed of (--seed, step), 2^20 apart: a step's samples (step_seed + r) meet no
        other step's."""
        return (self.settings["seed"] * 1_000_003 + step) << 20

    def steps(self, model, optimizer, end, desc):
        """The run's steps, from 0 or (--resume) its last checkpoint up to end: before each, torch
        seeded with step_seed and the clock started for log; after each, end_step (a snapshot,
        a checkpoint, a stop asked for); after the last, finish. A stop signal ends the run
        after a whole step, saved (stop_between_steps)."""
        start = self.resume(model, optimizer) if self.settings["resume"] else 0
        self.bar = tqdm(range(start, end), initial=start, total=end, desc=desc,
                        disable=processes.RANK > 0)
        with self.stop_between_steps():
            for step in self.bar:
                self.started = time.time()
                torch.manual_seed(self.step_seed(step))  # dropout; per step: a resume matches
                yield step
                self.end_step(model, optimizer, step + 1, end)
        self.finish(end)

    @contextlib.contextmanager
    def stop_between_steps(self):
        """Around a training loop: Ctrl-C (SIGINT) or SIGTERM, what a cluster's scheduler sends
        before it takes the machine back, lets the current step finish, and end_step then
        writes its checkpoint and ends the run, so nothing trained is lost. A second signal
        stops at once, back at the last checkpoint (under torchrun, which passes its signal on
        to its processes, only its SIGKILL 30 s later does). A loop that ends in an exception lets
        the folder go (and deletes it, where the run made it and never checkpointed)."""
        def request_stop(signum, frame):
            # torchrun passing on the signal its processes had already
            if self.stop_requested and processes.WORLD > 1:
                return
            if self.stop_requested:
                raise KeyboardInterrupt
            self.stop_requested = signal.Signals(signum).name
            print(f"\n{self.stop_requested}: {self.folder} stops after this step with a checkpoint "
                  f"of it; Ctrl-C again to stop now, back at the last checkpoint", file=sys.stderr,
                  flush=True)

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
        stopping = processes.summed(self.stop_requested is not None)[0] > 0 and step < end
        try:
            if self.settings["snapshot_every"] and step % self.settings["snapshot_every"] == 0:
                self.snapshot(model, step)
            if step % self.settings["save_every"] == 0 or step == end or stopping:
                self.save(model, optimizer, step)
        except OSError as e:  # a full disk, above all: each write is whole or absent: say which
            left = ("the last checkpoint written is intact: make room, then continue with "
                    "--resume" if last_checkpoint(self.folder) else "no checkpoint was written "
                    "before it: make room, then start the run again")
            raise InputError(f"could not write step {step}'s adapter to {self.folder} "
                             f"({e.strerror or e}); {left}") from None
        if stopping:
            raise SystemExit(f"stopped by {self.stop_requested or 'a signal'} after step {step} of "
                             f"{end}, its checkpoint written to {self.ckpt}; continue with "
                             f"--resume (reproduce.py resumes by itself)")

    def snapshot(self, model, step, name="default"):
        """The adapter after `step` steps in snapshots/step-<step>, with run.json and the log so
        far: a finished run folder of its own, which evaluate.py and drift.py take."""
        if processes.RANK:
            return
        folder = os.path.join(self.snapshots, f"step-{step:06d}")
        shutil.rmtree(folder + ".tmp", ignore_errors=True)
        lora.save_adapter(model, folder + ".tmp", name)
        write_json(os.path.join(folder + ".tmp", "run.json"),
                   {**self.record, "finished_steps": step})
        shutil.copy(self.log_path, os.path.join(folder + ".tmp", "log.jsonl"))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(folder + ".tmp", folder)

    def finish(self, step):
        """Mark the run complete in run.json (reproduce.py skips finished runs) and let the
        folder go; a stop asked for during the last step ends the program here."""
        if not processes.RANK:
            write_json(os.path.join(self.folder, "run.json"),
                       {**self.record, "finished_steps": step})
        let_go(self.folder)
        if self.stop_requested is not None:
            raise SystemExit(f"stopped by {self.stop_requested} at the run's last step; "
                             f"{self.folder} is complete")

    def log(self, record, **means):
        """One line of log.jsonl: record, each of means as a mean over every process's items
        (given as this process's (sum, count)), and the step's seconds."""
        sums = processes.summed(*(v for pair in means.values() for v in pair))
        record = {**record, **{k: sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else None
                               for i, k in enumerate(means)}, "seconds": time.time() - self.started}
        self.bar.set_postfix({k: f"{record[k]:.4f}" for k in ("loss", "reward")
                              if record.get(k) is not None})
        if processes.RANK:
            return
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def check_finite(self, step, loss):
        if not math.isfinite(loss):
            raise SystemExit(f"step {step}: loss is {loss}; stopped. The last good checkpoint in "
                             f"{self.ckpt} is intact: lower --lr and continue with --resume")
