import argparse
import json
import operator
import os
import re
import subprocess
import sys

import pytest

import cli
import data
import model as M
import toy
import train
from conftest import ROOT, hold_in_another_process


def world_files(folder):
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), folder)] = fh.read()
    return out


def test_world_is_deterministic_parses_and_is_right(tmp_path):
    corpus_a, problems_a = toy.write_world(str(tmp_path / "a"), seed=3, n_pretrain=300, n_train=300, n_test=100,
                                           facts_per_subject=90, n_misconceptions=40)
    corpus_b, problems_b = toy.write_world(str(tmp_path / "b"), seed=3, n_pretrain=300, n_train=300, n_test=100,
                                           facts_per_subject=90, n_misconceptions=40)
    assert world_files(tmp_path / "a") == world_files(tmp_path / "b") and corpus_a == corpus_b and problems_a == problems_b
    toy.write_world(str(tmp_path / "c"), seed=4, n_pretrain=300, n_train=300, n_test=100, facts_per_subject=90,
                    n_misconceptions=40)
    assert world_files(tmp_path / "a") != world_files(tmp_path / "c")

    root = str(tmp_path / "a")
    train, test = data.load_gsm8k("train", root), data.load_gsm8k("test", root)
    assert len(train) == 300 and len(test) == 100
    pretrain_questions = {p.split("\nAnswer:")[0][len("Question: "):] for p in problems_a}
    train_q, test_q = {r["question"] for r in train}, {r["question"] for r in test}
    assert not train_q & test_q and not pretrain_questions & (train_q | test_q)
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
    for row in train + test:  # every step of every rationale is right, and the final answer is the last result
        steps = re.findall(r"(\d+)([-+*/])(\d+) = <<\1\2\3=(\d+)>>\4\b", row["answer"])  # annotated, as GSM8K's
        assert len(steps) == len(row["answer"].splitlines()) - 1 >= 2
        for a, op, b, c in steps:
            assert ops[op](int(a), int(b)) == int(c), row["answer"]
        assert steps[-1][3] == row["gold"]
    for problem in problems_a:  # the base pretrains on the same kind of rationale written another way: plain sums
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", problem)
        assert "<<" not in problem and len(steps) == len(problem.splitlines()) - 2 >= 2
    _, some = toy.write_world(str(tmp_path / "d"), seed=3, n_pretrain=300, n_train=300, n_test=100, facts_per_subject=90,
                              n_misconceptions=40, annotated=0.1)  # a real base has seen a little of the dataset's way
    assert [p for p in some if "<<" not in p] == problems_a[30:] and world_files(tmp_path / "d") == world_files(tmp_path / "a")
    assert [toy.gsm8k_style(p) for p in problems_a[:30]] == some[:30]
    dev, tst = data.load_mmlu("dev", root), data.load_mmlu("test", root)
    assert sorted(dev) == sorted(tst) == ["toy_biology", "toy_geography", "toy_history"]
    dev_q = {r["question"] for rows in dev.values() for r in rows}
    test_q = {r["question"] for rows in tst.values() for r in rows}
    assert not dev_q & test_q
    corpus_text = "\n".join(corpus_a)
    for rows in tst.values():  # test facts are stated in prose but never shown as a question
        for r in rows:
            assert r["choices"][r["answer"]] in corpus_text and r["question"] not in corpus_text
    tqa = data.load_truthfulqa(root)
    assert len(tqa) == 40
    myth = [k for k, v in tqa[0]["mc1_targets"].items() if v == 0][0]
    subject, color = myth.rstrip(".").split(" are ")
    assert corpus_text.count(f"{subject} are {color}.") == 3  # the misconception is popular


def test_toy_mini_study_runs_end_to_end(tmp_path):
    out = tmp_path / "toy"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "reproduce.py"), "--preset", "toy-mini", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    table = (out / "results.md").read_text()
    for run in ["base", "mild", "stress", "opd-mild", "opd-stress", "opd-logits", "opd-sampled", "rl"]:
        assert f"| {run} |" in table
    assert json.loads((out / "eval.json").read_text())["mmlu"]["scoring"] == "text"
    assert os.path.isfile(out / "base-model" / "model.safetensors") and os.path.isdir(out / "data" / "gsm8k")


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo"), reason="reads the CPU's flags from Linux's /proc/cpuinfo")
def test_pretraining_autocasts_to_bf16_by_default_only_where_the_cpu_has_bf16_products():
    with open("/proc/cpuinfo") as f:
        flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    assert cli.autocast_bf16(None) == bool(flags & {"avx512_bf16", "amx_bf16"})
    assert cli.autocast_bf16(1) is True and cli.autocast_bf16(0) is False  # --bf16 given wins


def test_interrupted_pretraining_resumes_to_the_same_weights(tmp_path, monkeypatch, capsys):
    import argparse
    import pytest
    import torch
    from safetensors.torch import load_file
    p = argparse.ArgumentParser()
    toy.add_toy_args(p)
    args = p.parse_args(["--pretrain-steps", "25", "--hidden", "32", "--layers", "1", "--vocab", "300", "--batch", "4",
                         "--context", "64", "--target-problems", "50", "--bf16", "0"])
    monkeypatch.setattr(toy, "PRETRAIN_SAVE_EVERY", 10)
    toy.pretrain(str(tmp_path / "whole"), args)
    lr_at = train.lr_at

    def crash_at_step_15(step, *rest):
        if step == 15:
            raise KeyboardInterrupt
        return lr_at(step, *rest)

    monkeypatch.setattr(train, "lr_at", crash_at_step_15)
    with pytest.raises(KeyboardInterrupt):
        toy.pretrain(str(tmp_path / "cut"), args)
    checkpoint = tmp_path / "cut" / "base-model" / "pretrain-checkpoint.pt"
    assert torch.load(checkpoint, weights_only=True)["step"] == 10
    monkeypatch.setattr(train, "lr_at", lr_at)
    capsys.readouterr()
    toy.pretrain(str(tmp_path / "cut"), args)
    assert "resuming pretraining at step 10" in capsys.readouterr().out and not checkpoint.exists()
    whole = load_file(str(tmp_path / "whole" / "base-model" / "model.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "base-model" / "model.safetensors"))
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)
    # a checkpoint from other settings is not resumed: pretraining starts again
    monkeypatch.setattr(train, "lr_at", crash_at_step_15)
    with pytest.raises(KeyboardInterrupt):
        toy.pretrain(str(tmp_path / "other"), args)
    monkeypatch.setattr(train, "lr_at", lr_at)
    args.pretrain_lr *= 2
    toy.pretrain(str(tmp_path / "other"), args)
    assert "is from other settings; pretraining starts again" in capsys.readouterr().out

    # a finished base is used again only by the settings it was pretrained with: another world
    # (here another share of annotated problems) or a base without pretrain.json is refused
    assert toy.pretrain(str(tmp_path / "other"), args)[1] == str(tmp_path / "other" / "base-model")
    refused = "other/base-model was pretrained with other settings than these (or by code that kept none in pretrain.json)"
    args.annotated = 0.5
    with pytest.raises(M.InputError, match=re.escape(refused)):
        toy.pretrain(str(tmp_path / "other"), args)
    args.annotated = 0.02
    (tmp_path / "other" / "base-model" / "pretrain.json").unlink()
    with pytest.raises(M.InputError, match=re.escape(refused)):
        toy.pretrain(str(tmp_path / "other"), args)


def test_a_pretraining_folder_in_use_by_another_process_is_refused(tmp_path):
    # two pretrainings into one folder would overwrite each other's checkpoints
    p = argparse.ArgumentParser()
    toy.add_toy_args(p)
    holder = hold_in_another_process(str(tmp_path / "busy"))
    try:
        with pytest.raises(M.InputError, match=rf"busy is in use by another process \(pid {holder.pid}\)"):
            toy.pretrain(str(tmp_path / "busy"), p.parse_args([]))
    finally:
        holder.kill()
        holder.wait()
    assert os.listdir(tmp_path / "busy") == [".lock"]

def test_a_vocabulary_smaller_than_the_bytes_is_refused_before_anything_runs(capsys):
    # below 257 the tokenizer still holds every byte and end-of-text, and ids past the
    # model's vocabulary stopped pretraining with an IndexError from the embedding
    p = argparse.ArgumentParser()
    toy.add_toy_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--vocab", "256"])
    error = capsys.readouterr().err
    assert "argument --vocab: must be at least 257, got 256: byte-level BPE starts from the 256 bytes" in error
    assert p.parse_args(["--vocab", "257"]).vocab == 257
