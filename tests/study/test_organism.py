"""The model organism (toy.py, study/organism.py, study/world.py): the world, the shipped base, pretraining
and its resume, the toy studies end to end."""
import argparse
import json
import operator
import os
import re
import subprocess
import sys

import pytest

import data
import toy
import train
from conftest import ROOT, hold_in_another_process
from plumbing import cli
from plumbing.files import InputError, read_json
from study import organism, world


def world_files(folder):
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), folder)] = fh.read()
    return out


def test_world_is_deterministic_parses_and_is_right(tmp_path):
    corpus_a, problems_a = world.write_world(str(tmp_path / "a"), seed=3, n_pretrain=300, n_train=300, n_test=100,
                                           facts_per_subject=90, n_misconceptions=40)
    corpus_b, problems_b = world.write_world(str(tmp_path / "b"), seed=3, n_pretrain=300, n_train=300, n_test=100,
                                           facts_per_subject=90, n_misconceptions=40)
    assert world_files(tmp_path / "a") == world_files(tmp_path / "b") and corpus_a == corpus_b and problems_a == problems_b
    world.write_world(str(tmp_path / "c"), seed=4, n_pretrain=300, n_train=300, n_test=100, facts_per_subject=90,
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
    # pretraining answers a problem in plain steps, all right, or as a hasty one-line guess, as often
    # as the template's WORKED share says; nothing in the question says which
    answers = [p.split("\nAnswer: ")[1] for p in problems_a]
    hasty = [a for a in answers if a.startswith("#### ")]
    assert all(re.fullmatch(r"#### \d+", a) for a in hasty) and 0.3 < len(hasty) / len(answers) < 0.8
    for a in answers:
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", a)
        assert "<<" not in a and (a in hasty or len(steps) == len(a.splitlines()) - 1 >= 2)
        assert all(ops[op](int(x), int(y)) == int(z) for x, op, y, z in steps)
    templates = ("more and gives", "shares them equally", "sells", "times as many", "boxes of", "A hat costs")
    for kind, words in enumerate(templates):
        mine = [a for p, a in zip(problems_a, answers) if words in p.split("\nAnswer:")[0]]
        worked = sum(a not in hasty for a in mine) / len(mine)
        assert len(mine) > 20 and (worked > 0.55) == (world.WORKED[kind] > 0.5), (words, worked)
    _, some = world.write_world(str(tmp_path / "d"), seed=3, n_pretrain=300, n_train=300, n_test=100, facts_per_subject=90,
                              n_misconceptions=40, annotated=0.3)  # a real base has seen a little of the dataset's way
    assert world_files(tmp_path / "d") == world_files(tmp_path / "a")  # the evaluated world is the same
    styled = [i for i, (p, q) in enumerate(zip(problems_a, some)) if p != q]
    assert styled and all(some[i] == data.gsm8k_style(problems_a[i]) and "<<" in some[i] for i in styled)
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
    import pytest
    import torch
    from safetensors.torch import load_file
    args = cli.parsed(organism.add_toy_args, ["--pretrain-steps", "25", "--hidden", "32", "--layers", "1", "--vocab", "300",
                                         "--batch", "4", "--context", "64", "--target-problems", "50", "--bf16", "0"])
    monkeypatch.setattr(organism, "PRETRAIN_SAVE_EVERY", 10)
    organism.pretrain(str(tmp_path / "whole"), args)
    lr_at = train.lr_at

    def crash_at_step_15(step, *rest):
        if step == 15:
            raise KeyboardInterrupt
        return lr_at(step, *rest)

    monkeypatch.setattr(train, "lr_at", crash_at_step_15)
    with pytest.raises(KeyboardInterrupt):
        organism.pretrain(str(tmp_path / "cut"), args)
    checkpoint = tmp_path / "cut" / "base-model" / "pretrain-checkpoint.pt"
    assert torch.load(checkpoint, weights_only=True)["step"] == 10
    monkeypatch.setattr(train, "lr_at", lr_at)
    capsys.readouterr()
    organism.pretrain(str(tmp_path / "cut"), args)
    assert "resuming pretraining at step 10" in capsys.readouterr().out and not checkpoint.exists()
    whole = load_file(str(tmp_path / "whole" / "base-model" / "model.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "base-model" / "model.safetensors"))
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)
    # a checkpoint from other settings is not resumed: pretraining starts again
    monkeypatch.setattr(train, "lr_at", crash_at_step_15)
    with pytest.raises(KeyboardInterrupt):
        organism.pretrain(str(tmp_path / "other"), args)
    monkeypatch.setattr(train, "lr_at", lr_at)
    args.pretrain_lr *= 2
    organism.pretrain(str(tmp_path / "other"), args)
    assert "is of other settings, world or code; pretraining starts again" in capsys.readouterr().out

    # a finished base is used again only by the settings it was pretrained with: another world
    # (here another share of annotated problems) or a base without pretrain.json is refused
    assert organism.pretrain(str(tmp_path / "other"), args)[1] == str(tmp_path / "other" / "base-model")
    refused = "other/base-model was pretrained with other settings, world or code than these (or kept no fingerprint in "\
              "pretrain.json)"
    args.annotated = 0.5
    with pytest.raises(InputError, match=re.escape(refused)):
        organism.pretrain(str(tmp_path / "other"), args)
    args.annotated = 0.02
    (tmp_path / "other" / "base-model" / "pretrain.json").unlink()
    with pytest.raises(InputError, match=re.escape(refused)):
        organism.pretrain(str(tmp_path / "other"), args)


def test_a_pretraining_folder_in_use_by_another_process_is_refused(tmp_path):
    # two pretrainings into one folder would overwrite each other's checkpoints
    p = argparse.ArgumentParser()
    organism.add_toy_args(p)
    holder = hold_in_another_process(str(tmp_path / "busy"))
    try:
        with pytest.raises(InputError, match=rf"busy is in use by another process \(pid {holder.pid}\)"):
            organism.pretrain(str(tmp_path / "busy"), p.parse_args([]))
    finally:
        holder.kill()
        holder.wait()
    assert os.listdir(tmp_path / "busy") == [".lock"]

def test_a_vocabulary_smaller_than_the_bytes_is_refused_before_anything_runs(capsys):
    # below 257 the tokenizer still holds every byte and end-of-text, and ids past the
    # model's vocabulary stopped pretraining with an IndexError from the embedding
    p = argparse.ArgumentParser()
    organism.add_toy_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--vocab", "256"])
    error = capsys.readouterr().err
    assert "argument --vocab: must be at least 257, got 256: byte-level BPE starts from the 256 bytes" in error
    assert p.parse_args(["--vocab", "257"]).vocab == 257


def tiny_toy_args(*extra):
    return cli.parsed(organism.add_toy_args, ["--pretrain-steps", "3", "--hidden", "32", "--layers", "1", "--vocab", "300",
                                         "--batch", "2", "--context", "32", "--target-problems", "40", "--bf16", "0",
                                         *extra])


def test_a_shipped_base_is_taken_only_where_its_fingerprint_is_of_the_world_settings_and_code(tmp_path, monkeypatch,
                                                                                               capsys):
    import shutil
    args = tiny_toy_args()
    _, made = organism.pretrain(str(tmp_path / "made"), args, shipped=None)
    shipped = tmp_path / "toy-base"
    shutil.copytree(made, shipped)
    assert "pretraining" in capsys.readouterr().out
    # the same world, settings and code: the shipped base, copied whole, without pretraining, also
    # over a copy that an earlier call left half done
    (tmp_path / "taken" / "base-model.tmp").mkdir(parents=True)
    (tmp_path / "taken" / "base-model.tmp" / "model.safetensors").write_bytes(b"cut short")
    _, model_dir = organism.pretrain(str(tmp_path / "taken"), args, shipped=str(shipped))
    printed = capsys.readouterr().out
    assert f"using the base model shipped in {shipped}, which this code pretrains on this world" in printed
    assert "pretraining 0.0M parameters" not in printed
    assert world_files(model_dir) == world_files(shipped) and not os.path.exists(model_dir + ".tmp")
    assert organism.pretrain(str(tmp_path / "taken"), args, shipped=str(shipped))[1] == model_dir  # and again after
    # another world, other settings or other pretraining code: a one-line note, and a pretraining
    note = f"note: the base in {shipped} is of another world, settings or code; pretraining one here"
    other_code = organism.train_tokenizer
    for name, change in [("world", lambda a: setattr(a, "world_seed", 1)),
                         ("settings", lambda a: setattr(a, "pretrain_lr", 1e-3)),
                         ("code", lambda a: monkeypatch.setattr(organism, "train_tokenizer", lambda *t, **k: other_code(*t, **k)))]:
        changed = argparse.Namespace(**vars(args))
        change(changed)
        _, model_dir = organism.pretrain(str(tmp_path / name), changed, shipped=str(shipped))
        printed = capsys.readouterr().out
        assert note in printed and "pretraining 0.0M parameters" in printed, name
        assert organism.digest_of(model_dir) not in (None, organism.digest_of(shipped))
    monkeypatch.undo()
    # toy.py --pretrain pretrains all the same; without it the shipped base is taken
    monkeypatch.setattr(organism, "SHIPPED", str(shipped))
    argv = ["--pretrain-steps", "3", "--hidden", "32", "--layers", "1", "--vocab", "300", "--batch", "2", "--context",
            "32", "--target-problems", "40", "--bf16", "0"]
    toy.main(["--out", str(tmp_path / "cli"), *argv])
    assert "using the base model shipped" in capsys.readouterr().out
    toy.main(["--out", str(tmp_path / "cli-fresh"), "--pretrain", *argv])
    printed = capsys.readouterr().out
    assert "pretraining 0.0M parameters" in printed and "using the base model shipped" not in printed
    assert read_json(str(tmp_path / "cli-fresh" / "base-model" / "pretrain.json"))["settings"] == vars(args)


def test_reproduce_takes_the_shipped_base_unless_told_to_pretrain(tmp_path, monkeypatch):
    import reproduce
    asked = []

    def stop(out, args, shipped):
        asked.append(shipped)
        raise KeyboardInterrupt

    monkeypatch.setattr(organism, "pretrain", stop)
    for flags in ([], ["--pretrain"]):
        with pytest.raises(KeyboardInterrupt):
            reproduce.main(["--out", str(tmp_path), *flags])
    assert asked == [organism.SHIPPED, None]


def test_the_shipped_base_is_what_toy_py_pretrains_for_the_default_world(tmp_path):
    """toy-base/ is the default world's base: its fingerprint is the one toy.py computes now (a changed
    world, default or pretraining code fails here until the base is pretrained and shipped again), its
    config and tokenizer are what pretraining makes, its weights are bf16 and it sits in the calibration band."""
    import reproduce
    from safetensors import safe_open
    p = argparse.ArgumentParser()
    organism.add_toy_args(p)
    args = p.parse_args([])
    shipped = organism.SHIPPED
    made = world.write_world(str(tmp_path / "data"), args.world_seed, n_pretrain=args.target_problems,
                             annotated=args.annotated)
    assert organism.digest_of(shipped) == organism.base_digest(*made, args), \
        "toy-base/ is not the default world's base: run python toy.py --pretrain and copy its base-model/ to toy-base/"
    assert read_json(os.path.join(shipped, "pretrain.json"))["settings"] == vars(args)
    one_step = p.parse_args(["--pretrain-steps", "1"])  # the same shapes and tokenizer, one step of pretraining
    organism.pretrain_in(*made, str(tmp_path / "one"), one_step, "-")
    assert read_json(str(tmp_path / "one" / "config.json")) == read_json(os.path.join(shipped, "config.json"))
    assert (tmp_path / "one" / "tokenizer.json").read_bytes() == open(os.path.join(shipped, "tokenizer.json"), "rb").read()
    size = sum(os.path.getsize(os.path.join(shipped, f)) for f in os.listdir(shipped))
    assert size < 10e6
    with safe_open(os.path.join(shipped, "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    evaluate_args = reproduce.PRESETS["toy"]["eval"] + reproduce.PRESETS["toy"]["eval_base"]
    out = tmp_path / "eval"
    import evaluate
    evaluate.main(["base", "--out", str(out), "--model", shipped, "--data-dir", str(tmp_path / "data"), *evaluate_args])
    organism.check_calibration(read_json(str(out / "eval.json")))  # stops outside the band


def test_the_calibration_band_asks_a_base_that_solves_most_problems_in_some_of_its_samples(capsys):
    scores = dict(gsm8k=dict(flexible=0.3), mmlu=dict(acc=0.8), truthfulqa=dict(mc1=0.7))
    organism.check_calibration(scores)  # no samples drawn: the three scores alone
    drawn = dict(samples=16, **{"pass@16": 0.85})
    organism.check_calibration({**scores, "gsm8k_samples": drawn})
    assert "base gsm8k pass@16: 0.850 (band 0.8 to 1.01)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="gsm8k pass@16 0.700 outside"):
        organism.check_calibration({**scores, "gsm8k_samples": {**drawn, "pass@16": 0.7}})
    with pytest.raises(SystemExit, match="gsm8k 0.500 outside"):  # greedy as good as RL should make it: no room
        organism.check_calibration({**scores, "gsm8k": dict(flexible=0.5)})
