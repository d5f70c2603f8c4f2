import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, hold_in_another_process
from plumbing.files import InputError

RUNS = ["base", "mild", "stress", "opd-mild", "opd-stress", "kd-stress", "opd-logits", "opd-sampled", "rl",
        "degraded", "opd-degraded", "kd-degraded"]


def test_smoke_study_runs_end_to_end_and_resumes(data_dir, tmp_path):
    out = tmp_path / "study"
    cmd = [sys.executable, os.path.join(ROOT, "reproduce.py"), "--preset", "smoke", "--data-dir", data_dir, "--out", str(out)]
    first = subprocess.run([*cmd, "--jobs", "3"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    # three conditions at once, each in a process of its own with a third of the threads (one, of two cores), each
    # after its teacher: the bits of one at a time on as many threads (another thread count rounds sums otherwise,
    # on some CPUs even this tiny model's), shown on a teacher, its OPD student and RL
    alone = tmp_path / "alone"
    one = subprocess.run([*cmd[:-1], str(alone), "--jobs", "1", "--conditions", "opd-stress,rl"], capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": str(max(1, torch.get_num_threads() // 3))})
    assert one.returncode == 0, one.stderr[-3000:]
    assert sorted(p.name for p in alone.iterdir() if (p / "run.json").is_file()) == ["opd-stress", "rl", "stress"]
    for run in ("stress", "opd-stress", "rl"):
        assert (out / run / "adapter_model.safetensors").read_bytes() == (alone / run / "adapter_model.safetensors").read_bytes()
        for name in ("eval.json", "drift.json"):
            ours, theirs = (json.loads((folder / run / name).read_text()) for folder in (out, alone))
            assert json.dumps(ours).replace(str(out), "") == json.dumps(theirs).replace(str(alone), ""), (run, name)
    assert (out / "logs" / "opd-stress.log").is_file() and not (alone / "logs").exists()
    table = (out / "results.md").read_text()
    for run in RUNS:
        assert f"| {run} |" in table, run
    results = json.loads((out / "results.json").read_text())
    assert [r["run"] for r in results["rows"]] == RUNS
    norms = {r["run"]: r["update_norm"] for r in results["rows"]}
    assert norms.pop("base") is None and norms["stress"] > norms["mild"] > 0 and min(norms.values()) >= 0
    for predictor in ("update_norm", "mmd2", "state_distance", "kl_to_base"):  # every run has all four
        assert results["predictors"][predictor]["conditions"]["n"] == len(RUNS) - 1, predictor
    assert (out / "results.png").stat().st_size > 1000 and (out / "curves.png").stat().st_size > 1000  # the figures
    timings = json.loads((out / "timings.json").read_text())
    assert {"evaluate base", "train stress", "evaluate rl", "drift"} <= set(timings)
    for run in RUNS[1:]:
        assert json.loads((out / run / "drift.json").read_text())["n_states_run"] > 0
        assert "retention" in json.loads((out / run / "eval.json").read_text())
    # kd-stress is opd-stress with the teacher's states: the two runs' settings differ in that alone
    kd, opd = (json.loads((out / run / "run.json").read_text()) for run in ("kd-stress", "opd-stress"))
    assert {k for k in kd if kd[k] != opd.get(k)} - {"out"} == {"state_source"}
    assert kd["state_source"] == "teacher" and kd["teacher"] == opd["teacher"] == str(out / "stress")
    stamp = (out / "stress" / "adapter_model.safetensors").stat().st_mtime_ns

    second = subprocess.run(cmd, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "[running]" not in second.stdout and "every stage was already done" in second.stdout
    assert (out / "stress" / "adapter_model.safetensors").stat().st_mtime_ns == stamp

    os.remove(out / "rl" / "drift.json")
    # an adapter that changed after it was evaluated (a run trained further by hand): scored and measured again
    from safetensors.torch import load_file, save_file
    weights = out / "opd-logits" / "adapter_model.safetensors"
    save_file({k: v * 2 for k, v in load_file(weights).items()}, weights)
    # a run evaluated, and one measured, by hand with other flags than the preset's: done again as the preset does
    by_hand = json.loads((out / "rl" / "eval.json").read_text())
    by_hand["gsm8k"]["fingerprint"]["gsm8k_limit"] = 2
    (out / "rl" / "eval.json").write_text(json.dumps(by_hand))
    by_hand = json.loads((out / "mild" / "drift.json").read_text())
    (out / "mild" / "drift.json").write_text(json.dumps({**by_hand, "fingerprint": {**by_hand["fingerprint"], "stride": 99}}))
    third = subprocess.run(cmd, capture_output=True, text=True)
    assert third.returncode == 0, third.stderr[-3000:]
    assert sorted(l for l in third.stdout.splitlines() if l.startswith("[running]")) == [
        "[running] drift", "[running] evaluate opd-logits", "[running] evaluate rl"]
    assert json.loads((out / "rl" / "eval.json").read_text())["gsm8k"]["fingerprint"]["gsm8k_limit"] == 4
    assert json.loads((out / "mild" / "drift.json").read_text())["fingerprint"]["stride"] == 8
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert json.loads((out / "opd-logits" / "eval.json").read_text())["gsm8k"]["fingerprint"]["adapter_sha256"] == digest
    assert json.loads((out / "opd-logits" / "drift.json").read_text())["fingerprint"]["adapter_sha256"] == digest
    assert "delete a run folder" not in third.stdout

    # a finished run whose settings are not the preset's (here: trained before a change of --lr)
    settings = json.loads((out / "rl" / "run.json").read_text())
    (out / "rl" / "run.json").write_text(json.dumps({**settings, "lr": 0.5}))
    fourth = subprocess.run(cmd, capture_output=True, text=True)
    lines = fourth.stderr.strip().splitlines()
    assert fourth.returncode == 1 and len(lines) == 1, fourth.stderr[-3000:]
    assert f"rl was trained with other settings than the smoke preset's now (--lr 0.5 -> {settings['lr']}); delete" in lines[0]

    # a teacher trained again after its students were distilled from it: they are not kept as they are
    (out / "rl" / "run.json").write_text(json.dumps(settings))
    weights = out / "stress" / "adapter_model.safetensors"
    save_file({k: v * 2 for k, v in load_file(weights).items()}, weights)
    fifth = subprocess.run(cmd, capture_output=True, text=True)
    error = fifth.stderr.strip().splitlines()[-1]  # after the progress bars of the teacher's evaluation, made again
    assert fifth.returncode == 1 and error.startswith("error: "), fifth.stderr[-3000:]
    assert f"{out / 'opd-stress'} was distilled from an earlier adapter of its teacher than the one there now" in error

    # a condition that fails in its worker process: where its output went, then the one line of the error
    import shutil
    (alone / "rl" / "run.json").unlink()  # an adapter left without its run's record, nor a checkpoint
    for checkpoint in ("checkpoint", "checkpoint.old"):
        shutil.rmtree(alone / "rl" / checkpoint, ignore_errors=True)
    sixth = subprocess.run([*cmd[:-1], str(alone), "--jobs", "2"], capture_output=True, text=True)
    assert sixth.returncode == 1 and f"[failed] rl: {alone / 'logs' / 'rl.log'}" in sixth.stdout, sixth.stderr[-3000:]
    assert sixth.stderr.strip().splitlines() == [
        f"error: {alone / 'rl'} already holds a trained adapter (and no checkpoint to continue it from); pass --out "
        f"for a new folder, or delete {alone / 'rl'} to train it again"]


def test_a_second_study_in_a_folder_in_use_stops_before_it_runs_a_stage(data_dir, tmp_path):
    out = tmp_path / "study"
    holder = hold_in_another_process(str(out))  # as a first reproduce.py, still running
    try:
        cmd = [sys.executable, os.path.join(ROOT, "reproduce.py"), "--preset", "smoke", "--data-dir", data_dir,
               "--out", str(out)]
        second = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode == 1 and second.stderr.strip().splitlines() == [
        f"error: {out} is in use by another process (pid {holder.pid}); wait for it to end, or pass another --out"]
    assert os.listdir(out) == [".lock"]

def test_each_seed_trains_its_own_conditions_from_its_own_teachers():
    import reproduce
    first, third = reproduce.runs_of("out"), reproduce.runs_of("out", seed=2)
    assert list(first) == RUNS[1:] and list(third) == [f"{run}-seed2" for run in RUNS[1:]]
    for seed, runs in ((0, first), (2, third)):
        tag = f"-seed{seed}" if seed else ""
        for name, (script, argv) in runs.items():
            args = reproduce.PARSERS[script](argv)  # flags the script knows
            assert args.seed == seed
            if script == "opd":  # the teacher trained with the same seed, never another seed's
                teacher = next((t for t in ("mild", "degraded") if t in name), "stress")
                assert args.teacher == os.path.join("out", teacher + tag)
        states = {name: reproduce.PARSERS["opd"](runs[name][1]).state_source for name in (f"opd-stress{tag}", f"kd-stress{tag}")}
        assert states == {f"opd-stress{tag}": "student", f"kd-stress{tag}": "teacher"}
        assert reproduce.PARSERS["opd"](runs[f"opd-logits{tag}"][1]).signal == "logits"


def test_conditions_picks_those_named_on_every_seed_with_the_runs_they_learn_from():
    import reproduce
    both = {**reproduce.runs_of("out"), **reproduce.runs_of("out", seed=1)}
    assert list(reproduce.chosen(both, ["opd-mild", "rl"], "out")) == [
        "mild", "opd-mild", "rl", "mild-seed1", "opd-mild-seed1", "rl-seed1"]
    assert list(reproduce.chosen(both, ["kd-degraded"], "out")) == [
        "degraded", "kd-degraded", "degraded-seed1", "kd-degraded-seed1"]
    from study import frontier, size
    arms = frontier.runs_of("out")  # an OPD arm learns from the rl arm at its first rate
    assert list(reproduce.chosen(arms, ["opd-student-lr0.003"], "out")) == ["rl-lr0.0003", "opd-student-lr0.003"]
    capped = size.runs_of("out")  # and in the size study from the same teacher, uncapped
    assert list(reproduce.chosen(capped, ["opd-data-cap1.625"], "out")) == ["rl-lr0.0003", "opd-data-cap1.625"]
    with pytest.raises(InputError, match=r"--conditions: no condition opd, sft-seed1 in this study; pick "
                                              r"from degraded,kd-degraded,kd-stress,mild,"):
        reproduce.chosen(both, ["sft-seed1", "mild", "opd"], "out")


def test_a_study_of_some_conditions_trains_those_and_their_teachers_alone(data_dir, tmp_path, monkeypatch):
    import reproduce
    monkeypatch.setitem(reproduce.PRESETS["smoke"], "eval", ["--tasks", "gsm8k", "--gsm8k-limit", "2", "--gsm8k-fewshot",
                                                            "0", "--max-new-tokens", "4"])
    study = ["--preset", "smoke", "--data-dir", data_dir, "--jobs", "1", "--out", str(tmp_path)]
    with pytest.raises(InputError, match="no condition sft in this study"):  # before any stage
        reproduce.main([*study, "--conditions", "sft"])
    assert os.listdir(tmp_path) == [".lock"]
    reproduce.main([*study, "--conditions", "opd-mild"])
    trained = sorted(p.name for p in tmp_path.iterdir() if (p / "adapter_model.safetensors").is_file())
    assert trained == ["mild", "opd-mild"]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["run"] for r in rows] == ["base", "mild", "opd-mild"]
    assert all((tmp_path / run / "drift.json").is_file() for run in trained)


def test_a_study_killed_between_a_saves_two_renames_resumes_to_the_same_adapter(data_dir, tmp_path, monkeypatch,
                                                                                capsys):
    """A save renames checkpoint/ to checkpoint.old/, then checkpoint.tmp/ to checkpoint/: a run killed
    between the two has checkpoint.old/ alone, and running the study again resumes from it."""
    import reproduce
    import torch
    from safetensors.torch import load_file
    sft = reproduce.PRESETS["smoke"]["train"]["sft"]
    monkeypatch.setitem(reproduce.PRESETS["smoke"]["train"], "sft", [*sft, "--save-every", "1"])
    monkeypatch.setattr(reproduce, "runs_of", lambda out, seed=0: {"mild": ("sft", ["--preset", "mild"])})
    monkeypatch.setitem(reproduce.PRESETS["smoke"], "eval", ["--tasks", "gsm8k", "--gsm8k-limit", "2", "--gsm8k-fewshot",
                                                            "0", "--max-new-tokens", "4"])  # what is tested is training
    monkeypatch.setitem(reproduce.PRESETS["smoke"], "drift", ["--prompts", "2", "--max-new-tokens", "8", "--stride", "4",
                                                             "--permutations", "5"])
    study = ["--preset", "smoke", "--data-dir", data_dir, "--jobs", "1", "--out"]  # one process: patched
    reproduce.main([*study, str(tmp_path / "whole")])
    replace = os.replace

    def killed_between_renames(src, dst):  # the second rename of the save that has a checkpoint to move aside
        if src.endswith("checkpoint.tmp") and os.path.isdir(dst + ".old"):
            raise KeyboardInterrupt
        return replace(src, dst)

    cut = tmp_path / "cut"
    with monkeypatch.context() as m:
        m.setattr(os, "replace", killed_between_renames)
        with pytest.raises(KeyboardInterrupt):
            reproduce.main([*study, str(cut)])
    assert sorted(p.name for p in (cut / "mild").iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint.old", "checkpoint.tmp"]
    capsys.readouterr()
    reproduce.main([*study, str(cut)])
    assert f"resuming {cut / 'mild'} at step 1" in capsys.readouterr().out
    whole, again = (load_file(str(f / "mild" / "adapter_model.safetensors")) for f in (tmp_path / "whole", cut))
    assert whole.keys() == again.keys() and all(torch.equal(whole[k], again[k]) for k in whole)


def test_a_worker_whose_study_is_gone_stops_as_a_stopped_run_stops():
    """reproduce.orphan_guard: a worker whose study's process is still there works on; one whose study's
    process is gone gets the SIGTERM that stops a run after its step with a checkpoint."""
    import signal
    kept = subprocess.run([sys.executable, "-c", "import os, time, reproduce; reproduce.orphan_guard(os.getppid()); "
                           "time.sleep(3)"], cwd=ROOT, timeout=60)
    assert kept.returncode == 0
    gone = subprocess.run([sys.executable, "-c", "import time, reproduce; reproduce.orphan_guard(-1); time.sleep(30)"],
                          cwd=ROOT, timeout=60)
    assert gone.returncode == -signal.SIGTERM
