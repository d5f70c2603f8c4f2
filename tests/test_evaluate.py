import itertools
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import data
import drift
import evaluate as E
import lora
import model as M
from conftest import DEVICES, ROOT
from plumbing import provenance
from plumbing.files import InputError
from sample import Sampling, generate
from study import report


def brute_force(ref, tok, context, continuation):
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    ids = torch.tensor([whole])
    with torch.no_grad():
        logp = ref(input_ids=ids).logits[0].log_softmax(-1)
    return sum(logp[t - 1, whole[t]].item() for t in range(len(ctx), len(whole)))


@pytest.mark.parametrize("device", DEVICES)  # on CUDA in bf16, as evaluate.py loads the model there
def test_choice_scores_equal_brute_force_transformers(tiny_model, data_dir, device):
    from transformers import Qwen3ForCausalLM
    ours, tok = M.load(tiny_model, device=device)
    ref = Qwen3ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    dev, test = data.load_mmlu("dev", data_dir), data.load_mmlu("test", data_dir)
    mmlu_rows = [test["astronomy"][0], test["anatomy"][3], test["virology"][1]]
    tqa = data.load_truthfulqa(data_dir)[:3]
    contexts = [data.mmlu_prompt(r, dev[r["subject"]][:1]) for r in mmlu_rows] + [data.truthfulqa_prompt(r) for r in tqa]
    choices = ([data.mmlu_continuations(r) for r in mmlu_rows[:2]] + [data.mmlu_continuations(mmlu_rows[2], "text")]
               + [[f" {c}" for c in r["mc2_targets"]] for r in tqa])
    got = E.score_choices(ours, tok, contexts, choices, batch_size=2)
    for ctx, opts, scores in zip(contexts, choices, got):
        expected = [brute_force(ref, tok, ctx, o) for o in opts]
        assert len(scores) == len(opts)
        if ours.lm_head.weight.dtype == torch.float32:
            assert max(abs(a - b) for a, b in zip(scores, expected)) < 1e-4
            assert max(range(len(opts)), key=scores.__getitem__) == max(range(len(opts)), key=expected.__getitem__)
        else:  # bf16 weights are another model's by their rounding: at most 0.0064 a token on the CPU
            tokens = [len(tok.encode(ctx + o)) - len(tok.encode(ctx)) for o in opts]
            assert all(abs(a - b) <= 0.05 * n for a, b, n in zip(scores, expected, tokens))


def test_one_token_choices_are_scored_from_the_last_state_alone(tiny_model, data_dir, monkeypatch):
    from transformers import Qwen3ForCausalLM
    ours, tok = M.load(tiny_model)
    ref = Qwen3ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    dev, test = data.load_mmlu("dev", data_dir), data.load_mmlu("test", data_dir)
    rows = [test["astronomy"][0], test["anatomy"][3], test["astronomy"][1], test["virology"][1]]
    contexts = [data.mmlu_prompt(r, dev[r["subject"]][:1]) for r in rows]
    # one token each under the test tokenizer, as ' A'..' D' are under Qwen3's (here ' B' is two)
    choices = [[" the", " and", " of", " to"]] * len(rows)
    assert all(len(tok.encode(c + o)) == len(tok.encode(c)) + 1 for c, opts in zip(contexts, choices) for o in opts)
    caches, plain_cache = [], ours.new_cache
    monkeypatch.setattr(ours, "new_cache", lambda *args: caches.append(args) or plain_cache(*args))
    got = E.score_choices(ours, tok, contexts, choices, batch_size=3)
    # the subject header every MMLU prompt opens with runs once a batch: a cache of one row,
    # copied to the batch's contexts; the choices need none, the contexts' last states score them
    assert [args[0] for args in caches] == [1, 1]
    for ctx, opts, scores in zip(contexts, choices, got):
        assert max(abs(s - brute_force(ref, tok, ctx, o)) for s, o in zip(scores, opts)) < 1e-4
    caches.clear()
    others = ["Question: how many apples?\nAnswer:", "Tom has 3 pens. How many?"]  # nothing shared
    got = E.score_choices(ours, tok, others, [[" the", " and"]] * 2, batch_size=2)
    assert caches == []
    for ctx, scores in zip(others, got):
        assert max(abs(s - brute_force(ref, tok, ctx, o)) for s, o in zip(scores, [" the", " and"])) < 1e-4
    E.score_choices(ours, tok, others, [[" the", " and so"]] * 2, batch_size=2)
    assert [args[0] for args in caches] == [2]  # longer choices: one cache of the two contexts, copied to 4 rows


def test_mc2_score():
    import math
    lls = [math.log(0.2), math.log(0.1), math.log(0.1)]
    assert abs(E.mc2_score(lls, [1, 0, 0]) - 0.5) < 1e-9
    assert abs(E.mc2_score(lls, [1, 1, 0]) - 0.75) < 1e-9
    far = [x - 2000 for x in lls]  # exp of each underflows to 0; the ratio is the same
    assert abs(E.mc2_score(far, [1, 1, 0]) - 0.75) < 1e-9


def test_retention_math_reproduces_table2():
    base = report.PAPER["base"]
    for run in ("mild", "stress", "opd-mild", "opd-stress", "rl"):
        paper = report.PAPER[run]
        r = E.retention({"truthfulqa": base["truthfulqa"], "mmlu": base["mmlu"]},
                        {"truthfulqa": paper["truthfulqa"], "mmlu": paper["mmlu"]})
        assert abs(r["forgetting"] - paper["forgetting"]) < 5e-4, run
        assert abs(r["retention"] - paper["retention"]) < 5e-4, run


def test_forgettings_standard_error_pairs_each_question_with_the_base_answer():
    def samples(task, right, prompts=None):
        return [dict(task=task, index=i, prompt=(prompts or "q")[i % len(prompts or "q")], correct=bool(r))
                for i, r in enumerate(right)]
    assert abs(E.standard_error([1, 0, 1, 1]) - np.std([1, 0, 1, 1], ddof=1) / 2) < 1e-15  # lm-eval's mean_stderr
    assert E.standard_error([1]) is None
    base_mmlu, post_mmlu = [1, 1, 0, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1, 1, 0]  # one question lost
    base_tqa, post_tqa = [0, 1, 1, 0, 1, 0], [1, 0, 1, 0, 0, 0]
    errors = E.paired_stderr(samples("mmlu", base_mmlu) + samples("truthfulqa", base_tqa),
                             samples("truthfulqa", post_tqa) + samples("mmlu", post_mmlu), "out")
    mmlu_se = np.std(np.subtract(base_mmlu, post_mmlu), ddof=1) / np.sqrt(8)
    tqa_se = np.std(np.subtract(base_tqa, post_tqa), ddof=1) / np.sqrt(6)
    assert abs(errors["mmlu"] - mmlu_se) < 1e-15 and abs(errors["truthfulqa"] - tqa_se) < 1e-15
    # the pairing is the point: the two scores' own errors combined would be over twice as large
    unpaired = np.hypot(np.std(base_mmlu, ddof=1), np.std(post_mmlu, ddof=1)) / np.sqrt(8)
    assert unpaired > 2 * errors["mmlu"]
    got = E.retention({"truthfulqa": 0.5, "mmlu": 0.625}, {"truthfulqa": 1 / 3, "mmlu": 0.5}, errors)
    assert abs(got["forgetting_stderr"] - np.hypot(mmlu_se, tqa_se) / 2) < 1e-15  # the mean of two independent tasks
    assert got["per_task"]["mmlu"]["forgetting_stderr"] == errors["mmlu"]
    assert "forgetting_stderr" not in E.retention({"mmlu": 0.6}, {"mmlu": 0.5})  # no answers to pair: no error
    with pytest.raises(InputError, match="the base's answers in out are to other mmlu questions than this evaluation's"):
        E.paired_stderr(samples("mmlu", base_mmlu, "ab"), samples("mmlu", post_mmlu, "ac"), "out")


def test_a_run_is_not_compared_with_a_base_scored_on_other_questions(tiny_model, data_dir, tmp_path):
    m, _ = M.load(tiny_model)
    lora.add_lora(m, rank=2, alpha=4)
    run = tmp_path / "stress"
    lora.save_adapter(m, str(run))
    (run / "run.json").write_text(json.dumps({"model": tiny_model}))
    base = dict(tasks="mmlu,truthfulqa", gsm8k_fewshot=0, samples=0, model=tiny_model, mmlu_limit=500, mmlu_shots=5,
                mmlu_scoring="letter", seed=1234, truthfulqa_limit=0)

    def base_scored(**changes):  # the base's eval.json, as evaluate.py writes it with these flags
        settings = {**base, **changes}
        (tmp_path / "eval.json").write_text(json.dumps({t: {"acc": 0.5, "fingerprint": provenance.fingerprint(t, settings)}
                                                        for t in ("mmlu", "truthfulqa")}))
    base_scored()
    flags = ["--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path)]
    with pytest.raises(InputError, match="eval.json scored mmlu with --mmlu-limit 500, this evaluation with 8; "
                                           "forgetting compares a run with its base on the same questions"):
        E.main([str(run), "--mmlu-limit", "8", *flags])  # before any model is loaded
    with pytest.raises(InputError, match="with --mmlu-scoring letter, this evaluation with text"):
        E.main([str(run), "--mmlu-scoring", "text", *flags])
    with pytest.raises(InputError, match="with --seed 1234, this evaluation with 7"):  # another subset of 500
        E.main([str(run), "--seed", "7", *flags])
    with pytest.raises(InputError, match="scored truthfulqa with --truthfulqa-limit 0, this evaluation with 5"):
        E.main([str(run), "--mmlu-limit", "500", "--truthfulqa-limit", "5", *flags])
    base_scored(mmlu_limit=0)  # every MMLU question: the seed decides none of them
    provenance.check_measured_alike(str(tmp_path / "eval.json"), ["mmlu", "truthfulqa"], {**base, "mmlu_limit": 0, "seed": 7})
    # a base evaluation of another model in the same --out: forgetting against it would mean nothing
    other = tmp_path / "other-base"
    other.mkdir()
    base_scored(model=str(other))
    with pytest.raises(InputError, match=f"scored truthfulqa with --model {other}, this evaluation with "
                                           f"{os.path.realpath(tiny_model)}"):
        E.main([str(run), "--mmlu-limit", "500", *flags])
    # the same folder spelt another way is the same base: the questions are checked next
    base_scored(model=tiny_model + "/")
    with pytest.raises(InputError, match="with --mmlu-limit 500, this evaluation with 8"):
        E.main([str(run), "--mmlu-limit", "8", *flags])


def test_a_run_is_scored_as_its_studys_base_was_unless_a_flag_says_otherwise(tiny_model, data_dir, tmp_path,
                                                                            capsys):
    # as after the toy study: the base scored with flags that are not evaluate.py's defaults
    flags = ["--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path), "--batch-size", "4"]
    study = {"--gsm8k-limit": "3", "--gsm8k-fewshot": "0", "--max-new-tokens": "8", "--mmlu-limit": "4",
             "--mmlu-shots": "0", "--mmlu-scoring": "text", "--truthfulqa-limit": "3", "--seed": "5"}
    E.main(["base", *flags, *[x for kv in study.items() for x in kv]])
    # one task of the base again: its other columns stay, measured as before, whatever flags this
    # call took for them; what the base was measured with is in its columns' fingerprints
    E.main(["base", *flags, "--tasks", "truthfulqa", "--truthfulqa-limit", "3"])
    m, _ = M.load(tiny_model)
    lora.add_lora(m, rank=2, alpha=4)
    run = tmp_path / "opd-rl"
    lora.save_adapter(m, str(run))
    (run / "run.json").write_text(json.dumps({"model": tiny_model}))
    capsys.readouterr()
    E.main([str(run), *flags])  # no scoring flag: the base's, each printed with where it came from
    said = capsys.readouterr().out
    assert all(f"{flag} {value} (from {tmp_path / 'eval.json'})" in said for flag, value in study.items())
    base, result = (json.loads((f / "eval.json").read_text()) for f in (tmp_path, run))
    assert sorted(result) == sorted([*base, "retention"])  # no 5-shot GSM8K column the base lacks
    for column in ("gsm8k", "mmlu", "truthfulqa"):
        assert {**result[column]["fingerprint"], "adapter_sha256": None} == base[column]["fingerprint"]
    assert result["retention"]["forgetting"] == 0.0  # an adapter of zeros: the base, question for question
    with pytest.raises(InputError, match="with --mmlu-shots 0, this evaluation with 1"):
        E.main([str(run), *flags, "--mmlu-shots", "1"])  # a flag given still wins


def test_a_run_is_measured_only_on_its_own_base(tiny_models, data_dir, tmp_path, capsys):
    """Two bases of the same shapes: the adapter would load on either without a word."""
    m, _ = M.load(tiny_models["tied"])
    lora.add_lora(m, rank=2, alpha=4)
    run = tmp_path / "stress"
    lora.save_adapter(m, str(run))
    (run / "run.json").write_text(json.dumps({"model": tiny_models["untied"]}))
    for main in (E.main, drift.main):
        with pytest.raises(InputError, match="stress was trained on base .*untied, but --model is .*tied; pass --model"):
            main([str(run), "--model", tiny_models["tied"], "--data-dir", str(data_dir), "--out", str(tmp_path)])

    def trained_on(model):
        (run / "run.json").write_text(json.dumps({"model": model}))
        return str(run)
    provenance.check_same_base(trained_on(tiny_models["tied"] + "/."), tiny_models["tied"])  # one folder, two spellings
    provenance.check_same_base(trained_on("Qwen/Qwen3-0.6B-Base"), "Qwen/Qwen3-0.6B-Base")
    with pytest.raises(InputError, match="trained on base Qwen/Qwen3-0.6B-Base, but --model is Qwen/Qwen3-1.7B-Base"):
        provenance.check_same_base(trained_on("Qwen/Qwen3-0.6B-Base"), "Qwen/Qwen3-1.7B-Base")
    capsys.readouterr()
    provenance.check_same_base(trained_on(str(tmp_path / "moved" / "base-model")), tiny_models["tied"])  # a study moved since
    assert "cannot be compared with --model" in capsys.readouterr().out


@pytest.mark.parametrize("device", DEVICES)
def test_evaluate_cli_end_to_end(tiny_model, data_dir, tmp_path, device):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "evaluate.py"), "--model", tiny_model, "--data-dir", data_dir,
           "--out", str(out), "--gsm8k-limit", "8", "--mmlu-limit", "8", "--truthfulqa-limit", "8",
           "--max-new-tokens", "16", "--gsm8k-fewshot", "1", "--mmlu-shots", "1", "--batch-size", "4",
           "--samples", "2", "--device", device]
    subprocess.run(cmd + ["base"], check=True, capture_output=True, text=True)
    base = json.loads((out / "eval.json").read_text())
    assert base["gsm8k"]["n"] == base["gsm8k_fewshot"]["n"] == base["mmlu"]["n"] == base["truthfulqa"]["n"] == 8
    assert (base["gsm8k"]["shots"], base["gsm8k_fewshot"]["shots"]) == (0, 1)
    assert base["gsm8k_samples"]["n"] == 8 and base["gsm8k_samples"]["fingerprint"]["samples"] == 2
    assert sorted(base["gsm8k_samples"]) == sorted(["mean", "mean_stderr", "n", "samples", "pass@1", "pass@2",
                                                    "fingerprint"])
    samples = [json.loads(l) for l in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted({s["task"] for s in samples}) == ["gsm8k", "gsm8k_fewshot", "gsm8k_samples", "mmlu", "truthfulqa"]
    assert len(samples) == 40
    mmlu_right = [s["correct"] for s in samples if s["task"] == "mmlu"]
    assert sum(mmlu_right) / 8 == base["mmlu"]["acc"]
    assert abs(base["mmlu"]["acc_stderr"] - np.std(mmlu_right, ddof=1) / np.sqrt(8)) < 1e-12
    # each answer is the choice of highest log-likelihood, right where it is the gold one
    truthfulqa = data.load_truthfulqa(data_dir)
    for s in samples:
        if s["task"] == "mmlu":
            assert s["prediction"] == int(np.argmax(s["loglikelihoods"]))
            assert s["correct"] == (s["prediction"] == s["answer"])
        elif s["task"] == "truthfulqa":
            mc1_labels = list(truthfulqa[s["index"]]["mc1_targets"].values())
            mc2_labels = list(truthfulqa[s["index"]]["mc2_targets"].values())
            assert s["prediction"] == int(np.argmax(s["mc1_loglikelihoods"]))
            assert s["correct"] == (mc1_labels[s["prediction"]] == 1)
            assert s["mc2"] == E.mc2_score(s["mc2_loglikelihoods"], mc2_labels)
        elif s["task"] == "gsm8k_samples":
            assert len(s["completions"]) == 2 and s["correct"] == [
                data.same_number(data.extract_answer(t, "flexible"), s["gold"]) for t in s["completions"]]
        else:
            assert s["flexible"] == data.extract_answer(s["completion"], "flexible")
    train = data.load_gsm8k("train", data_dir)
    gsm8k_rows = data.load_gsm8k("test", data_dir)
    rng = random.Random(1234)  # --gsm8k-fewshot 1: each question's example drawn in turn, as lm-eval does
    drawn = [rng.sample(train, 1) for _ in range(8)]
    for s in samples:  # 0-shot: the format the methods train on
        if s["task"] in ("gsm8k", "gsm8k_fewshot"):
            shots = drawn[s["index"]] if s["task"] == "gsm8k_fewshot" else []
            assert s["prompt"] == data.gsm8k_prompt(gsm8k_rows[s["index"]]["question"], shots)
            assert s["correct"] == data.same_number(s["flexible"], s["gold"])
    tqa = [s for s in samples if s["task"] == "truthfulqa"]
    assert base["truthfulqa"]["mc1"] == sum(s["correct"] for s in tqa) / 8
    assert abs(base["truthfulqa"]["mc2"] - sum(s["mc2"] for s in tqa) / 8) < 1e-12

    # a run folder: base model + a random adapter gets retention against the base
    m, _ = M.load(tiny_model)
    lora.add_lora(m, rank=2, alpha=4)
    with torch.no_grad():
        for p in lora.lora_parameters(m):
            p.normal_(0, 0.5)
    run = out / "stress"
    lora.save_adapter(m, str(run))
    subprocess.run(cmd + [str(run)], check=True, capture_output=True, text=True)
    result = json.loads((run / "eval.json").read_text())
    errors = E.paired_stderr(E.read_samples(str(out)), E.read_samples(str(run)), str(out))
    expected = E.retention(E.retention_scores(base), E.retention_scores(result), errors)
    assert result["retention"] == expected and "forgetting" in expected and "forgetting_stderr" in expected
    table = subprocess.run([sys.executable, os.path.join(ROOT, "results.py"), str(out)],
                           check=True, capture_output=True, text=True).stdout
    assert "| base |" in table and "| stress |" in table and "0.420" in table  # paper's stress GSM8K beside ours
    assert "| pass@2 | sampled |" in table
    assert (out / "results.md").read_text() in table + "\n"

    # one task again: the other tasks' numbers and samples of the same adapter stay; another adapter's go
    samples = E.read_samples(str(run))
    subprocess.run(cmd + ["--tasks", "truthfulqa", str(run)], check=True, capture_output=True, text=True)
    again = json.loads((run / "eval.json").read_text())
    kept = ("gsm8k", "gsm8k_fewshot", "gsm8k_samples", "mmlu", "truthfulqa", "retention")
    assert {k: again[k] for k in kept} == {k: result[k] for k in kept}
    assert sorted(map(json.dumps, E.read_samples(str(run)))) == sorted(map(json.dumps, samples))
    with torch.no_grad():
        for p in lora.lora_parameters(m):
            p.normal_(0, 0.5)
    lora.save_adapter(m, str(run))
    subprocess.run(cmd + ["--tasks", "truthfulqa", str(run)], check=True, capture_output=True, text=True)
    fresh = json.loads((run / "eval.json").read_text())
    assert sorted(fresh) == ["retention", "settings", "truthfulqa"] and list(fresh["retention"]["per_task"]) == [
        "truthfulqa"]
    assert {s["task"] for s in E.read_samples(str(run))} == {"truthfulqa"}

    bad = subprocess.run(cmd + [str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode != 0 and "is not a run folder" in bad.stderr.strip().splitlines()[-1]


def test_more_mmlu_shots_than_the_dev_split_holds_is_an_input_error(data_dir, monkeypatch):
    with pytest.raises(InputError, match=r"--mmlu-shots 6: the dev split holds 5 examples of \w+; pass --mmlu-shots 5"):
        E.eval_mmlu(None, None, data_dir, 8, 6, "letter", 1234, 16)  # raised before any model is needed
    # five, the default and all the dev split holds, is taken: every prompt gets its subject's five examples
    prompts = []
    monkeypatch.setattr(E, "score_choices", lambda model, tok, contexts, choices, *rest, **kw:
                        prompts.extend(contexts) or [[0.0] * 4 for _ in contexts])
    E.eval_mmlu(None, None, data_dir, 8, 5, "letter", 1234, 16)
    assert len(prompts) == 8 and all(p.count("\nAnswer: ") == 5 for p in prompts)


@pytest.mark.parametrize("tasks,unknown", [("gsm8k,mmlux", "mmlux"), ("gsm8k,", ""), ("MMLU", "MMLU")])
def test_an_unknown_task_is_named_before_anything_runs(tmp_path, capsys, tasks, unknown):
    with pytest.raises(SystemExit):
        E.main(["base", "--model", str(tmp_path / "no-model"), "--tasks", tasks])  # no model is looked for
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument --tasks: unknown task {unknown!r} in {tasks!r}; name tasks from gsm8k,mmlu,truthfulqa" in err


def test_a_run_or_task_named_twice_is_evaluated_once_and_too_many_gsm8k_shots_are_refused(tiny_model, data_dir,
                                                                                          tmp_path, monkeypatch,
                                                                                          capsys):
    assert E.task_list("gsm8k,mmlu,gsm8k") == "gsm8k,mmlu"
    m, _ = M.load(tiny_model)
    lora.add_lora(m, rank=2, alpha=4)
    run = tmp_path / "stress"
    lora.save_adapter(m, str(run), base_model=tiny_model)
    evaluated = []
    plain = E.evaluate
    monkeypatch.setattr(E, "evaluate", lambda model, tok, data_dir, flags: evaluated.append(flags["tasks"]) or
                        plain(model, tok, data_dir, flags))
    flags = ["--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path), "--tasks", "mmlu,mmlu",
             "--mmlu-limit", "2", "--mmlu-shots", "0"]
    E.main([str(run), str(run), *flags])  # a second adapter named like the first stopped it with a ValueError
    assert evaluated == ["mmlu"] and json.loads((run / "eval.json").read_text())["mmlu"]["n"] == 2
    # no base evaluation in --out: said, not left to a table of dashes
    assert f"note: no base evaluation {tmp_path}/eval.json, so no forgetting" in capsys.readouterr().out
    assert "retention" not in json.loads((run / "eval.json").read_text())
    before = (run / "eval.json").read_text()
    with pytest.raises(InputError, match=f"--out {run} is a run folder: the base's eval.json would replace the run's"):
        E.main(["base", *flags[:4], "--out", str(run), *flags[6:]])
    assert (run / "eval.json").read_text() == before
    train_size = len(data.load_gsm8k("train", data_dir))
    with pytest.raises(InputError, match=f"--gsm8k-fewshot {train_size + 1}: the train split holds {train_size} "):
        E.main(["base", *flags[:-6], "--tasks", "gsm8k", "--gsm8k-fewshot", str(train_size + 1)])


def test_truthfulqa_scores_each_choice_of_a_question_once_with_the_scores_of_each_format(tiny_model, data_dir,
                                                                                          monkeypatch):
    # MC2's targets repeat MC1's: one pass over their union gives both formats' log-likelihoods
    m, tok = M.load(tiny_model)
    rows = data.load_truthfulqa(data_dir)[:6]
    prompts = [data.truthfulqa_prompt(r) for r in rows]
    apart = {k: E.score_choices(m, tok, prompts, [[f" {c}" for c in r[k]] for r in rows], 4) for k in
             ("mc1_targets", "mc2_targets")}
    scored = []
    plain = E.score_choices
    monkeypatch.setattr(E, "score_choices", lambda model, tok, contexts, choices, *a: scored.extend(
        map(tuple, choices)) or plain(model, tok, contexts, choices, *a))
    _, samples = E.eval_truthfulqa(m, tok, data_dir, 6, 4)
    assert sorted(scored) == sorted(tuple(dict.fromkeys(f" {c}" for c in [*r["mc1_targets"], *r["mc2_targets"]]))
                                    for r in rows)
    assert sum(map(len, scored)) < sum(len(r["mc1_targets"]) + len(r["mc2_targets"]) for r in rows)
    for s, mc1, mc2 in zip(samples, apart["mc1_targets"], apart["mc2_targets"]):
        assert np.allclose(s["mc1_loglikelihoods"], mc1, atol=1e-4) and np.allclose(s["mc2_loglikelihoods"], mc2, atol=1e-4)


def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_right_one():
    for n, c in [(5, 0), (5, 1), (6, 3), (7, 2), (8, 8)]:
        for k in range(1, n + 1):
            subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))  # every draw of k without replacement
            assert abs(E.pass_at_k(n, c, k) - sum(map(any, subsets)) / len(subsets)) < 1e-12


def test_samples_are_seeded_temperature_one_draws_scored_by_their_flexible_answer(tiny_model, data_dir, monkeypatch):
    model, tok = M.load(tiny_model)
    rows = data.load_gsm8k("test", data_dir)[:6]
    _, samples = E.eval_gsm8k_samples(model, tok, rows, 4, 8, 12)
    prompts = [data.gsm8k_prompt(r["question"]) for r in rows]
    assert [s["prompt"] for s in samples] == prompts
    order = sorted(range(6), key=lambda i: -len(prompts[i]))  # one batch, longest first, seeded from SAMPLE_SEED
    drawn = generate(model, tok, [prompts[i] for i in order], Sampling(n=4, max_new_tokens=12, temperature=1.0, stop=data.GSM8K_STOP, seed=E.SAMPLE_SEED))
    for k, i in enumerate(order):
        assert samples[i]["completions"] == [r.text for r in drawn[4 * k:4 * k + 4]]
    assert any(len(set(s["completions"])) > 1 for s in samples)  # drawn, not greedy
    # make some of the drawn answers right: each question's gold is its first sample's number
    answers = [[data.extract_answer(t, "flexible") for t in s["completions"]] for s in samples]
    for row, a in zip(rows, answers):
        row["gold"] = a[0] or "-1"
    scores, again = E.eval_gsm8k_samples(model, tok, rows, 4, 8, 12)
    right = [sum(data.same_number(x, row["gold"]) for x in a) for a, row in zip(answers, rows)]
    assert [sum(s["correct"]) for s in again] == right and sum(right) > 0
    for k in range(1, 5):
        assert abs(scores[f"pass@{k}"] - sum(E.pass_at_k(4, c, k) for c in right) / 6) < 1e-12
    assert abs(scores["mean"] - sum(right) / 24) < 1e-12 and abs(scores["pass@1"] - scores["mean"]) < 1e-12
    assert scores["pass@4"] >= scores["pass@2"] >= scores["pass@1"]
