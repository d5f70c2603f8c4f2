"""A run's life (plumbing/runs.py, plumbing/cli.py): flags and one-line errors, run folders, resume, the stop between
steps, snapshots, locks."""
import argparse
import errno
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import data
import lora
import model as M
import opd
import sft
import train
from plumbing import cli, runs
from plumbing.files import InputError
from conftest import (DEVICES, MAINS, ROOT, adapter_tensors, common, hold_in_another_process, read_log, save_hf_model,
                      short_run)


def run_args(**changes):
    return {**dict(save_every=2, snapshot_every=0, seed=0, model="m", rank=4, alpha=8, resume=False),
            **changes}


def test_number_flags_name_the_bound_and_the_reason(capsys):
    p = argparse.ArgumentParser(prog="script.py")
    p.add_argument("--n", type=cli.number(int, 2, why="a pair needs two"))
    p.add_argument("--lr", type=cli.number(float, 0, above=True))
    p.add_argument("--p", type=cli.number(float, 0, below=1))
    p.add_argument("--share", type=cli.number(float, 0, most=1))
    assert vars(p.parse_args(["--n", "2", "--lr", "1e-4", "--p", "0", "--share", "1"])) == {
        "n": 2, "lr": 1e-4, "p": 0.0, "share": 1.0}
    for argv, message in ((["--n", "1"], "argument --n: must be at least 2, got 1: a pair needs two"),
                          (["--n", "2.5"], "argument --n: '2.5' is not a whole number"),
                          (["--lr", "0"], "argument --lr: must be above 0, got 0"),
                          (["--lr", "nan"], "argument --lr: must be above 0, got nan"),
                          (["--p", "1"], "argument --p: must be at least 0 and below 1, got 1"),
                          (["--share", "1.5"], "argument --share: must be at least 0 and at most 1, got 1.5")):
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_run_script_ends_input_errors_in_one_line_and_keeps_tracebacks_for_bugs(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["script.py", "--flag"])
    seen = []
    cli.run_script(seen.append)
    assert seen == [["--flag"]]

    def broken_file(argv):
        raise InputError("x.json: not JSON; fix it")
    with pytest.raises(SystemExit, match=r"^error: x.json: not JSON; fix it$"):
        cli.run_script(broken_file)
    with pytest.raises(SystemExit, match=r"^error: data folder .*nowhere does not exist"):  # data.DataError is one too
        cli.run_script(lambda argv: data.resolve_data_dir("/nowhere"))

    def bug(argv):
        raise ValueError("a bug")
    with pytest.raises(ValueError, match="a bug"):
        cli.run_script(bug)

    def too_big(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nIf reserved but unallocated ...")
    with pytest.raises(SystemExit) as e:
        cli.run_script(too_big, "rerun with a smaller --batch-size")
    assert e.value.code == ("error: the GPU ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.); "
                            "rerun with a smaller --batch-size")

    def too_big_for_the_cpu(argv):  # a real allocation the CPU's allocator refuses (a pebibyte)
        torch.empty(2 ** 50, dtype=torch.uint8)
    with pytest.raises(SystemExit) as e:
        cli.run_script(too_big_for_the_cpu, "rerun with a smaller --batch-size")
    assert re.fullmatch(r"error: the CPU ran out of memory \(can't allocate memory: you tried to allocate "
                        r"1125899906842624 bytes\..*\); rerun with a smaller --batch-size", e.value.code), e.value.code

    def disk_full(argv):  # what an evaluation's or drift's write meets on a full disk
        raise OSError(errno.ENOSPC, "No space left on device", "out/stress/eval.json.tmp42")
    with pytest.raises(SystemExit) as e:
        cli.run_script(disk_full)
    assert e.value.code == ("error: could not write out/stress/eval.json.tmp42 (No space left on device); make room, "
                            "then run it again")

    def not_ours(argv):  # --out in a folder the user cannot write to
        raise PermissionError(errno.EACCES, "Permission denied", "/shared/out/stress")
    with pytest.raises(SystemExit) as e:
        cli.run_script(not_ours)
    assert e.value.code == ("error: /shared/out/stress: Permission denied; check its permissions, or pass a folder you "
                            "can write to")

    def broken_disk(argv):
        raise OSError(errno.EIO, "Input/output error", "out/stress/eval.json")
    with pytest.raises(OSError, match="Input/output error"):  # neither: its traceback stays
        cli.run_script(broken_disk)

    def other_runtime_error(argv):
        raise RuntimeError("shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # a bug: its traceback stays
        cli.run_script(other_runtime_error)


def test_a_device_that_is_not_there_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match="--device cuda, but torch finds no CUDA device"):
        cli.resolve_device("cuda")
    with pytest.raises(InputError, match="--device 'gpu' is not a device"):
        cli.resolve_device("gpu")
    with pytest.raises(InputError, match="--dtype 'fp8' is not a dtype this code runs in"):
        cli.resolve_device("cpu", "fp8")
    assert cli.resolve_device(None) == (torch.device("cpu"), torch.float32)
    # $STATES_DEVICE stands in for a missing --device, and is named when it is wrong
    monkeypatch.setenv("STATES_DEVICE", "cuda")
    with pytest.raises(InputError, match=r"\$STATES_DEVICE cuda, but torch finds no CUDA device.*unset \$STATES_DEVICE"):
        cli.resolve_device(None)
    assert cli.resolve_device("cpu") == (torch.device("cpu"), torch.float32)  # --device wins
    monkeypatch.setenv("STATES_DEVICE", "gpu")
    with pytest.raises(InputError, match=r"\$STATES_DEVICE 'gpu' is not a device"):
        cli.resolve_device(None)


@pytest.mark.parametrize("script,argv,message", [
    ("rl", ["--group-size", "1"], "argument --group-size: must be at least 2, got 1: the advantage compares"),
    ("rl", ["--temperature", "0"], "argument --temperature: must be above 0, got 0"),
    ("opd", ["--teacher", "out/stress", "--cuts", "0"], "argument --cuts: must be at least 1, got 0"),
    ("sft", ["--lr", "-0.001"], "argument --lr: must be above 0, got -0.001"),
    ("sft", ["--lora-dropout", "1"], "argument --lora-dropout: must be at least 0 and below 1, got 1"),
])
def test_bad_flags_are_named_before_anything_runs(script, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        MAINS[script](argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_model_or_data_folder_is_one_line_from_a_script(tiny_model, data_dir, tmp_path):
    for script, model, data_folder, message in (
            ("sft.py", str(tmp_path / "no-model"), data_dir, "no-model' is neither a local folder nor a hub id"),
            ("rl.py", tiny_model, tmp_path / "no-data", "no-data does not exist; pass --data-dir")):
        r = subprocess.run([sys.executable, os.path.join(ROOT, script), *common(model, data_folder, tmp_path / script)],
                           capture_output=True, text=True)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    # a folder named by $STATES_DATA is that variable's to fix
    r = subprocess.run([sys.executable, os.path.join(ROOT, "sft.py"), "--model", tiny_model, "--out", str(tmp_path / "env")],
                       capture_output=True, text=True, env={**os.environ, "STATES_DATA": str(tmp_path / "gone")})
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"error: data folder {tmp_path / 'gone'} does not exist; point $STATES_DATA at the dataset files, or unset it "
        f"to fetch them into ~/.cache/states"], r.stderr


LOG_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens", "seconds", "state_nll", "state_nll_base"}


@pytest.mark.parametrize("script,extra", [
    ("sft.py", ["--train-limit", 16, "--batch-size", 4, "--max-steps", 2]),
    ("rl.py", ["--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 8, "--max-steps", 2, "--kl-coef", 0.1]),
    ("opd.py", ["--teacher", "BASE", "--prompts-per-step", 2, "--max-new-tokens", 8, "--max-steps", 2]),
    ("opd.py", ["--teacher", "BASE", "--signal", "logits", "--prompts-per-step", 2, "--max-new-tokens", 8,
                "--max-steps", 2]),
])
@pytest.mark.parametrize("device", DEVICES)  # on CUDA: bf16 weights, the captured decode step
def test_scripts_run_from_the_command_line(tiny_model, data_dir, tmp_path, script, extra, device):
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM
    out = tmp_path / "run"
    extra = [tiny_model if e == "BASE" else e for e in extra]
    subprocess.run([sys.executable, os.path.join(ROOT, script), *common(tiny_model, data_dir, out, *extra),
                    "--device", device], check=True, capture_output=True, text=True)
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2] and all(LOG_FIELDS <= set(r) for r in log)
    run = json.loads((out / "run.json").read_text())
    assert run["model"] == tiny_model and "git_commit" in run
    ours, tok = M.load(tiny_model)
    lora.load_adapter(ours, str(out))
    ref = PeftModel.from_pretrained(Qwen3ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), str(out)).eval()
    ids = torch.tensor([tok.encode("Question: 1 + 1?\nAnswer:")])
    with torch.no_grad():
        assert (ours(ids) - ref(input_ids=ids).logits).abs().max() < 1e-5


@pytest.mark.parametrize("script", ["sft", "rl", "opd"])
def test_resume_matches_an_uninterrupted_run(tiny_model, data_dir, tmp_path, script, capsys):
    main, extra = MAINS[script], short_run(script, tiny_model)
    main(common(tiny_model, data_dir, tmp_path / "full", *extra, "--max-steps", 4, "--save-every", 2))
    main(common(tiny_model, data_dir, tmp_path / "cut", *extra, "--max-steps", 2, "--save-every", 2))
    with pytest.raises(InputError, match="already holds a trained run"):
        main(common(tiny_model, data_dir, tmp_path / "cut", *extra, "--max-steps", 4))
    with pytest.raises(InputError, match="has no checkpoint to resume from; drop --resume to start the run"):
        main(common(tiny_model, data_dir, tmp_path / "never", *extra, "--resume"))
    with pytest.raises(InputError, match=f"--out {tiny_model} is a model folder \\(config.json\\); pass a folder of"):
        main(common(tiny_model, data_dir, tiny_model, *extra, "--max-steps", 1))
    assert not os.path.isfile(os.path.join(tiny_model, "run.json"))
    import shutil
    kept = tmp_path / "kept"  # a finished run whose checkpoint was deleted to save room: its adapter is not trained over
    shutil.copytree(tmp_path / "cut", kept)
    shutil.rmtree(kept / "checkpoint")
    adapter = (kept / "adapter_model.safetensors").read_bytes()
    with pytest.raises(InputError, match="kept already holds a trained adapter \\(and no checkpoint to continue it "
                                           "from\\); pass --out for a new folder, or delete"):
        main(common(tiny_model, data_dir, kept, *extra, "--max-steps", 1))
    assert (kept / "adapter_model.safetensors").read_bytes() == adapter
    stale = tmp_path / "stale"  # what a run that died before its first checkpoint leaves: a log, no checkpoint
    stale.mkdir()
    (stale / "log.jsonl").write_text('{"step": 1, "loss": 99.0}\n')
    main(common(tiny_model, data_dir, stale, *extra, "--max-steps", 1))
    assert [r["loss"] for r in read_log(stale)] == [r["loss"] for r in read_log(tmp_path / "full")[:1]]
    capsys.readouterr()
    with open(tmp_path / "cut" / "log.jsonl", "a") as f:  # a run killed while it wrote step 3's line
        f.write('{"step": 3, "loss": 0.')
    main(common(tiny_model, data_dir, tmp_path / "cut", *extra, "--max-steps", 4, "--save-every", 2, "--resume"))
    assert f"note: resuming {tmp_path / 'cut'} with changed settings: --max-steps 2 -> 4\n" in capsys.readouterr().out
    a, b = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "cut")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)  # it did train
    assert [r["step"] for r in read_log(tmp_path / "cut")] == [1, 2, 3, 4]


def test_a_resume_that_would_not_continue_the_run_stops_and_leaves_its_run_json(tiny_model, tokenizer_path, data_dir,
                                                                                  tmp_path):
    run = tmp_path / "run"
    sft.main(common(tiny_model, data_dir, run, *short_run("sft", tiny_model), "--max-steps", 1))
    recorded = (run / "run.json").read_text()
    resume = lambda model, *extra: sft.main(common(model, data_dir, run, *short_run("sft", tiny_model), "--max-steps", 2,
                                                   "--resume", *extra))
    # the same shapes and tokenizer, other weights: the checkpoint's adapter would load without a word
    other = save_hf_model(str(tmp_path / "other-base"), tokenizer_path, seed=1)
    with pytest.raises(InputError, match=f"run was trained on base {tiny_model}, but --model is {other}; "
                                           f"pass --model {tiny_model}"):
        resume(other)
    # another rank stopped with "trained on another base model"; another alpha rescaled the adapter unseen
    with pytest.raises(InputError, match=r"run's adapter was trained with other LoRA settings \(--rank 16 -> 8\); "
                                           r"resume with its own"):
        resume(tiny_model, "--rank", 8)
    with pytest.raises(InputError, match=r"other LoRA settings \(--alpha 32 -> 64.0\)"):
        resume(tiny_model, "--alpha", 64)
    # a checkpoint that fails to load: the settings of the resume that failed are not recorded as the run's
    from safetensors.torch import load_file, save_file
    weights = run / "checkpoint" / "adapter_model.safetensors"
    save_file(dict(list(load_file(weights).items())[1:]), weights)
    with pytest.raises(InputError, match="some LoRA tensors are missing"):
        resume(tiny_model, "--lr", 0.5)
    assert (run / "run.json").read_text() == recorded and len(read_log(run)) == 1


def test_a_run_killed_anywhere_in_a_checkpoint_write_resumes_from_a_whole_checkpoint(tiny_model, tmp_path):
    """A checkpoint write killed after any of its file operations (os._exit in a forked
    child: no cleanup runs, as under SIGKILL or a power cut) leaves the previous checkpoint
    or the new one, each whole: a resume loads one of them exactly."""
    import os
    import shutil
    import safetensors.torch
    args = run_args(model=tiny_model)

    def fresh_model():
        model, _ = M.load(tiny_model)
        lora.add_lora(model, rank=4, alpha=8)
        return model, torch.optim.AdamW(lora.lora_parameters(model), lr=0.1)

    def train_step(seed):
        torch.manual_seed(seed)
        for p in lora.lora_parameters(model):
            p.grad = torch.randn_like(p)
        optimizer.step()
        return {k: v.clone() for k, v in lora.adapter_state(model, "default").items()}

    saved = {}
    operations = [(os, "replace"), (shutil, "rmtree"), (torch, "save"), (safetensors.torch, "save_file")]
    for kill_after in range(1, 100):
        folder = str(tmp_path / f"kill-{kill_after}")
        model, optimizer = fresh_model()
        run = runs.RunFolder(folder, args, lora)
        saved[2] = train_step(2)
        run.save(model, optimizer, 2)
        saved[4] = train_step(4)
        child = os.fork()
        if child == 0:  # count the file operations of the second write; die after the chosen one
            exit_code = 2  # an error: never return into the test run from the child
            try:
                done = [0]
                for module, name in operations:
                    def counted(*a, _original=getattr(module, name), **k):
                        result = _original(*a, **k)
                        done[0] += 1
                        if done[0] == kill_after:
                            os._exit(3)
                        return result
                    setattr(module, name, counted)
                run.save(model, optimizer, 4)
                exit_code = 0
            finally:
                os._exit(exit_code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) in (0, 3), kill_after
        fresh, fresh_optimizer = fresh_model()
        step = runs.RunFolder(folder, run_args(model=tiny_model, resume=True), lora).resume(fresh, fresh_optimizer)
        assert step in (2, 4), (kill_after, step)
        loaded = lora.adapter_state(fresh, "default")
        assert all(torch.equal(loaded[k], saved[step][k]) for k in loaded), kill_after
        assert fresh_optimizer.state_dict()["state"][0]["step"] == step // 2
        if os.waitstatus_to_exitcode(status) == 0:  # the write finished before the chosen operation
            assert step == 4 and kill_after > 5  # it did kill the earlier writes
            break
    else:
        pytest.fail("the checkpoint write never finished")


@pytest.mark.parametrize("script,signal_name", [("sft", "SIGINT"), ("rl", "SIGTERM"), ("opd", "SIGINT")])
def test_a_stop_signal_ends_the_run_after_its_step_with_a_checkpoint(tiny_model, data_dir, tmp_path, script,
                                                                     signal_name, monkeypatch, capsys):
    import signal
    main, extra = MAINS[script], short_run(script, tiny_model)
    main(common(tiny_model, data_dir, tmp_path / "full", *extra, "--max-steps", 4))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    batch_indices = data.batch_indices

    def signal_during(steps, times=1):
        def batch_indices_then_signal(n, step, *args):
            if step in steps:  # amid the step: as a user's Ctrl-C or a scheduler's SIGTERM comes
                for _ in range(times):
                    os.kill(os.getpid(), getattr(signal, signal_name))
            return batch_indices(n, step, *args)
        monkeypatch.setattr(data, "batch_indices", batch_indices_then_signal)

    signal_during({1})  # the second step; no checkpoint is due before the fourth
    args = common(tiny_model, data_dir, tmp_path / "cut", *extra, "--max-steps", 4, "--save-every", 4)
    with pytest.raises(SystemExit, match=f"stopped by {signal_name} after step 2 of 4, its checkpoint written to"):
        main(args)
    assert torch.load(tmp_path / "cut" / "checkpoint" / "trainer.pt", weights_only=True)["step"] == 2
    assert [r["step"] for r in read_log(tmp_path / "cut")] == [1, 2] and not runs.run_finished(tmp_path / "cut")
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # Python's own handlers are back
    # a second signal stops at once, back at the last checkpoint
    signal_during({2}, times=2)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--resume"])
    assert torch.load(tmp_path / "cut" / "checkpoint" / "trainer.pt", weights_only=True)["step"] == 2
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    # during the last step: the run completes, and the stop is not forgotten (reproduce.py would go on)
    signal_during({3})
    with pytest.raises(SystemExit, match=f"stopped by {signal_name} at the run's last step; .*cut is complete"):
        main([*args, "--resume"])
    a, b = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "cut")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6  # the stop lost nothing
    assert [r["step"] for r in read_log(tmp_path / "cut")] == [1, 2, 3, 4] and runs.run_finished(tmp_path / "cut")
    assert {s: signal.getsignal(s) for s in handlers} == handlers


@pytest.mark.parametrize("script", ["sft", "rl", "opd"])
def test_snapshots_hold_each_steps_adapter_as_a_run_folder(tiny_model, data_dir, tmp_path, script):
    main, extra = MAINS[script], short_run(script, tiny_model)
    main(common(tiny_model, data_dir, tmp_path / "run", *extra, "--max-steps", 3, "--snapshot-every", 1))
    main(common(tiny_model, data_dir, tmp_path / "one-step", *extra, "--max-steps", 1))
    snapshots = tmp_path / "run" / "snapshots"
    assert sorted(os.listdir(snapshots)) == ["step-000001", "step-000002", "step-000003"]
    first, last = adapter_tensors(snapshots / "step-000001"), adapter_tensors(snapshots / "step-000003")
    after_one, final = adapter_tensors(tmp_path / "one-step"), adapter_tensors(tmp_path / "run")
    assert all(torch.equal(first[k], after_one[k]) and torch.equal(last[k], final[k]) for k in final)
    assert any(not torch.equal(first[k], last[k]) for k in final)  # they are different steps' adapters
    # each a finished run folder of its own, with the log up to its step, for evaluate.py and drift.py
    runs.check_run_folder(str(snapshots / "step-000002"), tiny_model)
    assert json.loads((snapshots / "step-000002" / "run.json").read_text())["finished_steps"] == 2
    assert [r["step"] for r in read_log(snapshots / "step-000002")] == [1, 2]
    # a resume forgets snapshots past its checkpoint and half-written ones, as it forgets their log lines
    (snapshots / "step-000007").mkdir()
    (snapshots / "step-000002.tmp").mkdir()
    (snapshots / "results.md").write_text("a table the user made\n")
    main(common(tiny_model, data_dir, tmp_path / "run", *extra, "--max-steps", 3, "--snapshot-every", 1, "--resume"))
    assert sorted(os.listdir(snapshots)) == ["results.md", "step-000001", "step-000002", "step-000003"]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_model, data_dir, tmp_path, monkeypatch, capsys):
    args = common(tiny_model, data_dir, tmp_path / "nan", "--train-limit", 12, "--batch-size", 4, "--save-every", 2,
                  "--epochs", 2)
    calls = {"n": 0}
    real = train.token_nll

    def poisoned(logp):
        calls["n"] += 1
        loss, m = real(logp)
        return (loss * float("nan"), m) if calls["n"] == 3 else (loss, m)

    monkeypatch.setattr(train, "token_nll", poisoned)
    with pytest.raises(SystemExit, match=r"step 3: loss is nan; stopped.*checkpoint.*intact") as e:
        sft.main(args + ["--max-steps", "4"])
    assert "\n" not in str(e.value)
    monkeypatch.setattr(train, "token_nll", real)
    sft.main(common(tiny_model, data_dir, tmp_path / "clean", "--train-limit", 12, "--batch-size", 4, "--epochs", 2,
                    "--max-steps", 2))
    kept = torch.load(tmp_path / "nan" / "checkpoint" / "trainer.pt", weights_only=True)
    assert kept["step"] == 2
    a, b = adapter_tensors(tmp_path / "nan" / "checkpoint"), adapter_tensors(tmp_path / "clean")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    capsys.readouterr()
    for run, unfinished in (("nan", True), ("clean", False)):  # a stopped run's adapter is used with a note
        runs.check_run_folder(str(tmp_path / run), tiny_model)
        assert ("has not finished" in capsys.readouterr().out) == unfinished


def test_a_full_disk_stops_the_run_in_one_line_and_loses_no_checkpoint(tiny_model, data_dir, tmp_path, monkeypatch):
    extra = ["--train-limit", 12, "--batch-size", 4, "--epochs", 2, "--save-every", 1]
    sft.main(common(tiny_model, data_dir, tmp_path / "whole", *extra, "--max-steps", 3))
    save = torch.save

    def disk_fills_at_step_2(state, path, *a, **k):
        if state["step"] == 2:
            raise OSError(28, "No space left on device")
        return save(state, path, *a, **k)

    monkeypatch.setattr(torch, "save", disk_fills_at_step_2)
    args = common(tiny_model, data_dir, tmp_path / "full", *extra, "--max-steps", 3)
    with pytest.raises(InputError, match=r"could not write step 2's adapter to .*full \(No space left on device\); "
                                           r"the last checkpoint written is intact: make room, then continue with --resume"):
        sft.main(args)
    assert torch.load(tmp_path / "full" / "checkpoint" / "trainer.pt", weights_only=True)["step"] == 1
    monkeypatch.setattr(torch, "save", save)
    sft.main([*args, "--resume"])
    a, b = adapter_tensors(tmp_path / "whole"), adapter_tensors(tmp_path / "full")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(InputError, match="no checkpoint was written before it: make room, then start the run again"):
        sft.main(common(tiny_model, data_dir, tmp_path / "at-once", *extra, "--max-steps", 3))


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_run_folder(tmp_path):
    import subprocess
    folder = str(tmp_path / "stress")
    run = runs.RunFolder(folder, run_args(), lora)
    with pytest.raises(RuntimeError), run.stop_between_steps():
        raise RuntimeError("out of memory in step 1")
    assert not os.path.exists(folder)
    # a process that ends in an error after making the folder (a model that fails to load)
    code = ("import sys, argparse; sys.path.insert(0, sys.argv[1]); from plumbing import runs; "
            "import lora; runs.RunFolder(sys.argv[2], dict(save_every=2, snapshot_every=0, model='m', rank=4, alpha=8, "
            "resume=False), lora); raise SystemExit('error: no model')")
    done = subprocess.run([sys.executable, "-c", code, ROOT, folder],
                          capture_output=True, text=True)
    assert done.returncode == 1 and not os.path.exists(folder)
    # one killed before it wrote a checkpoint leaves its folder: other scripts say what it is
    os.makedirs(folder)
    open(os.path.join(folder, ".lock"), "w").close()
    with pytest.raises(InputError, match=rf"^{folder} holds a run that never trained to its first checkpoint"):
        runs.check_run_folder(folder, "m")
    with pytest.raises(InputError, match="is not a run folder"):
        runs.check_run_folder(str(tmp_path), "m")
    # a study's folder, held by reproduce.py and evaluate.py: not a run, and not one to delete
    open(tmp_path / ".lock", "w").close()
    (tmp_path / "eval.json").write_text("{}")
    with pytest.raises(InputError, match=rf"^{tmp_path} is not a run folder \(no adapter_config.json\)"):
        runs.check_run_folder(str(tmp_path), "m")


def test_a_folder_in_use_by_another_process_stops_a_second_run_in_one_line(tmp_path, monkeypatch, capsys):
    """Two runs writing one folder would interleave their logs and overwrite each other's
    checkpoints, so the second stops, naming the first's pid. A killed holder leaves no
    lock behind, and a finished run, a refused start and a training loop ended by an error
    let the folder go, also in a process that lives on (a notebook)."""
    import os
    args = run_args()
    folder = str(tmp_path / "run")

    def another_process_can_take_it():
        holder = hold_in_another_process(folder)  # fails its readline if it cannot
        holder.kill()
        holder.wait()

    holder = hold_in_another_process(folder)
    try:
        with pytest.raises(InputError, match=rf"^{folder} is in use by another process \(pid {holder.pid}\); wait"):
            runs.RunFolder(folder, args, lora)
        assert not os.path.exists(os.path.join(folder, "run.json"))  # and touched nothing
    finally:
        holder.kill()
        holder.wait()
    run = runs.RunFolder(folder, args, lora)  # SIGKILL ended the hold with the process
    runs.RunFolder(folder, args, lora)  # this process holds it already: the same run going on
    run.finish(0)
    another_process_can_take_it()
    with pytest.raises(InputError, match="has no checkpoint to resume from"):
        runs.RunFolder(folder, run_args(resume=True), lora)
    another_process_can_take_it()
    run = runs.RunFolder(folder, args, lora)
    with pytest.raises(RuntimeError), run.stop_between_steps():
        raise RuntimeError("out of memory")
    another_process_can_take_it()
    # reproduce.py's and toy.py's hold on their --out: for the block, however it ends
    with pytest.raises(RuntimeError), runs.locked(folder):
        with pytest.raises(AssertionError):
            another_process_can_take_it()
        raise RuntimeError("a stage failed")
    another_process_can_take_it()
    runs.lock(folder)
    with runs.locked(folder):  # held before the block: still held after it
        pass
    with pytest.raises(AssertionError):
        another_process_can_take_it()
    runs.unlock(folder)
    import errno
    import fcntl

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)  # a mount without locks: one note, and the run goes on
    os.makedirs(tmp_path / "lockless")  # a folder there already: RunFolder holds it before and after its checks
    run = runs.RunFolder(str(tmp_path / "lockless"), args, lora)
    assert capsys.readouterr().out.count("note: cannot lock") == 1
    run.finish(0)
    monkeypatch.setattr(runs, "fcntl", None)  # as on Windows: no lock, but the folder is made all the same
    runs.lock(str(tmp_path / "unlocked"))
    assert os.listdir(tmp_path / "unlocked") == []


def test_a_run_in_use_elsewhere_is_not_read_as_a_teacher_nor_evaluated_nor_measured(tiny_model, data_dir, tmp_path):
    """Its adapter changes under the reader: a student would learn from two teachers, an
    evaluation or a drift would score one adapter of many, half way through the run."""
    import drift
    import evaluate
    teacher = tmp_path / "teacher"
    sft.main(common(tiny_model, data_dir, teacher, "--train-limit", 4, "--batch-size", 4, "--max-steps", 1))
    holder = hold_in_another_process(str(teacher))  # as sft.py --resume would, training it further
    still = rf"^{teacher} is in use by another process \(pid {holder.pid}\), which trains or evaluates it; wait for it to end$"
    try:
        with pytest.raises(InputError, match=still):
            opd.main(common(tiny_model, data_dir, tmp_path / "student", "--teacher", teacher, "--max-steps", 1))
        assert not (tmp_path / "student").exists()
        with pytest.raises(InputError, match=still):
            evaluate.main([str(teacher), "--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path)])
        with pytest.raises(InputError, match=still):
            drift.main([str(teacher), "--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path)])
        assert not (teacher / "eval.json").exists() and not (teacher / "drift.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert runs.locked_elsewhere(str(teacher)) is None
    # an evaluation holds what it writes: the base's --out and each run, for as long as it runs
    holder = hold_in_another_process(str(tmp_path / "out"))
    try:
        with pytest.raises(InputError, match=rf"^{tmp_path / 'out'} is in use by another process \(pid {holder.pid}\); "
                                               rf"wait for it to end$"):
            evaluate.main(["base", "--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path / "out")])
    finally:
        holder.kill()
        holder.wait()
    evaluate.main([str(teacher), "--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path / "out"),
                   "--gsm8k-limit", "2", "--max-new-tokens", "4", "--mmlu-limit", "2", "--truthfulqa-limit", "2"])
    assert (teacher / "eval.json").exists()
    holder = hold_in_another_process(str(teacher))  # let go once written
    holder.kill()
    holder.wait()


def test_model_and_data_come_from_the_run_json_of_the_folders_given(tmp_path, capsys):
    teacher = dict(model="out/toy/base-model", data_dir="out/toy/data", out="out/toy/stress")  # its run.json
    args = cli.model_and_data_from(argparse.Namespace(model=None, data_dir=None), None, teacher)
    assert (args.model, args.data_dir) == ("out/toy/base-model", "out/toy/data")
    assert "--model out/toy/base-model (from the run.json of out/toy/stress)" in capsys.readouterr().out
    args = cli.model_and_data_from(argparse.Namespace(model="mine", data_dir=None), teacher)
    assert (args.model, args.data_dir) == ("mine", "out/toy/data")  # a flag given wins
    args = cli.model_and_data_from(argparse.Namespace(model=None, data_dir=None), {"out": "x"}, None)
    assert (args.model, args.data_dir) == (cli.DEFAULT_MODEL, None)
    assert "(default)" in capsys.readouterr().out


@pytest.mark.parametrize("script", ["sft", "rl", "opd"])
def test_a_capped_run_stays_under_its_update_norm_and_resumes_to_the_same_adapter(tiny_model, data_dir, tmp_path,
                                                                                  script):
    main, extra = MAINS[script], short_run(script, tiny_model)
    main(common(tiny_model, data_dir, tmp_path / "free", *extra, "--max-steps", 1))
    assert all("update_norm" not in r for r in read_log(tmp_path / "free"))  # no cap: the log as before it
    cap = lora.update_norm(str(tmp_path / "free")) / 2  # under the first step's: it binds from there
    capped = [*extra, "--max-update-norm", cap, "--save-every", 2]
    main(common(tiny_model, data_dir, tmp_path / "full", *capped, "--max-steps", 4))
    norms = [r["update_norm"] for r in read_log(tmp_path / "full")]
    assert len(norms) == 4 and max(norms) <= cap and norms[-1] >= cap * (1 - 2e-6)  # it binds, never over
    assert lora.update_norm(str(tmp_path / "full")) <= cap * (1 + 1e-6)  # the saved adapter's, as the table reads it
    main(common(tiny_model, data_dir, tmp_path / "cut", *capped, "--max-steps", 2))
    main(common(tiny_model, data_dir, tmp_path / "cut", *capped, "--max-steps", 4, "--resume"))
    a, b = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "cut")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
