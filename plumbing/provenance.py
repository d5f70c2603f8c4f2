"""
Provenance: whether a number is of what it says it is. Every result this code writes
carries a fingerprint, the dict of what decides it: the base model, the adapter's sha256
(None for the base) and the flags that measured it (FLAGS). A result is current where its
fingerprint is the one its flags give now, and two results share a column of a table where
theirs agree but for the adapter. A run folder's run.json answers the same question for a
training run: which base, which teacher, which settings. The toy's base keeps one digest of
its settings, world and code (study/organism.py). Every check stops with one line that says the fix.
"""
import hashlib
import json
import os

from plumbing.files import InputError, read_json

# the flags that decide each kind of result: an eval.json column, a drift.json
FLAGS = {"gsm8k": ("gsm8k_limit", "max_new_tokens"),
         "gsm8k_fewshot": ("gsm8k_limit", "gsm8k_fewshot", "max_new_tokens"),
         "gsm8k_samples": ("gsm8k_limit", "max_new_tokens", "samples"),
         "mmlu": ("mmlu_limit", "mmlu_shots", "mmlu_scoring", "seed"),
         "truthfulqa": ("truthfulqa_limit",),
         "drift": ("features", "embed", "prompts", "max_new_tokens", "temperature", "stride",
                   "seed")}


def digest(value):
    """One sha256 of a JSON value: the toy base's settings, world and code; drift's prompts."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def adapter_sha256(folder):
    """The sha256 of folder's adapter weights (None where it holds none): which adapter an
    eval.json or drift.json measured, so that a result of an adapter trained since is told
    from one of the adapter there now, and which teacher a student was distilled from."""
    path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def model_identity(model):
    """--model as a fingerprint holds it: a folder by where it resolves, a hub id by name."""
    return os.path.realpath(model) if os.path.isdir(model) else model


def same_model(a, b):
    """Whether --model a and b name one model: two folders by where they resolve, two hub ids
    by name; None where that cannot be told (a folder gone since, a folder against a hub id)."""
    local = os.path.isdir(a), os.path.isdir(b)
    if local == (True, True):
        return os.path.realpath(a) == os.path.realpath(b)
    if local == (False, False) and not os.path.isabs(a) and a.count("/") == 1:
        return a == b
    return None


def fingerprint(kind, settings, adapter_sha256=None):
    """What decides a result of kind (a key of FLAGS) measured with settings (a script's
    flags by name) on the adapter of that sha256. With --mmlu-limit 0 every MMLU question
    is asked, whichever the seed."""
    flags = [f for f in FLAGS[kind]
             if not (kind == "mmlu" and f == "seed" and settings["mmlu_limit"] == 0)]
    return dict(model=model_identity(settings["model"]), adapter_sha256=adapter_sha256,
                **{f: settings[f] for f in flags})


def first_difference(recorded, wanted, ignore=()):
    """(its flag, recorded value, wanted value) of the first setting in which two fingerprints
    differ, leaving out those in ignore; None where they agree."""
    for key in sorted(set(recorded) | set(wanted)):
        if key not in ignore and recorded.get(key) != wanted.get(key):
            return "--" + key.replace("_", "-"), recorded.get(key), wanted.get(key)
    return None


def current(folder, file, kinds, settings):
    """Whether folder/file holds a result of each of kinds measured with settings on the
    adapter folder holds now (reproduce.py measures again what is not). eval.json holds one
    result a column, under its kind; drift.json is one result."""
    path = os.path.join(folder, file)
    if not os.path.isfile(path):
        return False
    found, sha = read_json(path), adapter_sha256(folder)  # None for the base's folder
    return all(first_difference(found.get(kind, found).get("fingerprint", {}),
                                fingerprint(kind, settings, sha)) is None for kind in kinds)


def measured_with(found):
    """The flags the columns of an eval.json (found) were measured with, read from their
    fingerprints (GSM8K without a few-shot column: --gsm8k-fewshot 0): those a run of the same
    study is measured with, where its own are not given (evaluate.py)."""
    flags = {k: v for column in found.values() if isinstance(column, dict)
             for k, v in column.get("fingerprint", {}).items()}
    if "gsm8k" in found and "gsm8k_fewshot" not in found:
        flags["gsm8k_fewshot"] = 0
    return flags


def check_measured_alike(path, kinds, settings):
    """Stop unless the base's eval.json at path scored each of kinds as settings would, on the
    same model: forgetting compares a run with its base on the very same questions."""
    base = read_json(path)
    for kind in (k for k in kinds if k in base):
        recorded = base[kind].get("fingerprint", {})
        difference = first_difference(recorded, fingerprint(kind, settings))
        if difference:
            flag, theirs, ours = difference
            raise InputError(f"{path} scored {kind} with {flag} {theirs}, this evaluation with "
                             f"{ours}; forgetting compares a run with its base on the same "
                             f"questions: pass the base's flags, or evaluate 'base' again first")


def check_comparable(measured):
    """Stop where a number of a table is not of the adapter its folder holds now, or where two
    rows of one column were measured with other settings (other questions, rollouts, features
    or model): their difference would be the flags', not the training's. measured: (row,
    folder, column, fingerprint, the script that measures it) for every number."""
    first = {}
    for name, folder, column, found, script in measured:
        sha = adapter_sha256(folder) if name != "base" else None
        if found.get("adapter_sha256") != sha:
            raise InputError(f"{folder}'s {column} was measured on another adapter than the one "
                             f"there now (trained since, or measured by an earlier version of "
                             f"this code); measure it again: python {script}.py {folder}")
        seen_name, seen = first.setdefault(column, (name, found))
        difference = first_difference(seen, found, ignore=("adapter_sha256",))
        if difference:
            flag, theirs, ours = difference
            verb = "evaluate" if script == "evaluate" else "measure"
            raise InputError(f"{name}'s {column} was measured with {flag} {ours}, {seen_name}'s "
                             f"with {theirs}; {verb} both with the same flags to put them in "
                             f"one table")


# -----------------------------------------------------------------------------
# training runs: run.json

def run_record(folder):
    """A run folder's run.json (every setting, the git commit), or None."""
    path = os.path.join(folder, "run.json")
    return read_json(path) if os.path.isfile(path) else None


def check_same_base(folder, model, record=None):
    """Stop when the run in folder (its run.json: record, read where not given) was trained on
    another base than `model`: its adapter on another base of the same shapes would load
    without a word and give numbers that mean nothing. A folder without run.json (a peft
    adapter) is not checked."""
    trained_on = (record or run_record(folder) or {}).get("model")
    same = same_model(trained_on, model) if trained_on else True
    if same is None:
        print(f"note: {folder} was trained on base {trained_on}, which cannot be compared with "
              f"--model {model} here; make sure they are the same model")
    elif not same:
        raise InputError(f"{folder} was trained on base {trained_on}, but --model is {model}; "
                         f"pass --model {trained_on}")


def teacher_changed(folder):
    """Whether the run in folder was distilled from a run-folder teacher whose adapter is not
    the one there now: run.json keeps its sha256."""
    run = run_record(folder) or {}
    recorded = run.get("teacher_sha256")
    return recorded is not None and recorded != adapter_sha256(run["teacher"])


def changed_settings(before, settings, ignore=("resume",)):
    """'--flag old -> new' for each of settings whose value differs from before's (a run.json's
    settings, as run_record reads them)."""
    return [f"--{k.replace('_', '-')} {before[k]} -> {v}" for k, v in settings.items()
            if k not in ignore and k in before and before[k] != v]


def check_trained_as(folder, model, settings, ignore, what):
    """Stop unless the run in folder is `what` asks for: trained on this base, from the
    teacher there now, with these settings (leaving out those in ignore)."""
    record = run_record(folder)
    check_same_base(folder, model, record)
    if teacher_changed(folder):
        raise InputError(f"{folder} was distilled from an earlier adapter of its teacher than the "
                         f"one there now; delete the folder to train it again, or pass another "
                         f"--out")
    changed = changed_settings(record or {}, settings, ignore)
    if changed:
        raise InputError(f"{folder} was trained with other settings than {what} "
                         f"({'; '.join(changed)}); delete the folder, or pass another --out")
