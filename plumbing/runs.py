"""
Run folders: what surrounds a training run's loop, shared by sft.py, rl.py and opd.py (and
read by evaluate.py, drift.py and reproduce.py). A run folder, out/<run>/, holds run.json
(every argument, the git commit), log.jsonl (one line a step), the latest adapter (PEFT
format), checkpoint/ (adapter + optimizer state + step) and, with --snapshot-every,
snapshots/step-N/ (each a finished run folder of its own). RunFolder keeps what
docs/runs.md promises: atomic checkpoints, resume to the same adapter, one process a
folder, a stop between steps on a signal. Whether a run is of the settings asked for is
provenance.py's question.
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

from plumbing import processes, provenance
from plumbing.files import InputError, write_atomic, write_json

try:
    import fcntl
except ImportError:  # Windows: no flock, so nothing is held there
    fcntl = None


# -----------------------------------------------------------------------------
# run folders

# the folders this process has locked: real path -> its open .lock file (None where it took none)
LOCKS = {}


def lock(folder, instead=", or pass another --out"):
    """Lock folder for this process, or stop with one line if another process has: two runs
    writing one folder would interleave their logs and overwrite each other's checkpoints.
    The lock is the operating system's (flock on folder/.lock), so it ends with the process
    however that ends. Locking a folder this process has locked does nothing, and so does
    every process of torchrun's but the one that writes (RANK 0)."""
    key = os.path.realpath(folder)
    if key in LOCKS or processes.RANK:
        return
    os.makedirs(folder, exist_ok=True)
    if fcntl is None:
        LOCKS[key] = None
        return
    handle = open(os.path.join(folder, ".lock"), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise InputError(f"{folder} is in use by another process (pid {holder}); wait for it to "
                         f"end{instead}") from None
    except OSError as e:  # a file system without locks (some network mounts)
        handle.close()
        print(f"note: cannot lock {folder} ({e.strerror or e}); run one script at a time in it")
        LOCKS[key] = None
        return
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    LOCKS[key] = handle


def unlock(folder):
    handle = LOCKS.pop(os.path.realpath(folder), None)
    if handle is not None:
        handle.close()  # closing the file ends its flock


@contextlib.contextmanager
def locked(*folders, instead=", or pass another --out"):
    """lock each folder for a with block; at its end unlock those it locked."""
    took = [f for f in folders if os.path.realpath(f) not in LOCKS]
    try:
        for folder in folders:
            lock(folder, instead)
        yield
    finally:
        for folder in took:
            unlock(folder)


def locked_elsewhere(folder):
    """The pid of another process that has locked folder, else None."""
    path = os.path.join(folder, ".lock")
    if fcntl is None or os.path.realpath(folder) in LOCKS or not os.path.isfile(path):
        return None
    with open(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken only where none holds it
        except BlockingIOError:
            return handle.read().strip() or "unknown"
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
    """Stop unless folder holds a run's adapter, trained on `model` (None: whichever) and not in
    use by another process (a run still training, an evaluation writing it); also names what
    else the caller takes in place of a run folder. Returns its run.json (None: a peft
    adapter without one)."""
    if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
        left = set(os.listdir(folder)) if os.path.isdir(folder) else set()
        # a study's folder holds a .lock too (reproduce.py, evaluate.py base): never "delete it"
        if left & {"run.json", "log.jsonl"} or left == {".lock"}:
            raise InputError(f"{folder} holds a run that never trained to its first checkpoint (no "
                             f"adapter); train it again, or delete the folder")
        raise InputError(f"{folder} is not a run folder (no adapter_config.json); name a folder "
                         f"written by sft.py, rl.py or opd.py{also}")
    holder = locked_elsewhere(folder)
    if holder:
        raise InputError(f"{folder} is in use by another process (pid {holder}), which trains or "
                         f"evaluates it; wait for it to end")
    record = provenance.run_record(folder)
    if model is not None:
        provenance.check_same_base(folder, model, record)
    if record is not None and "finished_steps" not in record:
        print(f"note: the run in {folder} has not finished (stopped before its last step); using "
              f"its last adapter")
    return record


class RunFolder:
    """A training run's folder. Every file is written atomically and checkpoint/ and each
    snapshot are replaced as a whole, so an interrupted run always has one whole
    checkpoint; run.json comes with the first, so a run that fails before it leaves no
    folder behind (or, killed, one without run.json, which other scripts name as such)."""

    def __init__(self, folder, settings, adapters, pinned=None):
        """settings: the run's flags by name (vars of its parsed arguments), kept in run.json;
        adapters: what writes and reads the adapter a checkpoint holds (the lora module, with
        its save_adapter and restore_adapter), passed in so that the plumbing imports no model
        code; pinned: what run.json keeps beside the settings that a resume must find the same
        (opd.py: its teacher's adapter digest)."""
        self.folder, self.settings, self.adapters = folder, settings, adapters
        self.pinned = pinned or {}
        self.ckpt, self.log_path = (os.path.join(folder, f) for f in ("checkpoint", "log.jsonl"))
        self.snapshots = os.path.join(folder, "snapshots")
        self.stop_requested = None  # the name of the signal that asked the run to stop
        if os.path.isfile(os.path.join(folder, "config.json")):
            raise InputError(f"--out {folder} is a model folder (config.json); pass a folder of "
                             f"its own for the run")
        self.created = not os.path.isdir(folder)
        lock(folder)  # until finish, a failure in the loop, or the end of this process
        if self.created:  # however the process ends before its first checkpoint, the folder goes
            atexit.register(self.discard_if_untrained)
        try:
            self.check_start()
        except BaseException:
            self.discard_if_untrained()
            raise
        self.record = {**settings, "git_commit": git_commit(), **self.pinned}

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
            if not processes.RANK:  # what a run killed before its first checkpoint left
                for leftover in (self.log_path, os.path.join(folder, "run.json")):
                    if os.path.isfile(leftover):
                        os.remove(leftover)
                shutil.rmtree(self.snapshots, ignore_errors=True)
            return
        before = provenance.run_record(folder) or {}
        provenance.check_same_base(folder, settings["model"], before)
        for key, value in self.pinned.items():
            if key in before and before[key] != value:
                raise InputError(f"{folder} was trained with {key} {before[key]}, which is "
                                 f"{value} now (a teacher trained further since, say); put back "
                                 f"what the run started from, or start a new run with --out")
        # the checkpoint's adapter has its rank, and its alpha set the scale it trained under
        shape = {k: settings[k] for k in ("rank", "alpha")}
        reshaped = provenance.changed_settings(before, shape)
        if reshaped:
            raise InputError(f"{folder}'s adapter was trained with other LoRA settings "
                             f"({'; '.join(reshaped)}); resume with its own, or start a new run "
                             f"with --out")
        changed = provenance.changed_settings(before, settings)
        if changed:
            print(f"note: resuming {folder} with changed settings: {'; '.join(changed)}")

    def discard_if_untrained(self):
        """Unlock the folder, and delete it where this run made it and wrote no checkpoint."""
        if os.path.realpath(self.folder) not in LOCKS:  # unlocked already: another run may hold it
            return
        unlock(self.folder)
        if self.created and last_checkpoint(self.folder) is None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def resume(self, model, optimizer, name="default"):
        """Load the last checkpoint into model and optimizer; returns the step to start at."""
        folder = last_checkpoint(self.folder)
        state = torch.load(os.path.join(folder, "trainer.pt"), map_location="cpu",
                           weights_only=True)
        self.adapters.restore_adapter(model, folder, name)
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
        self.adapters.save_adapter(model, tmp, name)
        torch.save({"optimizer": optimizer.state_dict(), "step": step},
                   os.path.join(tmp, "trainer.pt"))
        if os.path.isdir(self.ckpt):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.ckpt, old)
        os.replace(tmp, self.ckpt)
        shutil.rmtree(old, ignore_errors=True)
        self.adapters.save_adapter(model, self.folder, name)
        if provenance.run_record(self.folder) is None:  # the run's first checkpoint
            write_json(os.path.join(self.folder, "run.json"), self.record)

    def step_seed(self, step):
        """The seed of (--seed, step), 2^20 apart: a step's samples (step_seed + r) meet no
        other step's."""
        return (self.settings["seed"] * 1_000_003 + step) << 20

    def steps(self, model, optimizer, total, desc):
        """The run's steps, from 0 or (--resume) its last checkpoint up to total, the schedule's
        length, or --max-steps where that is fewer: before each, torch seeded with step_seed
        and the clock started for log; after each, end_step (a snapshot, a checkpoint, a stop
        asked for); after the last, finish. A stop signal ends the run after a whole step,
        saved (stop_between_steps)."""
        end = min(total, self.settings.get("max_steps") or total)
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
        self.adapters.save_adapter(model, folder + ".tmp", name)
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
        unlock(self.folder)
        if self.stop_requested is not None:
            raise SystemExit(f"stopped by {self.stop_requested} at the run's last step; "
                             f"{self.folder} is complete")

    def log(self, record, **means):
        """One line of log.jsonl: record less its None values (a flag not given), each of means
        as a mean over every process's items (given as this process's (sum, count)), and the
        step's seconds."""
        sums = processes.summed(*(v for pair in means.values() for v in pair))
        record = {k: v for k, v in record.items() if v is not None}
        record.update({k: sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else None
                       for i, k in enumerate(means)}, seconds=time.time() - self.started)
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
