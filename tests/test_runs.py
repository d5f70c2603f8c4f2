import argparse
import errno
import os
import re
import sys

import pytest
import torch

import data
import lora
import model as M
import runs
from conftest import hold_in_another_process


def run_args(**changes):
    return argparse.Namespace(**{**dict(save_every=2, snapshot_every=0, seed=0, model="m", rank=4, alpha=8,
                                        resume=False), **changes})


def test_number_flags_name_the_bound_and_the_reason(capsys):
    p = argparse.ArgumentParser(prog="script.py")
    p.add_argument("--n", type=runs.number(int, 2, why="a pair needs two"))
    p.add_argument("--lr", type=runs.number(float, 0, above=True))
    p.add_argument("--p", type=runs.number(float, 0, below=1))
    assert vars(p.parse_args(["--n", "2", "--lr", "1e-4", "--p", "0"])) == {"n": 2, "lr": 1e-4, "p": 0.0}
    for argv, message in ((["--n", "1"], "argument --n: must be at least 2, got 1: a pair needs two"),
                          (["--n", "2.5"], "argument --n: '2.5' is not a whole number"),
                          (["--lr", "0"], "argument --lr: must be above 0, got 0"),
                          (["--lr", "nan"], "argument --lr: must be above 0, got nan"),
                          (["--p", "1"], "argument --p: must be at least 0 and below 1, got 1")):
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_run_script_ends_input_errors_in_one_line_and_keeps_tracebacks_for_bugs(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["script.py", "--flag"])
    seen = []
    runs.run_script(seen.append)
    assert seen == [["--flag"]]

    def broken_file(argv):
        raise M.InputError("x.json: not JSON; fix it")
    with pytest.raises(SystemExit, match=r"^error: x.json: not JSON; fix it$"):
        runs.run_script(broken_file)
    with pytest.raises(SystemExit, match=r"^error: data folder .*nowhere does not exist"):  # data.DataError is one too
        runs.run_script(lambda argv: data.resolve_data_dir("/nowhere"))

    def bug(argv):
        raise ValueError("a bug")
    with pytest.raises(ValueError, match="a bug"):
        runs.run_script(bug)

    def too_big(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nIf reserved but unallocated ...")
    with pytest.raises(SystemExit) as e:
        runs.run_script(too_big, "rerun with a smaller --batch-size")
    assert e.value.code == ("error: the GPU ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.); "
                            "rerun with a smaller --batch-size")

    def too_big_for_the_cpu(argv):  # a real allocation the CPU's allocator refuses (a pebibyte)
        torch.empty(2 ** 50, dtype=torch.uint8)
    with pytest.raises(SystemExit) as e:
        runs.run_script(too_big_for_the_cpu, "rerun with a smaller --batch-size")
    assert re.fullmatch(r"error: the CPU ran out of memory \(can't allocate memory: you tried to allocate "
                        r"1125899906842624 bytes\..*\); rerun with a smaller --batch-size", e.value.code), e.value.code

    def disk_full(argv):  # what an evaluation's or drift's write meets on a full disk
        raise OSError(errno.ENOSPC, "No space left on device", "out/stress/eval.json.tmp42")
    with pytest.raises(SystemExit) as e:
        runs.run_script(disk_full)
    assert e.value.code == ("error: could not write out/stress/eval.json.tmp42 (No space left on device); make room, "
                            "then run it again")

    def not_ours(argv):  # --out in a folder the user cannot write to
        raise PermissionError(errno.EACCES, "Permission denied", "/shared/out/stress")
    with pytest.raises(SystemExit) as e:
        runs.run_script(not_ours)
    assert e.value.code == ("error: /shared/out/stress: Permission denied; check its permissions, or pass a folder you "
                            "can write to")

    def broken_disk(argv):
        raise OSError(errno.EIO, "Input/output error", "out/stress/eval.json")
    with pytest.raises(OSError, match="Input/output error"):  # neither: its traceback stays
        runs.run_script(broken_disk)

    def other_runtime_error(argv):
        raise RuntimeError("shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # a bug: its traceback stays
        runs.run_script(other_runtime_error)


def test_a_device_that_is_not_there_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(M.InputError, match="--device cuda, but torch finds no CUDA device"):
        runs.resolve_device("cuda")
    with pytest.raises(M.InputError, match="--device 'gpu' is not a device"):
        runs.resolve_device("gpu")
    with pytest.raises(M.InputError, match="--dtype 'fp8' is not a dtype this code runs in"):
        runs.resolve_device("cpu", "fp8")
    assert runs.resolve_device(None) == (torch.device("cpu"), torch.float32)
    # $STATES_DEVICE stands in for a missing --device, and is named when it is wrong
    monkeypatch.setenv("STATES_DEVICE", "cuda")
    with pytest.raises(M.InputError, match=r"\$STATES_DEVICE cuda, but torch finds no CUDA device.*unset \$STATES_DEVICE"):
        runs.resolve_device(None)
    assert runs.resolve_device("cpu") == (torch.device("cpu"), torch.float32)  # --device wins
    monkeypatch.setenv("STATES_DEVICE", "gpu")
    with pytest.raises(M.InputError, match=r"\$STATES_DEVICE 'gpu' is not a device"):
        runs.resolve_device(None)


def test_learning_rate_warms_up_linearly_then_decays_by_a_cosine_to_zero():
    peak, total = 1e-3, 100
    lr = [runs.lr_at(step, total, peak, 0.1) for step in range(total + 1)]  # 10 warmup steps
    assert lr[0] == pytest.approx(peak / 10)  # the first step already learns
    assert lr[4] == pytest.approx(peak / 2) and lr[9] == pytest.approx(peak)
    assert lr[10] == pytest.approx(peak)  # the decay starts from the peak
    assert lr[55] == pytest.approx(peak / 2)  # halfway through the 90 decay steps
    assert lr[100] == pytest.approx(0, abs=1e-18)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))
    assert runs.lr_at(0, total, peak, 0.0) == peak  # no warmup: the first step at the peak
    assert runs.lr_at(1, 2, peak, 0.0) == pytest.approx(peak / 2)


@pytest.mark.parametrize("grad_clip,expected", [(1.0, [-0.6, -0.8]), (10.0, [-3.0, -4.0]), (0.0, [-3.0, -4.0])])
def test_optimizer_step_clips_the_gradient_norm_before_the_step(grad_clip, expected):
    # plain SGD with lr 1, so the update is the gradient as clipped (AdamW would hide the scale)
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([3.0, 4.0])
    args = argparse.Namespace(lr=1.0, warmup=0.0, grad_clip=grad_clip)
    lr, grad_norm = runs.optimizer_step(optimizer, 0, 10, args)
    assert lr == 1.0 and grad_norm == pytest.approx(5.0)  # the norm before clipping, as logged
    assert torch.allclose(p.detach(), torch.tensor(expected)) and p.grad is None


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
        run = runs.RunFolder(folder, args)
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
        step = runs.RunFolder(folder, run_args(model=tiny_model, resume=True)).resume(fresh, fresh_optimizer)
        assert step in (2, 4), (kill_after, step)
        loaded = lora.adapter_state(fresh, "default")
        assert all(torch.equal(loaded[k], saved[step][k]) for k in loaded), kill_after
        assert fresh_optimizer.state_dict()["state"][0]["step"] == step // 2
        if os.waitstatus_to_exitcode(status) == 0:  # the write finished before the chosen operation
            assert step == 4 and kill_after > 5  # it did kill the earlier writes
            break
    else:
        pytest.fail("the checkpoint write never finished")


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
        with pytest.raises(M.InputError, match=rf"^{folder} is in use by another process \(pid {holder.pid}\); wait"):
            runs.RunFolder(folder, args)
        assert not os.path.exists(os.path.join(folder, "run.json"))  # and touched nothing
    finally:
        holder.kill()
        holder.wait()
    run = runs.RunFolder(folder, args)  # SIGKILL ended the hold with the process
    runs.RunFolder(folder, args)  # this process holds it already: the same run going on
    run.finish(0)
    another_process_can_take_it()
    with pytest.raises(M.InputError, match="has no checkpoint to resume from"):
        runs.RunFolder(folder, run_args(resume=True))
    another_process_can_take_it()
    run = runs.RunFolder(folder, args)
    with pytest.raises(RuntimeError), run.stop_between_steps():
        raise RuntimeError("out of memory")
    another_process_can_take_it()
    # reproduce.py's and toy.py's hold on their --out: for the block, however it ends
    with pytest.raises(RuntimeError), runs.holding(folder):
        with pytest.raises(AssertionError):
            another_process_can_take_it()
        raise RuntimeError("a stage failed")
    another_process_can_take_it()
    runs.hold(folder)
    with runs.holding(folder):  # held before the block: still held after it
        pass
    with pytest.raises(AssertionError):
        another_process_can_take_it()
    runs.let_go(folder)
    import errno
    import fcntl

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)  # a mount without locks: one note, and the run goes on
    os.makedirs(tmp_path / "lockless")  # a folder there already: RunFolder holds it before and after its checks
    run = runs.RunFolder(str(tmp_path / "lockless"), args)
    assert capsys.readouterr().out.count("note: cannot lock") == 1
    run.finish(0)
    monkeypatch.setattr(runs, "fcntl", None)  # as on Windows: no lock, but the folder is made all the same
    runs.hold(str(tmp_path / "unlocked"))
    assert os.listdir(tmp_path / "unlocked") == []


def test_micro_batches_put_like_lengths_together_under_the_token_bound():
    lengths = [5, 9, 3, 3, 12, 4, 4, 4]
    # without a bound, --grad-accum alone: that many passes of the sequences, longest first
    assert runs.micro_batches(lengths, 1, 0) == [[4, 1, 0, 5, 6, 7, 2, 3]]
    assert runs.micro_batches(lengths, 3, 0) == [[4, 1], [0, 5, 6], [7, 2, 3]]
    # a pass holds its rows times its longest row: 12 | 9 5 | 4 4 4 3 | 3 under 18 tokens
    assert runs.micro_batches(lengths, 1, 18) == [[4], [1, 0], [5, 6, 7, 2], [3]]
    for bound in range(1, 60):
        passes = runs.micro_batches(lengths, 2, bound)
        assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
        assert len(passes) >= 2
        # a sequence longer than the bound runs alone rather than not at all
        assert all(len(p) * lengths[p[0]] <= bound or len(p) == 1 for p in passes)
        assert all(lengths[p[0]] == max(lengths[i] for i in p) for p in passes)
    assert runs.micro_batches([], 2, 10) == [] and runs.micro_batches([7], 4, 0) == [[0]]


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_run_folder(tmp_path):
    import subprocess
    folder = str(tmp_path / "stress")
    run = runs.RunFolder(folder, run_args())
    with pytest.raises(RuntimeError), run.stop_between_steps():
        raise RuntimeError("out of memory in step 1")
    assert not os.path.exists(folder)
    # a process that ends in an error after making the folder (a model that fails to load)
    code = ("import sys, argparse; sys.path.insert(0, sys.argv[1]); import runs; "
            "runs.RunFolder(sys.argv[2], argparse.Namespace(save_every=2, snapshot_every=0, model='m', rank=4, alpha=8, "
            "resume=False)); raise SystemExit('error: no model')")
    done = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.dirname(__file__)), folder],
                          capture_output=True, text=True)
    assert done.returncode == 1 and not os.path.exists(folder)
    # one killed before it wrote a checkpoint leaves its folder: other scripts say what it is
    os.makedirs(folder)
    open(os.path.join(folder, ".lock"), "w").close()
    with pytest.raises(M.InputError, match=rf"^{folder} holds a run that never trained to its first checkpoint"):
        runs.check_run_folder(folder, "m")
    with pytest.raises(M.InputError, match="is not a run folder"):
        runs.check_run_folder(str(tmp_path), "m")


def test_model_and_data_come_from_the_run_json_of_the_folders_given(tmp_path, capsys):
    teacher = tmp_path / "stress"
    teacher.mkdir()
    M.write_json(str(teacher / "run.json"), dict(model="out/toy/base-model", data_dir="out/toy/data"))
    args = runs.model_and_data_from(argparse.Namespace(model=None, data_dir=None), None, str(teacher))
    assert (args.model, args.data_dir) == ("out/toy/base-model", "out/toy/data")
    assert f"--model out/toy/base-model (from {teacher}/run.json)" in capsys.readouterr().out
    args = runs.model_and_data_from(argparse.Namespace(model="mine", data_dir=None), str(teacher))
    assert (args.model, args.data_dir) == ("mine", "out/toy/data")  # a flag given wins
    args = runs.model_and_data_from(argparse.Namespace(model=None, data_dir=None), str(tmp_path / "nothing"))
    assert (args.model, args.data_dir) == (M.DEFAULT_MODEL, None)
    assert "(default)" in capsys.readouterr().out
