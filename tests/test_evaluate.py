import argparse
import itertools
import json
import os
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
import runs
from conftest import DEVICES, ROOT


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
    base = E.PAPER["base"]
    for run in ("mild", "stress", "opd-mild", "opd-stress", "rl"):
        paper = E.PAPER[run]
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
    with pytest.raises(M.InputError, match="the base's answers in out are to other mmlu questions than this evaluation's"):
        E.paired_stderr(samples("mmlu", base_mmlu, "ab"), samples("mmlu", post_mmlu, "ac"), "out")


def test_a_run_is_not_compared_with_a_base_scored_on_other_questions(tiny_model, data_dir, tmp_path):
    m, _ = M.load(tiny_model)
    lora.add_lora(m, rank=2, alpha=4)
    run = tmp_path / "stress"
    lora.save_adapter(m, str(run))
    (run / "run.json").write_text(json.dumps({"model": tiny_model}))
    settings = dict(mmlu_limit=500, mmlu_shots=5, mmlu_scoring="letter", seed=1234, truthfulqa_limit=0)
    (tmp_path / "eval.json").write_text(json.dumps({"mmlu": {"acc": 0.5}, "settings": settings}))
    flags = ["--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path)]
    with pytest.raises(M.InputError, match="eval.json scored mmlu with --mmlu-limit 500, this evaluation with 8; "
                                           "forgetting compares the same questions: pass --mmlu-limit 500, or evaluate"):
        E.main([str(run), "--mmlu-limit", "8", *flags])  # before any model is loaded
    with pytest.raises(M.InputError, match="with --mmlu-scoring letter, this evaluation with text"):
        E.main([str(run), "--mmlu-scoring", "text", *flags])
    with pytest.raises(M.InputError, match="with --seed 1234, this evaluation with 7"):  # another subset of 500
        E.main([str(run), "--seed", "7", *flags])
    args = argparse.Namespace(tasks="mmlu,truthfulqa", **dict(settings, mmlu_limit=0, seed=7))
    E.check_same_questions({"mmlu": {}, "settings": dict(settings, mmlu_limit=0)}, args, "eval.json")  # all: any seed
    # a base evaluation of another model in the same --out: forgetting against it would mean nothing
    import re
    other = tmp_path / "other-base"
    other.mkdir()
    (tmp_path / "eval.json").write_text(json.dumps({"mmlu": {"acc": 0.5}, "settings": dict(settings, model=str(other))}))
    with pytest.raises(M.InputError, match=re.escape(f"eval.json is the evaluation of base {other}, but --model is "
                                                     f"{tiny_model}; forgetting compares a run with its own base")):
        E.main([str(run), "--mmlu-limit", "500", *flags])
    # the same folder spelt another way is the same base: the questions are checked next
    (tmp_path / "eval.json").write_text(json.dumps({"mmlu": {"acc": 0.5}, "settings": dict(settings, model=tiny_model + "/")}))
    with pytest.raises(M.InputError, match="with --mmlu-limit 500, this evaluation with 8"):
        E.main([str(run), "--mmlu-limit", "8", *flags])


def test_table_gives_small_drift_in_significant_digits():
    """A small model's MMD^2 can be 1e-5: fixed decimals would print every run as 0.00000."""
    run = lambda mmd2: {"eval": {"gsm8k": {"flexible": 0.5}}, "drift": {"mmd2": mmd2}}
    table = E.results_markdown({"stress": run(1.5e-5), "stress-seed1": run(2.5e-5)})
    # MMD^2 is ours alone; MMD, sqrt(max(MMD^2, 0)) run by run, stands beside Table 2's column of that name
    assert "| stress | 0.500±0.000 / 0.420 |" in table and "| 2e-05±7.071e-06 | 0.004436±0.0007969 / 0.01093 |" in table


def test_drift_against_forgetting_correlations():
    rows = [dict(run=n, mmd2=m, forgetting=f) for n, m, f in (("a", 1.0, 0.1), ("b", 2.0, 0.3), ("c", 3.0, 0.2),
                                                              ("d", 4.0, 0.4), ("base", None, None))]
    got = E.drift_vs_forgetting(rows)
    mmd, forgetting = np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.1, 0.3, 0.2, 0.4])
    assert got["n"] == 4 and abs(got["spearman"] - 0.8) < 1e-12
    assert abs(got["pearson"] - np.corrcoef(mmd, forgetting)[0, 1]) < 1e-12
    assert E.ranks([0.3, 0.1, 0.3, 0.2]) == [3.5, 1.0, 3.5, 2.0]  # ties share their mean rank
    assert E.drift_vs_forgetting(rows[:2]) is None  # too few
    assert E.drift_vs_forgetting([dict(r, forgetting=0.0) for r in rows]) is None  # no spread
    # the paper's Table 2: rank differences 0, 2, 2, 2, 2 over five runs give 1 - 6 * 16 / (5 * 24) = 0.2
    paper = E.drift_vs_forgetting([dict(run=n, **v) for n, v in E.PAPER.items()], "mmd")
    assert paper["n"] == 5 and abs(paper["spearman"] - 0.2) < 1e-12
    # its p-value by brute force: the share of the 120 orders of five ranks whose Spearman's is at least 0.2 from zero
    orders = np.array(list(itertools.permutations(range(5))))
    rho = 1 - 6 * ((orders - np.arange(5)) ** 2).sum(1) / (5 * 24)
    assert paper["spearman_p"] == (np.abs(rho) >= 0.2 - 1e-12).mean() == 94 / 120
    assert E.permutation_p([1, 2, 3, 4, 5], [2, 4, 6, 8, 11]) == 2 / 120  # only the order itself and its reverse
    # beyond eight rows random pairings: a strong correlation stays rare among them, a weak one does not
    x = list(range(12))
    assert E.permutation_p(x, [v + 0.1 * (v % 3) for v in x]) < 0.001
    assert E.permutation_p(x, [5, 1, 9, 0, 11, 3, 7, 2, 10, 6, 4, 8]) > 0.2

    run = lambda mmd2, forgetting: {"eval": {"retention": {"forgetting": forgetting}}, "drift": {"mmd2": mmd2}}
    table = E.results_markdown({"mild": run(1e-5, 0.0), "mild-seed1": run(3e-5, 0.02), "stress": run(2e-5, 0.3),
                                "stress-seed1": run(4e-5, 0.5), "rl": run(6e-5, 0.01), "rl-seed1": run(4e-5, 0.03)})
    # condition means: MMD^2 2, 3, 5 (x 1e-5), forgetting 0.01, 0.4, 0.02: ranks 1, 2, 3 against 1, 3, 2
    pearson = np.corrcoef([2, 3, 5], [0.01, 0.4, 0.02])[0, 1]
    # three rows have six pairings, of rank correlations 1, 0.5, 0.5, -0.5, -0.5 and -1: all as far from zero as 0.5
    assert (f"over the 3 post-trained conditions: Spearman's rank correlation 0.50, Pearson's {pearson:.2f} (two-sided "
            f"permutation p-values 1.00 and ") in table
    assert "; the paper's Table 2, 5 runs: 0.20 and -0.08, p-values 0.78 and 0.88). Over the 6 single runs" in table
    assert "update norm against forgetting" not in table  # no adapter files, no update norms

    # the same question in weight space: the adapters' update norms against forgetting
    norms = {"mild": 1.0, "mild-seed1": 3.0, "stress": 9.0, "stress-seed1": 11.0, "rl": 2.0, "rl-seed1": 2.0}
    runs = {name: dict(run(1e-5, f), update_norm=norms[name]) for name, f in
            (("mild", 0.0), ("mild-seed1", 0.02), ("stress", 0.3), ("stress-seed1", 0.5), ("rl", 0.01), ("rl-seed1", 0.03))}
    table = E.results_markdown(runs)
    pearson = np.corrcoef([2, 10, 2], [0.01, 0.4, 0.02])[0, 1]
    assert (f"The update norm against forgetting over the 3 post-trained conditions: Spearman's 0.87, Pearson's "
            f"{pearson:.2f} (p-values ") in table  # ranks 1.5, 3, 1.5 against 1, 3, 2
    assert "| stress | " in table and " | 10.00±1.41 |" in table
    header, rule, *rows = [line for line in table.splitlines() if line.startswith("|")]
    assert {line.count("|") for line in [header, rule] + rows} == {header.count("|")}  # no cell breaks the columns


def test_a_run_is_measured_only_on_its_own_base(tiny_models, data_dir, tmp_path, capsys):
    """Two bases of the same shapes: the adapter would load on either without a word."""
    m, _ = M.load(tiny_models["tied"])
    lora.add_lora(m, rank=2, alpha=4)
    run = tmp_path / "stress"
    lora.save_adapter(m, str(run))
    (run / "run.json").write_text(json.dumps({"model": tiny_models["untied"]}))
    for main in (E.main, drift.main):
        with pytest.raises(M.InputError, match="stress was trained on base .*untied, but --model is .*tied; pass --model"):
            main([str(run), "--model", tiny_models["tied"], "--data-dir", str(data_dir), "--out", str(tmp_path)])

    def trained_on(model):
        (run / "run.json").write_text(json.dumps({"model": model}))
        return str(run)
    runs.check_same_base(trained_on(tiny_models["tied"] + "/."), tiny_models["tied"])  # one folder, two spellings
    runs.check_same_base(trained_on("Qwen/Qwen3-0.6B-Base"), "Qwen/Qwen3-0.6B-Base")
    with pytest.raises(M.InputError, match="trained on base Qwen/Qwen3-0.6B-Base, but --model is Qwen/Qwen3-1.7B-Base"):
        runs.check_same_base(trained_on("Qwen/Qwen3-0.6B-Base"), "Qwen/Qwen3-1.7B-Base")
    capsys.readouterr()
    runs.check_same_base(trained_on(str(tmp_path / "moved" / "base-model")), tiny_models["tied"])  # a study moved since
    assert "cannot be compared with --model" in capsys.readouterr().out


@pytest.mark.parametrize("device", DEVICES)
def test_evaluate_cli_end_to_end(tiny_model, data_dir, tmp_path, device):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "evaluate.py"), "--model", tiny_model, "--data-dir", data_dir,
           "--out", str(out), "--gsm8k-limit", "8", "--mmlu-limit", "8", "--truthfulqa-limit", "8",
           "--max-new-tokens", "16", "--gsm8k-fewshot", "1", "--mmlu-shots", "1", "--batch-size", "4",
           "--device", device]
    subprocess.run(cmd + ["base"], check=True, capture_output=True, text=True)
    base = json.loads((out / "eval.json").read_text())
    assert base["gsm8k"]["n"] == base["gsm8k_fewshot"]["n"] == base["mmlu"]["n"] == base["truthfulqa"]["n"] == 8
    assert (base["gsm8k"]["shots"], base["gsm8k_fewshot"]["shots"]) == (0, 1)
    samples = [json.loads(l) for l in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted({s["task"] for s in samples}) == ["gsm8k", "gsm8k_fewshot", "mmlu", "truthfulqa"]
    assert len(samples) == 32
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
        else:
            assert s["flexible"] == data.extract_answer(s["completion"], "flexible")
    train = data.load_gsm8k("train", data_dir)
    gsm8k_rows = data.load_gsm8k("test", data_dir)
    for s in samples:  # 0-shot: the format the methods train on; --gsm8k-fewshot 1: the first train example first
        if s["task"].startswith("gsm8k"):
            shots = train[:1] if s["task"] == "gsm8k_fewshot" else []
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
    table = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "--table", str(out)],
                           check=True, capture_output=True, text=True).stdout
    assert "| base |" in table and "| stress |" in table and "0.420" in table  # paper's stress GSM8K beside ours
    assert (out / "results.md").read_text() in table + "\n"

    bad = subprocess.run(cmd + [str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode != 0 and "is not a run folder" in bad.stderr.strip().splitlines()[-1]


def test_more_mmlu_shots_than_the_dev_split_holds_is_an_input_error(data_dir, monkeypatch):
    p = argparse.ArgumentParser()
    E.add_eval_args(p)
    args = p.parse_args(["--mmlu-limit", "8", "--mmlu-shots", "6"])
    args.data_dir = data_dir
    with pytest.raises(M.InputError, match=r"--mmlu-shots 6: the dev split holds 5 examples of \w+; pass --mmlu-shots 5"):
        E.eval_mmlu(None, None, args)  # raised before any model is needed
    # five, the default and all the dev split holds, is taken: every prompt gets its subject's five examples
    args.mmlu_shots = 5
    prompts = []
    monkeypatch.setattr(E, "score_choices", lambda model, tok, contexts, choices, *rest, **kw:
                        prompts.extend(contexts) or [[0.0] * 4 for _ in contexts])
    E.eval_mmlu(None, None, args)
    assert len(prompts) == 8 and all(p.count("\nAnswer: ") == 5 for p in prompts)


@pytest.mark.parametrize("tasks,unknown", [("gsm8k,mmlux", "mmlux"), ("gsm8k,", ""), ("MMLU", "MMLU")])
def test_an_unknown_task_is_named_before_anything_runs(tmp_path, capsys, tasks, unknown):
    with pytest.raises(SystemExit):
        E.main(["base", "--model", str(tmp_path / "no-model"), "--tasks", tasks])  # no model is looked for
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument --tasks: unknown task {unknown!r} in {tasks!r}; name tasks from gsm8k,mmlu,truthfulqa" in err


def test_a_table_without_evaluations_or_a_call_without_runs_says_what_to_do(tmp_path, capsys):
    with pytest.raises(M.InputError, match=f"no eval.json in {tmp_path} or its run folders; run `python evaluate.py base"):
        E.main(["--table", str(tmp_path)])
    with pytest.raises(SystemExit):
        E.main(["--model", str(tmp_path / "no-model")])
    assert "name 'base' and/or run folders to evaluate, or use --table ROOT" in capsys.readouterr().err


def test_a_log_line_cut_short_by_a_killed_run_is_left_out_of_the_state_nll(tmp_path):
    (tmp_path / "eval.json").write_text("{}")
    run = tmp_path / "stress"
    run.mkdir()
    (run / "eval.json").write_text("{}")
    (run / "log.jsonl").write_text('{"step": 1, "state_nll": 2.0}\n{"step": 2, "state_nll": 4.0}\n{"step": 3, "sta')
    assert E.collect_runs(str(tmp_path))["stress"]["state_nll"] == 3.0


def test_table_of_rows_outside_the_paper_gives_our_numbers_alone():
    """A run's snapshots (or a study of one's own) have no paper values to stand beside."""
    run = lambda mmd2, forgetting: {"eval": {"gsm8k": {"flexible": 0.5}, "retention": {"forgetting": forgetting}},
                                    "drift": {"mmd2": mmd2}}
    table = E.results_markdown({"step-000010": run(3e-5, 0.1), "step-000020": run(2e-5, 0.3),
                                "step-000030": run(1e-5, 0.2)})
    assert "paper" not in table and " / " not in table
    assert "| step-000020 | 0.500 | - | - | 2e-05 | 0.004472 | 0.3000 | - | - | - | - |" in table
    pearson = np.corrcoef([3, 2, 1], [0.1, 0.3, 0.2])[0, 1]
    assert f"MMD^2 against forgetting (P4) over the 3 rows: Spearman's rank correlation -0.50, Pearson's {pearson:.2f} (" in table
    # one paper condition among them brings the paper's column back for every row
    assert "| step-000020 | 0.500 / - |" in E.results_markdown({"stress": run(1e-5, 0.4), "step-000020": run(2e-5, 0.3)})


@pytest.mark.parametrize("device", DEVICES)  # on CUDA: training, evaluation and drift there in bf16
def test_a_runs_snapshots_evaluate_and_drift_into_a_table_of_steps(tiny_model, data_dir, tmp_path, device):
    """docs/toy-study-earlier.md's way to follow forgetting over training: snapshots, then evaluate.py and
    drift.py on snapshots/step-*, then a table of them."""
    import glob
    import sft
    out = tmp_path / "out"
    common = ["--model", tiny_model, "--data-dir", str(data_dir), "--device", device]
    sft.main([*common, "--out", str(out / "stress"), "--train-limit", "8", "--batch-size", "4", "--max-steps", "2",
              "--snapshot-every", "1", "--lr", "1e-2"])
    flags = [*common, "--out", str(out), "--gsm8k-limit", "4", "--mmlu-limit", "4", "--truthfulqa-limit", "4",
             "--max-new-tokens", "8", "--gsm8k-fewshot", "1", "--mmlu-shots", "1", "--batch-size", "4"]
    E.main(["base", *flags])
    (out / "stress" / "snapshots" / "results.md").write_text("an earlier table, not a run\n")
    steps = sorted(glob.glob(str(out / "stress" / "snapshots" / "step-*")))
    E.main([*steps, *flags])
    drift.main([*steps, *common, "--out", str(out), "--prompts", "4", "--max-new-tokens", "8", "--stride", "4",
                "--permutations", "10"])
    table = E.write_table(str(out / "stress" / "snapshots"))
    rows = [line for line in table.splitlines() if line.startswith("| step-")]
    assert [row.split(" | ")[0] for row in rows] == ["| step-000001", "| step-000002"]
    for row in rows:  # drift, forgetting against the base, the log's state_nll and the update norm are all there
        run, gsm8k, fewshot, tqa, mmlu, mmd2, mmd, forgetting, stderr, retention, state_nll, update_norm = \
            row.strip("| ").split(" | ")
        assert "-" not in (gsm8k, fewshot, mmd2, mmd, forgetting, stderr, state_nll, update_norm), row  # a random base may score 0: no retention


def test_a_run_trained_after_its_evaluation_stops_the_table_until_it_is_measured_again(tiny_model, data_dir, tmp_path):
    """Resuming a run for more steps rewrites its adapter; its eval.json and drift.json
    still hold the earlier adapter's numbers, and the table would put them beside the new
    adapter's update norm and state_nll."""
    import hashlib
    import re
    import sft
    out, common = tmp_path / "out", ["--model", tiny_model, "--data-dir", str(data_dir)]
    run = out / "stress"
    train = [*common, "--out", str(run), "--train-limit", "8", "--batch-size", "4", "--lr", "1e-2"]
    flags = [*common, "--out", str(out), "--tasks", "mmlu", "--mmlu-limit", "4", "--mmlu-shots", "0", "--batch-size", "4"]
    drift_flags = [*common, "--out", str(out), "--prompts", "2", "--max-new-tokens", "4", "--stride", "2",
                   "--permutations", "5"]
    sft.main([*train, "--max-steps", "1"])
    E.main(["base", str(run), *flags])
    drift.main([str(run), *drift_flags])
    digest = hashlib.sha256((run / "adapter_model.safetensors").read_bytes()).hexdigest()
    for name in ("eval.json", "drift.json"):
        assert json.loads((run / name).read_text())["adapter_sha256"] == digest
    assert E.current(str(run)) and drift.current(str(run))
    E.write_table(str(out))

    sft.main([*train, "--max-steps", "2", "--resume"])
    assert not E.current(str(run)) and not drift.current(str(run))
    stale = (f"{run}/eval.json scored an earlier adapter than the one {run} holds now (trained since); evaluate it "
             f"again: python evaluate.py {run} with the flags in its settings")
    with pytest.raises(M.InputError, match=re.escape(stale)):
        E.write_table(str(out))
    E.main([str(run), *flags])
    with pytest.raises(M.InputError, match=re.escape(f"{run}/drift.json measured an earlier adapter")):
        E.write_table(str(out))
    drift.main([str(run), *drift_flags])
    assert E.current(str(run)) and drift.current(str(run))
    assert "| stress |" in E.write_table(str(out))
    # results written before they recorded their adapter cannot be told apart: taken as they are
    for name in ("eval.json", "drift.json"):
        result = json.loads((run / name).read_text())
        (run / name).write_text(json.dumps({k: v for k, v in result.items() if k != "adapter_sha256"}))
    assert E.current(str(run)) and drift.current(str(run))
    # the base evaluated again after the run (say on other questions): the run's forgetting is of the old base
    base = json.loads((out / "eval.json").read_text())
    assert json.loads((run / "eval.json").read_text())["retention"]["base"] == {"mmlu": base["mmlu"]["acc"]}
    (out / "eval.json").write_text(json.dumps({**base, "mmlu": {**base["mmlu"], "acc": base["mmlu"]["acc"] + 0.25}}))
    with pytest.raises(M.InputError, match=re.escape(f"{run}/eval.json measured forgetting against a base mmlu score "
                                                     f"of {base['mmlu']['acc']}, but {out}/eval.json now holds")):
        E.write_table(str(out))


def test_rows_measured_with_other_flags_in_one_column_stop_the_table(tmp_path):
    """GSM8K at other shots, or drift over longer rollouts, would differ by the flags alone."""
    settings = dict(gsm8k_limit=500, gsm8k_fewshot=0, max_new_tokens=256, mmlu_limit=0, mmlu_shots=5,
                    mmlu_scoring="letter", seed=1234, truthfulqa_limit=0, batch_size=16)
    scores = {"gsm8k": {"flexible": 0.5}, "mmlu": {"acc": 0.4}, "truthfulqa": {"mc1": 0.3}}
    drift_settings = dict(model="m", prompts=200, max_new_tokens=256, temperature=1.0, stride=16, seed=0)

    def write(name, eval_settings, tasks=("gsm8k", "mmlu", "truthfulqa"), drift_result=None):
        folder = tmp_path / name if name != "base" else tmp_path
        folder.mkdir(exist_ok=True)
        (folder / "eval.json").write_text(json.dumps({**{t: scores[t] for t in tasks}, "settings": eval_settings}))
        if drift_result is not None:
            (folder / "drift.json").write_text(json.dumps({"mmd2": 1e-5, "estimator": drift.ESTIMATOR, **drift_result}))

    lexical = dict(features="lexical", embed="state", settings=drift_settings)
    write("base", settings)
    write("mild", dict(settings, batch_size=4), drift_result=lexical)  # a flag that changes no question
    write("stress", dict(settings, seed=7), drift_result=lexical)  # every MMLU question whatever the seed
    write("rl", dict(settings, gsm8k_limit=100), tasks=("mmlu", "truthfulqa"))  # it has no GSM8K score to compare
    assert set(E.collect_runs(str(tmp_path))) == {"base", "mild", "stress", "rl"}
    # what reproduce.py asks before it evaluates a run again: every task it names, on its questions
    preset = argparse.Namespace(tasks="gsm8k,mmlu,truthfulqa", **settings)
    assert E.current(str(tmp_path / "mild"), preset) and E.current(str(tmp_path), preset)
    assert not E.current(str(tmp_path / "rl"), preset)  # no GSM8K score
    assert E.current(str(tmp_path / "rl"), argparse.Namespace(**{**vars(preset), "tasks": "mmlu,truthfulqa"}))
    assert not E.current(str(tmp_path / "stress"), argparse.Namespace(**{**vars(preset), "mmlu_limit": 100}))
    # the study folder used again with another base model: its base evaluation is not that model's
    first, second = tmp_path / "first-model", tmp_path / "second-model"
    first.mkdir(), second.mkdir()
    write("base", dict(settings, model=str(first)))
    assert E.current(str(tmp_path), argparse.Namespace(**vars(preset), model=str(first) + "/"))
    assert not E.current(str(tmp_path), argparse.Namespace(**vars(preset), model=str(second)))
    write("base", settings)

    write("rl", dict(settings, gsm8k_limit=100))
    with pytest.raises(M.InputError, match=r"^rl's gsm8k was measured with --gsm8k-limit 100, base's with 500; evaluate both "
                                           r"with the same flags to put them in one table$"):
        E.collect_runs(str(tmp_path))
    write("rl", dict(settings, mmlu_limit=100), tasks=("mmlu",))
    with pytest.raises(M.InputError, match=r"^rl's mmlu was measured with --mmlu-limit 100, base's with 0"):
        E.collect_runs(str(tmp_path))
    write("rl", settings, drift_result=dict(lexical, settings=dict(drift_settings, stride=8)))
    with pytest.raises(M.InputError, match=r"^rl's drift was measured with --stride 8, mild's with 16; measure both"):
        E.collect_runs(str(tmp_path))
    write("rl", settings, drift_result=dict(lexical, features="hidden"))
    with pytest.raises(M.InputError, match=r"^rl's drift was measured with --features hidden, mild's with lexical"):
        E.collect_runs(str(tmp_path))
    write("rl", settings, drift_result=dict(lexical, settings=dict(drift_settings, model="/elsewhere/m")))
    assert "rl" in E.collect_runs(str(tmp_path))  # the base model is checked where a run is loaded, by its folder


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
    monkeypatch.setattr(E, "evaluate", lambda model, tok, args: evaluated.append(args.tasks) or plain(model, tok, args))
    flags = ["--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path), "--tasks", "mmlu,mmlu",
             "--mmlu-limit", "2", "--mmlu-shots", "0"]
    E.main([str(run), str(run), *flags])  # a second adapter named like the first stopped it with a ValueError
    assert evaluated == ["mmlu"] and json.loads((run / "eval.json").read_text())["mmlu"]["n"] == 2
    # no base evaluation in --out: said, not left to a table of dashes
    assert f"note: no base evaluation in {tmp_path} ({tmp_path}/eval.json), so no forgetting" in capsys.readouterr().out
    assert "retention" not in json.loads((run / "eval.json").read_text())
    before = (run / "eval.json").read_text()
    with pytest.raises(M.InputError, match=f"--out {run} is a run folder: the base's eval.json would replace the run's"):
        E.main(["base", *flags[:4], "--out", str(run), *flags[6:]])
    assert (run / "eval.json").read_text() == before
    train_size = len(data.load_gsm8k("train", data_dir))
    with pytest.raises(M.InputError, match=f"--gsm8k-fewshot {train_size + 1}: the train split holds {train_size} "):
        E.main(["base", *flags[:-6], "--tasks", "gsm8k", "--gsm8k-fewshot", str(train_size + 1)])


def test_a_table_of_a_folder_that_holds_studies_names_them(tmp_path, capsys):
    def study(folder, runs):
        folder.mkdir(parents=True)
        (folder / "eval.json").write_text(json.dumps({"gsm8k": {"flexible": 0.5}}))
        for run in runs:
            (folder / run).mkdir()
            (folder / run / "eval.json").write_text(json.dumps({"gsm8k": {"flexible": 0.6}}))
    study(tmp_path / "out" / "toy", ["mild", "stress"])
    with pytest.raises(M.InputError, match=f"the studies under it: {tmp_path / 'out' / 'toy'} \\(pass one of them\\)"):
        E.write_table(str(tmp_path / "out"))
    # a study of its own beside them: its rows, and a note naming the one under it
    (tmp_path / "out" / "eval.json").write_text(json.dumps({"gsm8k": {"flexible": 0.4}}))
    table = E.write_table(str(tmp_path / "out"))
    assert "| base |" in table and "| toy |" not in table and "| mild |" not in table
    assert f"note: {tmp_path / 'out' / 'toy'} holds a study of its own" in capsys.readouterr().out
    assert "| mild |" in E.write_table(str(tmp_path / "out" / "toy"))
