"""torchrun with 2 processes on the CPU (gloo): the same update, the same scores, the same
resume as one process. Each case launches torchrun once (a few seconds)."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import drift
import evaluate
from conftest import MAINS, ROOT, adapter_tensors, common, read_log
from plumbing import processes, runs
from plumbing.files import InputError


def torchrun(*argv, **env):
    """A script under torchrun, 2 processes of one thread each; env: e.g. STOP_AT_STEP=1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in env.items()}}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *argv], env=env, capture_output=True, text=True, timeout=300)


def launch(script, *argv, **env):
    """tests/torchrun_main.py, which runs script's main, under torchrun."""
    return torchrun(os.path.join(ROOT, "tests", "torchrun_main.py"), script, *map(str, argv), **env)


def assert_same_adapter(a, b):
    """Equal but for float rounding, which Adam's first steps blow up to a sizeable part of
    the learning rate in the rare entry whose gradient is near zero (g / (|g| + eps))."""
    a, b = adapter_tensors(a), adapter_tensors(b)
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert (diff > 1e-6).float().mean() < 1e-3 and diff.max() < 1e-4
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)  # it did train


# RL and OPD take one step: a second one samples from weights that the two runs hold equal
# only to float rounding, and Adam's first step blows that up in the rare entry whose
# gradient is near zero, enough to move a sampled token across a boundary now and then.
# That the processes stay in step is checked at every step, to the bit (torchrun_main.py).
FLAGS = {"sft": ["--train-limit", 16, "--batch-size", 4, "--lora-dropout", 0, "--max-steps", 2],
         "rl": ["--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 6, "--steps", 1, "--lr", 1e-3],
         "opd": ["--teacher", "TEACHER", "--prompts-per-step", 2, "--max-new-tokens", 6, "--steps", 1,
                 "--continuation-tokens", 4, "--lr", 1e-3]}


# seed 3 draws data, student | student, data: each process's half draws otherwise by its own index
FLAGS["opd-mixture"] = FLAGS["opd"] + ["--state-source", "student=0.5,data=0.5", "--prompts-per-step", 4, "--seed", 3]


@pytest.mark.parametrize("script", ["sft", "rl", "opd", "opd-mixture"])
def test_two_processes_make_the_update_one_makes(tiny_model, data_dir, tmp_path, script):
    flags = [tiny_model if f == "TEACHER" else f for f in FLAGS[script]]
    script = script.split("-")[0]
    MAINS[script](common(tiny_model, data_dir, tmp_path / "one", *flags))
    r = launch(script, *common(tiny_model, data_dir, tmp_path / "two", *flags))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_adapter(tmp_path / "one", tmp_path / "two")
    one, two = read_log(tmp_path / "one"), read_log(tmp_path / "two")  # written once, by one process
    assert [x["step"] for x in two] == list(range(1, len(one) + 1)) and len(one) == (2 if script == "sft" else 1)
    assert [x["tokens"] for x in one] == [x["tokens"] for x in two]
    for key in ("reward", "completion_len", "share_student"):  # the same rollouts, sampled half by each process
        assert [x.get(key) for x in one] == [x.get(key) for x in two]
    for key in ("loss", "state_nll", "grad_norm"):
        assert all(abs(x[key] - y[key]) < 1e-5 * max(1, abs(x[key])) for x, y in zip(one, two))
    if "--state-source" in flags:  # both sources in the step, each process with its share of them
        assert 0 < one[0]["share_student"] < 1


def test_a_sigterm_to_torchrun_stops_both_after_one_step_and_resume_continues_the_run(tiny_model, data_dir, tmp_path):
    flags = FLAGS["sft"][:-1] + ["4"]  # four steps
    MAINS["sft"](common(tiny_model, data_dir, tmp_path / "one", *flags))
    r = launch("sft", *common(tiny_model, data_dir, tmp_path / "two", *flags), STOP_AT_STEP=1)
    assert r.returncode != 0 and "stopped by SIGTERM after step 2 of 4" in r.stderr
    assert torch.load(tmp_path / "two" / "checkpoint" / "trainer.pt", weights_only=True)["step"] == 2
    assert [x["step"] for x in read_log(tmp_path / "two")] == [1, 2] and not runs.run_finished(tmp_path / "two")
    r = launch("sft", *common(tiny_model, data_dir, tmp_path / "two", *flags, "--resume"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_adapter(tmp_path / "one", tmp_path / "two")
    assert [x["step"] for x in read_log(tmp_path / "two")] == [1, 2, 3, 4] and runs.run_finished(tmp_path / "two")


def test_the_process_group_is_taken_down_before_the_interpreter_exits():
    """Left to the interpreter's teardown, gloo's threads now and then abort a finished run
    (SIGABRT, "terminate called without an active exception"), which torchrun reports as a
    failure: join_processes has the group destroyed at exit, before a handler registered
    earlier runs."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import atexit, sys, torch, torch.distributed as dist; sys.path.insert(0, sys.argv[1]); from plumbing import processes; "
            "atexit.register(lambda: print('joined' if dist.is_initialized() else 'left', flush=True)); "
            "processes.WORLD = 2; processes.join_processes(torch.device('cpu')); dist.all_reduce(torch.ones(1))")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    r = subprocess.run([sys.executable, "-c", code, ROOT], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-1:] == ["left"], r.stdout + r.stderr[-2000:]


def test_a_finished_run_exits_zero_on_every_process_under_load(tiny_model, data_dir, tmp_path):
    """A finished process leaves before the interpreter's teardown, where gloo's threads now
    and then abort it (SIGABRT after a run that trained all its steps, which torchrun reports
    as a failure): here every process aborts if it gets there, and both cores are busy."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        r = launch("sft", *common(tiny_model, data_dir, tmp_path / "run", *FLAGS["sft"]), ABORT_IN_TEARDOWN=1)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert r.returncode == 0, r.stderr[-3000:]
    assert runs.run_finished(tmp_path / "run") and [x["step"] for x in read_log(tmp_path / "run")] == [1, 2]


def test_a_process_that_fails_ends_the_other_with_its_error(tiny_model, data_dir, tmp_path):
    start = time.time()
    r = launch("sft", *common(tiny_model, data_dir, tmp_path / "run", *FLAGS["sft"]), FAIL_AT_STEP=1)
    assert r.returncode != 0 and "RuntimeError: process 1 failed at step 2" in r.stderr
    assert time.time() - start < 120  # not a hang: the other process does not wait on it for ever
    assert not os.path.exists(tmp_path / "run" / "run.json")  # and nothing that passes for a trained run


def test_evaluation_and_drift_with_two_processes_write_what_one_writes(tiny_model, data_dir, tmp_path):
    MAINS["rl"](common(tiny_model, data_dir, tmp_path / "study" / "rl", *FLAGS["rl"]))
    flags = ["--model", tiny_model, "--data-dir", data_dir, "--max-new-tokens", 8, "--gsm8k-limit", 6,
             "--gsm8k-fewshot", 0, "--mmlu-limit", 5, "--mmlu-shots", 0, "--truthfulqa-limit", 5, "--batch-size", 2]
    drift_flags = ["--model", tiny_model, "--data-dir", data_dir, "--prompts", 5, "--max-new-tokens", 8,
                   "--permutations", 20]
    run = str(tmp_path / "study" / "rl")
    evaluate.main(["base", run, *map(str, flags)])
    drift.main([run, *map(str, drift_flags)])
    one = {name: json.load(open(os.path.join(run, name))) for name in ("eval.json", "drift.json")}
    for name in ("eval.json", "drift.json", "eval_samples.jsonl"):
        os.remove(os.path.join(run, name))
    r = torchrun(os.path.join(ROOT, "evaluate.py"), "base", run, *map(str, flags))
    assert r.returncode == 0, r.stderr[-3000:]
    r = torchrun(os.path.join(ROOT, "drift.py"), run, *map(str, drift_flags))
    assert r.returncode == 0, r.stderr[-3000:]
    two = {name: json.load(open(os.path.join(run, name))) for name in ("eval.json", "drift.json")}
    for name in one:  # equal to float rounding (one thread a process here, two in this one)
        a, b = flat(one[name]), flat(two[name])
        assert a.keys() == b.keys() and "settings/model" in a
        for key, value in a.items():
            assert value == (pytest.approx(b[key], rel=1e-6, abs=1e-12) if isinstance(value, float) else b[key]), key


def flat(d, prefix=""):
    """A nested dict as {"a/b": value}."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_a_batch_that_does_not_split_over_the_processes_is_one_line(tiny_model, data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "WORLD", 2)
    with pytest.raises(InputError, match="--prompts-per-step 3 does not split evenly over 2 processes; pass a "
                                              "multiple of 2, or run fewer processes"):
        processes.split(3, "--prompts-per-step")
    assert processes.split(5) == (0, 2)  # evaluation's batches need not split evenly
    monkeypatch.setattr(processes, "RANK", 1)
    assert processes.split(5) == (2, 5) and processes.split(4, "--batch-size") == (2, 4)
    monkeypatch.undo()
    r = launch("rl", *common(tiny_model, data_dir, tmp_path / "rl", *FLAGS["rl"][:1], 1, *FLAGS["rl"][2:]))
    assert r.returncode != 0
    assert "error: --prompts-per-step 1 does not split evenly over 2 processes; pass a multiple of 2" in r.stderr
    assert not os.path.exists(tmp_path / "rl")  # nothing that looks like a run is left
    monkeypatch.setattr(processes, "WORLD", 2)
    import reproduce
    with pytest.raises(InputError, match="reproduce.py runs in one process; under torchrun, run the study's"):
        reproduce.main(["--out", str(tmp_path / "study")])
