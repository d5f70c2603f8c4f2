"""
The whole study in one command: the base evaluation, mild and stress SFT, OPD from each
SFT teacher, one-step logit-KL OPD, on-policy RL; evaluation and rollout-state drift of
every run; then results.md / results.json in the paper's Table 2 layout with the paper's
numbers beside ours. Two conditions go beyond the paper: kd-stress, OPD from the stress
teacher with the teacher's own rollouts as states (offline distillation), so that
opd-stress and kd-stress differ in the state source alone; and opd-sampled, the OPD most
used today (the teacher's log-ratio at the student's sampled token as an advantage). And
P3's pair: OPD and offline distillation from a teacher degraded on purpose (degraded: stress
SFT with every gold answer's final number wrong), since the toy's stress SFT gains.

    python reproduce.py                    # preset toy: the CPU-scale model organism (toy.py),
                                           # offline, from the base shipped in toy-base/
    python reproduce.py --preset toy --seeds 3
    python reproduce.py --preset paper     # Qwen3-0.6B-Base, the paper's settings (one GPU)
    python reproduce.py --preset smoke     # every stage on a tiny random model: a pipeline check
    python reproduce.py --study frontier   # forgetting at matched gain (docs/frontier-study.md)
    python reproduce.py --study size       # at a matched update norm (docs/size-study.md)
    python reproduce.py --conditions mild,stress,rl   # those alone (an OPD run brings its teacher)

Every stage is skipped when its outputs exist (an evaluation or drift only when it is of the
adapter there now, measured with the preset's flags), and an interrupted training run resumes
from its last checkpoint, so a stopped study continues where it stopped. Per-stage wall time is
printed and kept in timings.json. On a CPU, conditions train side by side (--jobs), each in a
process of its own that writes to out/<preset>/logs/<condition>.log.

The smoke preset runs every stage on a tiny *random-weight* Qwen3 built on the spot (no
download): it checks that the pipeline works end to end, and its numbers mean nothing.
"""
import argparse
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent import futures

import torch

import data
import drift
import evaluate
import model as M
import opd
import rl
import sft
from plumbing import cli, processes, provenance, runs
from plumbing.files import InputError, read_json, write_json
from study import frontier, organism, report, size

SCRIPTS = {"sft": sft.main, "rl": rl.main, "opd": opd.main}
PARSERS = {"sft": sft.parse_args, "rl": rl.parse_args, "opd": opd.parse_args}
# flags that say where a run lives or how it was computed, not what it learned
NOT_SETTINGS = ("resume", "out", "model", "data_dir", "device", "dtype", "recompute", "grad_accum",
                "micro_batch_tokens", "save_every", "snapshot_every")


TOY_STUDIES = {"frontier": frontier, "size": size}  # beside the main study: its module


def runs_of(out, seed=0):
    """name -> (script, arguments): the paper's six conditions, kd-stress (opd-stress on the
    teacher's states), opd-sampled, and P3's degraded teacher with its pair. Seed 0 writes
    out/<condition>, seed s > 0 out/<condition>-seed<s> (its OPD teachers too)."""
    tag = f"-seed{seed}" if seed else ""
    mild, stress, degraded = (os.path.join(out, teacher + tag)
                              for teacher in ("mild", "stress", "degraded"))
    conditions = {
        "mild": ("sft", ["--preset", "mild"]),
        "stress": ("sft", ["--preset", "stress"]),
        "opd-mild": ("opd", ["--teacher", mild]),
        "opd-stress": ("opd", ["--teacher", stress]),
        "kd-stress": ("opd", ["--teacher", stress, "--state-source", "teacher"]),
        "opd-logits": ("opd", ["--teacher", stress, "--signal", "logits"]),
        "opd-sampled": ("opd", ["--teacher", stress, "--signal", "sampled"]),
        "rl": ("rl", []),
        # P3's teacher, degraded on purpose: stress SFT with every final number wrong
        "degraded": ("sft", ["--preset", "stress", "--wrong-answers", "1"]),
        "opd-degraded": ("opd", ["--teacher", degraded]),
        "kd-degraded": ("opd", ["--teacher", degraded, "--state-source", "teacher"]),
    }
    return {name + tag: (script, [*argv, "--seed", str(seed)])
            for name, (script, argv) in conditions.items()}


# the toy's scoring: zero-shot prompts (its context is 256 tokens), MMLU by each choice's text
TOY_EVAL = ["--gsm8k-fewshot", "0", "--mmlu-shots", "0", "--mmlu-scoring", "text",
            "--max-new-tokens", "96"]
PRESETS = {
    "paper": dict(model=cli.DEFAULT_MODEL, train={}, eval=[], drift=[]),
    "smoke": dict(
        model=None,  # built on the spot
        train={"sft": ["--train-limit", "32", "--batch-size", "4", "--max-steps", "4"],
               "rl": ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16",
                      "--max-steps", "2"],
               "opd": ["--prompts-per-step", "2", "--max-new-tokens", "16",
                       "--continuation-tokens", "8", "--max-steps", "2"]},
        eval=["--gsm8k-limit", "4", "--gsm8k-fewshot", "1", "--max-new-tokens", "16",
              "--mmlu-limit", "4", "--mmlu-shots", "1", "--truthfulqa-limit", "4",
              "--batch-size", "4"],
        drift=["--prompts", "4", "--max-new-tokens", "24", "--stride", "8",
               "--permutations", "20"]),
    # the CPU-scale model organism (toy.py): hyperparameters scaled for a 1.0M-parameter base
    "toy": dict(
        model="toy",
        toy=[],
        # settings chosen by each method's training signal (docs/toy-study.md)
        train={"sft": ["--train-limit", "1000"],
               "mild": ["--lr", "2e-3", "--epochs", "3"],
               "stress": ["--lr", "5e-3"],
               "degraded": ["--lr", "5e-3"],
               "rl": ["--steps", "100", "--prompts-per-step", "4", "--group-size", "16",
                      "--max-new-tokens", "96", "--lr", "3e-4", "--warmup", "0.05"],
               "opd": ["--steps", "360", "--max-new-tokens", "96",
                       "--continuation-tokens", "32", "--lr", "3e-3"]},
        # the whole 500-problem test split (evaluate.py's default; docs/toy-study.md's sixth rule)
        eval=TOY_EVAL + ["--mmlu-limit", "0", "--truthfulqa-limit", "0", "--batch-size", "32"],
        eval_base=["--samples", "16"],  # pass@16 of the base, for its calibration band
        drift=["--prompts", "200", "--max-new-tokens", "96"]),
    # the same stages on a miniature world and model, for CI: minutes, not meaningful
    "toy-mini": dict(
        model="toy",
        toy=["--pretrain-steps", "30", "--hidden", "64", "--layers", "2", "--vocab", "512",
             "--batch", "8", "--target-problems", "200"],
        train={"sft": ["--batch-size", "8", "--max-steps", "3"],
               "rl": ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16",
                      "--max-steps", "2"],
               "opd": ["--prompts-per-step", "2", "--max-new-tokens", "16",
                       "--continuation-tokens", "8", "--max-steps", "2"]},
        eval=TOY_EVAL[:-2] + ["--max-new-tokens", "16", "--gsm8k-limit", "4", "--mmlu-limit", "4",
                              "--truthfulqa-limit", "4", "--batch-size", "4"],
        drift=["--prompts", "4", "--max-new-tokens", "16", "--stride", "8",
               "--permutations", "20"]),
}


def build_smoke_model(folder, data_dir):
    """A tiny random Qwen3 and a byte-level BPE tokenizer trained on GSM8K text."""
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    os.makedirs(folder, exist_ok=True)
    rows = data.load_gsm8k("train", data_dir)[:2000]
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]
    tok_path = organism.train_tokenizer(texts, os.path.join(folder, "tokenizer.json"),
                                        vocab_size=512)
    config = M.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                           tie_word_embeddings=True, max_position_embeddings=4096, eos_token_id=0)
    net, g = M.Qwen3(config), torch.Generator().manual_seed(0)
    for name, p in net.named_parameters():  # normal(0, 0.1), norms at one
        norm = name.endswith("norm.weight")
        p.data = torch.ones_like(p) if norm else torch.randn(p.shape, generator=g) * 0.1
    return M.save(net, folder, tok_path)


class Stages:
    """Runs named stages once each, timing them into timings.json (out None: a worker's, whose
    timings go back to the study). A stage is (name, done, run): done() is asked just before
    it, so that it sees what the stages before it made."""

    def __init__(self, out):
        self.path = out and os.path.join(out, "timings.json")
        self.timings = json.load(open(self.path)) if out and os.path.isfile(self.path) else {}
        self.ran = 0

    def run(self, stages):
        for name, done, run in stages:
            if self.said_done(name, done()):
                continue
            t0 = time.time()
            run()
            self.record({name: time.time() - t0})

    def said_done(self, name, done):
        print(f"[{'done already' if done else 'running'}] {name}")
        return done

    def record(self, timings):
        for name, seconds in timings.items():
            self.timings[name] = round(seconds, 1)
            self.ran += 1
            print(f"[finished] {name} in {seconds:.1f}s")
        if self.path:
            write_json(self.path, self.timings)


def run_conditions(stages, jobs, conditions, preset_name, out, model, common):
    """Every condition's stages (condition_stages). With jobs > 1, up to that many conditions
    at once, each in a process of its own with an equal share of the CPU threads, a condition
    once its teacher's run is done: a tiny model's steps run on two threads little faster than
    on one, so on a CPU runs side by side finish sooner (the bits of one at a time with as many
    threads: another thread count rounds sums otherwise, as another CPU does). A worker's output
    goes to out/logs/<condition>.log."""
    arguments = {name: (preset_name, out, name, *conditions[name], model, common)
                 for name in conditions}  # condition_stages's
    stages_of = {name: condition_stages(*arguments[name]) for name in conditions}
    if jobs == 1:
        return stages.run([stage for name in conditions for stage in stages_of[name]])
    teacher = teachers(conditions, out)
    waiting = sorted(conditions, key=lambda name: name not in teacher.values())  # teachers first
    running = {}  # future -> name
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    threads = max(1, torch.get_num_threads() // jobs)
    with futures.ProcessPoolExecutor(jobs, multiprocessing.get_context("spawn"),
                                     initializer=orphan_guard, initargs=(os.getpid(),)) as pool:
        while waiting or running:
            for name in list(waiting):  # a teacher done already frees its students at once
                if len(running) == jobs:
                    break
                if teacher[name] in waiting or teacher[name] in running.values():
                    continue
                waiting.remove(name)
                # said as they stand now; the worker asks each again just before it runs it
                if not all([stages.said_done(n, done()) for n, done, _ in stages_of[name]]):
                    log = os.path.join(out, "logs", f"{name}.log")
                    running[pool.submit(condition_worker, threads, log, *arguments[name])] = name
            finished, _ = futures.wait(running, return_when=futures.FIRST_COMPLETED)
            for future in finished:
                name = running.pop(future)
                if future.exception():  # the others running finish; nothing more starts
                    print(f"[failed] {name}: {os.path.join(out, 'logs', name + '.log')}")
                    raise future.exception()
                stages.record(future.result())


def teachers(conditions, out):
    """name -> the condition whose run it learns from (an OPD run's teacher), or None."""
    folders = {os.path.join(out, name): name for name in conditions}
    return {name: folders.get(extra[extra.index("--teacher") + 1]) if "--teacher" in extra
            else None for name, (_, extra) in conditions.items()}


def chosen(conditions, names, out):
    """The conditions named (--conditions; every seed's), and the runs they learn from."""
    known = sorted({runs.condition(name) for name in conditions})
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise InputError(f"--conditions: no condition {', '.join(unknown)} in this study; "
                         f"pick from {','.join(known)}")
    teacher, keep = teachers(conditions, out), [n for n in conditions if runs.condition(n) in names]
    for name in keep:  # grows as it goes: a teacher's own teacher comes too
        if teacher[name] and teacher[name] not in keep:
            keep.append(teacher[name])
    return {name: run for name, run in conditions.items() if name in keep}


def orphan_guard(parent):
    """A worker's watch on the study's process: once that is gone, stop as a stopped run stops
    (SIGTERM: after its step, with a checkpoint), then leave rather than wait for work."""
    def watch():
        while os.getppid() == parent:
            time.sleep(2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(120)  # the step under way ends and is saved
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def condition_worker(threads, log, *arguments):
    """A worker process's condition: its stages with `threads` CPU threads, every line it
    prints going to log; returns their timings."""
    torch.set_num_threads(threads)
    with open(log, "a") as f:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            os.dup2(f.fileno(), stream.fileno())
        stages = Stages(None)
        stages.run(condition_stages(*arguments))
        sys.stdout.flush()
        sys.stderr.flush()
    return stages.timings


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="toy", help="which study to run")
    p.add_argument("--seeds", type=cli.number(int, 1), default=1,
                   help="repeat the post-training conditions over this many seeds")
    p.add_argument("--out", default=None,
                   help="output root (default: out for paper, out/<preset> otherwise)")
    p.add_argument("--study", choices=["main", *TOY_STUDIES, "pressure"], default="main",
                   help="main: the paper's conditions; frontier (or its old name, pressure): "
                        "forgetting at matched gain (docs/frontier-study.md); size: at a matched "
                        "update norm (docs/size-study.md); toy presets")
    p.add_argument("--pretrain", action="store_true",
                   help="toy presets: pretrain the base here even where the one shipped in "
                        "toy-base/ is the same")
    p.add_argument("--jobs", type=cli.number(int, 1), default=None,
                   help="conditions trained at once, each in a process of its own (default: "
                        "as many as the CPU threads, up to 4; on a GPU, 1)")
    p.add_argument("--conditions", type=lambda s: s.split(","), default=None,
                   help="only these, comma-separated (e.g. mild,stress,rl), with their teachers")
    cli.add_model_args(p, model_help="base model (default: the preset's)")
    args = p.parse_args(argv)
    on_cpu = cli.resolve_device(args.device)[0].type == "cpu"
    args.jobs = args.jobs or (min(4, torch.get_num_threads()) if on_cpu else 1)
    if processes.WORLD > 1:  # every process would run the whole study and write the same files
        raise InputError("reproduce.py runs in one process; under torchrun, run the study's "
                         "scripts one by one (README: More than one GPU)")
    args.study = "frontier" if args.study == "pressure" else args.study  # its name before
    if args.study in TOY_STUDIES and args.preset not in TOY_STUDIES[args.study].SPECS:
        raise InputError(f"--study {args.study} is a toy study: pass --preset "
                         f"{' or '.join(TOY_STUDIES[args.study].SPECS)}")
    out = args.out or ("out" if args.preset == "paper" else f"out/{args.preset}")
    out = os.path.join(out, args.study) if args.study in TOY_STUDIES and not args.out else out
    # held: a second reproduce.py in the same folder would train the same runs at once
    with runs.locked(out):
        study(args, PRESETS[args.preset], out)


def base_model(args, preset, out):
    """(model, data folder) of the study: the toy's world and its pretrained base (built, or
    reused), the preset's model, or a tiny random one (smoke)."""
    if preset["model"] == "toy":
        t0 = time.time()
        toy_args = cli.parsed(organism.add_toy_args, preset["toy"])
        shipped = None if args.pretrain else organism.SHIPPED
        data_dir, model = organism.pretrain(out, toy_args, shipped)
        print(f"toy world and base model ready ({time.time() - t0:.0f}s)")
        return args.model or model, data_dir
    data_dir = data.resolve_data_dir(args.data_dir)
    built = args.model or preset["model"]
    return built or build_smoke_model(os.path.join(out, "base-model"), data_dir), data_dir


def study(args, preset, out):
    """The stages of the preset in out, in order, each skipped where its outputs are there:
    the base's evaluation, each condition's training and evaluation, drift; then the table."""
    t0 = time.time()
    print(vars(args))
    if args.preset == "paper" and cli.resolve_device(args.device)[0].type == "cpu":
        print("note: the paper preset is meant for a GPU, and would take days on a CPU; --preset "
              "toy is the study at CPU scale")
    conditions = {}
    for seed in range(args.seeds):
        conditions.update(runs_of(out, seed) if args.study == "main" else
                          TOY_STUDIES[args.study].runs_of(out, seed, args.preset))
    conditions = chosen(conditions, args.conditions, out) if args.conditions else conditions
    model, data_dir = base_model(args, preset, out)
    device = [f for k in ("device", "dtype") if getattr(args, k)
              for f in (f"--{k}", getattr(args, k))]
    common = ["--model", model, "--data-dir", data_dir, *device]
    base_eval = [*preset["eval"], *preset.get("eval_base", [])]  # the base's: also its band's
    stages = Stages(out)
    stages.run([("evaluate base", evaluated([out], model, base_eval),
                 lambda: evaluate.main(["base", "--out", out, *common, *base_eval]))])
    if args.preset == "toy":
        organism.check_calibration(read_json(os.path.join(out, "eval.json")))
    run_conditions(stages, args.jobs, conditions, args.preset, out, model, common)
    if args.study == "size":  # beside its rule: WiSE-FT's interpolations, evaluations only
        stages.run([interpolation_stage(out, conditions, args.preset, model, common)])
    drift_settings = {**vars(cli.parsed(drift.add_drift_args, preset["drift"])), "model": model}

    def unmeasured():  # every run, and each snapshot of one: a point of its own
        folders = [f for name in conditions for f in (
            *frontier.snapshots(os.path.join(out, name)), os.path.join(out, name))]
        return [f for f in folders
                if not provenance.current(f, "drift.json", ["drift"], drift_settings)]
    rollout = [x for k in ("prompts", *drift.ROLLOUT)  # each given: none from a cache's settings
               for x in (f"--{k.replace('_', '-')}", str(drift_settings[k]))]
    stages.run([("drift", lambda: not unmeasured(), lambda: drift.main(
        [*unmeasured(), "--out", out, *common, *preset["drift"], *rollout]))])

    table = report.write_results(out, preset=args.preset, model=model, timings=stages.timings)
    print(table if args.study == "main" else TOY_STUDIES[args.study].write_report(out))
    took = ", ".join(f"{k} {v:.0f}" for k, v in stages.timings.items())
    print(f"time of each stage (s): {took}; together {sum(stages.timings.values()) / 60:.1f} min; "
          f"this run took {(time.time() - t0) / 60:.1f} min")
    if stages.ran == 0:
        print("every stage was already done; delete a run folder (or its eval.json / drift.json) "
              "to redo it")
    print(f"results in {os.path.join(out, 'results.md')} and results.json")


def condition_stages(preset_name, out, name, script, extra, model, common):
    """A condition's stages: train its run (resuming a stopped one), evaluate each of its
    snapshots (a point of its own), evaluate the run. A finished run stands only where it is
    the preset's run now."""
    preset, folder = PRESETS[preset_name], os.path.join(out, name)
    # the preset's flags for the script, then the condition's, then the run's own: the last win
    flags = [*preset["train"].get(script, []), *preset["train"].get(runs.condition(name), [])]
    argv = [*flags, *extra, "--out", folder, *common]

    def trained():  # a finished run stands for the preset's run only where it is one
        finished = runs.run_finished(folder)
        if finished:
            provenance.check_trained_as(folder, model, vars(PARSERS[script](argv)),
                                        NOT_SETTINGS, f"the {preset_name} preset's now")
        return finished

    def train():
        SCRIPTS[script]([*argv, *(["--resume"] if runs.last_checkpoint(folder) else [])])

    def unevaluated_snapshots():
        return [f for f in frontier.snapshots(folder)
                if not evaluated([f], model, preset["eval"])()]

    def evaluate_them(*folders):
        evaluate.main([*folders, "--out", out, *common, *preset["eval"]])

    stages = [(f"train {name}", trained, train)]
    if "--snapshot-every" in argv:
        stages.append((f"evaluate {name} snapshots", lambda: not unevaluated_snapshots(),
                       lambda: evaluate_them(*unevaluated_snapshots())))
    return stages + [(f"evaluate {name}", evaluated([folder], model, preset["eval"]),
                      lambda: evaluate_them(folder))]


def interpolation_stage(out, conditions, preset_name, model, common):
    """The size study's stage beside its rule: each arm's run at its highest cap scaled down
    (study/size.py's interpolations, written after the runs), each evaluated where not yet."""
    flags, scaled = PRESETS[preset_name]["eval"], size.interpolations(out, conditions,
                                                                      preset_name)

    def unevaluated():
        return [f for f in scaled if not evaluated([f], model, flags)()]
    return ("evaluate interpolations", lambda: not unevaluated(),
            lambda: evaluate.main([*unevaluated(), "--out", out, *common, *flags]))


def evaluated(folders, model, flags):
    """done() of an evaluation: whether each folder's eval.json holds every column the
    preset's flags ask for, measured with them on the adapter there now."""
    settings = {**vars(cli.parsed(evaluate.add_eval_args, flags)), "model": model}
    columns = evaluate.columns(settings)
    return lambda: all(provenance.current(f, "eval.json", columns, settings) for f in folders)


if __name__ == "__main__":
    cli.run_script(main)
