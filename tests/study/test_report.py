"""The study's report (study/report.py, results.py): the table, seeds merged, the P4 correlations, and the
fingerprints that keep numbers measured otherwise out of one column."""
import argparse
import itertools
import json
import re
import sys

import numpy as np
import pytest

import drift
import results
import evaluate as E
from conftest import DEVICES
from plumbing import provenance
from plumbing.files import InputError
from study import figures, report as R


def evaluated(folder, settings):
    """What reproduce.py asks of an evaluation: every column the flags ask for, current."""
    return provenance.current(folder, "eval.json", E.columns(settings), settings)


def test_table_gives_small_drift_in_significant_digits():
    """A small model's MMD^2 can be 1e-5: fixed decimals would print every run as 0.00000."""
    run = lambda mmd2: {"eval": {"gsm8k": {"flexible": 0.5}}, "drift": {"mmd2": mmd2}}
    table = R.results_markdown({"stress": run(1.5e-5), "stress-seed1": run(2.5e-5)})
    # MMD^2 is ours alone; MMD, sqrt(max(MMD^2, 0)) run by run, stands beside Table 2's column of that name
    assert "| stress | 0.500±0.000 / 0.420 |" in table and "| 2e-05±7.071e-06 | 0.004436±0.0007969 / 0.01093 |" in table


def test_drift_against_forgetting_correlations():
    rows = [dict(run=n, mmd2=m, forgetting=f) for n, m, f in (("a", 1.0, 0.1), ("b", 2.0, 0.3), ("c", 3.0, 0.2),
                                                              ("d", 4.0, 0.4), ("base", None, None))]
    got = R.drift_vs_forgetting(rows)
    mmd, forgetting = np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.1, 0.3, 0.2, 0.4])
    assert got["n"] == 4 and abs(got["spearman"] - 0.8) < 1e-12
    assert abs(got["pearson"] - np.corrcoef(mmd, forgetting)[0, 1]) < 1e-12
    assert R.ranks([0.3, 0.1, 0.3, 0.2]) == [3.5, 1.0, 3.5, 2.0]  # ties share their mean rank
    assert R.drift_vs_forgetting(rows[:2]) is None  # too few
    assert R.drift_vs_forgetting([dict(r, forgetting=0.0) for r in rows]) is None  # no spread
    # the paper's Table 2: rank differences 0, 2, 2, 2, 2 over five runs give 1 - 6 * 16 / (5 * 24) = 0.2
    paper = R.drift_vs_forgetting([dict(run=n, **v) for n, v in R.PAPER.items()], "mmd")
    assert paper["n"] == 5 and abs(paper["spearman"] - 0.2) < 1e-12
    # its p-value by brute force: the share of the 120 orders of five ranks whose Spearman's is at least 0.2 from zero
    orders = np.array(list(itertools.permutations(range(5))))
    rho = 1 - 6 * ((orders - np.arange(5)) ** 2).sum(1) / (5 * 24)
    assert paper["spearman_p"] == (np.abs(rho) >= 0.2 - 1e-12).mean() == 94 / 120
    assert R.permutation_p([1, 2, 3, 4, 5], [2, 4, 6, 8, 11]) == 2 / 120  # only the order itself and its reverse
    # beyond eight rows random pairings: a strong correlation stays rare among them, a weak one does not
    x = list(range(12))
    assert R.permutation_p(x, [v + 0.1 * (v % 3) for v in x]) < 0.001
    assert R.permutation_p(x, [5, 1, 9, 0, 11, 3, 7, 2, 10, 6, 4, 8]) > 0.2

    run = lambda mmd2, forgetting: {"eval": {"retention": {"forgetting": forgetting}}, "drift": {"mmd2": mmd2}}
    table = R.results_markdown({"mild": run(1e-5, 0.0), "mild-seed1": run(3e-5, 0.02), "stress": run(2e-5, 0.3),
                                "stress-seed1": run(4e-5, 0.5), "rl": run(6e-5, 0.01), "rl-seed1": run(4e-5, 0.03)})
    # condition means: MMD^2 2, 3, 5 (x 1e-5), forgetting 0.01, 0.4, 0.02: ranks 1, 2, 3 against 1, 3, 2
    pearson = np.corrcoef([2, 3, 5], [0.01, 0.4, 0.02])[0, 1]
    # three rows have six pairings, of rank correlations 1, 0.5, 0.5, -0.5, -0.5 and -1: all as far from zero as 0.5
    assert (f"over the 3 post-trained conditions: Spearman's rank correlation 0.50, Pearson's {pearson:.2f} (two-sided "
            f"permutation p-values 1.00 and ") in table
    assert "; the paper's Table 2, 5 runs: 0.20 and -0.08, p-values 0.78 and 0.88). Over the 6 single runs" in table
    assert "\n| update norm |" not in table  # no adapter files, no update norms: no predictor row

    # the same question in weight space: the adapters' update norms against forgetting
    norms = {"mild": 1.0, "mild-seed1": 3.0, "stress": 9.0, "stress-seed1": 11.0, "rl": 2.0, "rl-seed1": 2.0}
    runs = {name: dict(run(1e-5, f), update_norm=norms[name]) for name, f in
            (("mild", 0.0), ("mild-seed1", 0.02), ("stress", 0.3), ("stress-seed1", 0.5), ("rl", 0.01), ("rl-seed1", 0.03))}
    table = R.results_markdown(runs)
    pearson = np.corrcoef([2, 10, 2], [0.01, 0.4, 0.02])[0, 1]
    # ranks 1.5, 3, 1.5 against 1, 3, 2; the six pairings of three rows give |rho| 0.87 four times and 0 twice
    assert f"| update norm | 3 | 0.87 | 0.67 | {pearson ** 2:.2f} | " in table
    assert "| stress | " in table and " | 10.00±1.41 |" in table
    header, rule, *rows = [line for line in table.split("\n\n")[1].splitlines() if line.startswith("|")]
    assert {line.count("|") for line in [header, rule] + rows} == {header.count("|")}  # no cell breaks the columns


def test_a_table_without_evaluations_or_a_call_without_runs_says_what_to_do(tmp_path, capsys):
    with pytest.raises(InputError, match=f"no eval.json in {tmp_path} or its run folders; run `python evaluate.py base"):
        results.main([str(tmp_path)])
    with pytest.raises(SystemExit):
        E.main(["--model", str(tmp_path / "no-model")])
    assert "name 'base' and/or run folders to evaluate (the table of a study: python results.py ROOT)" in \
        capsys.readouterr().err


def test_a_log_line_cut_short_by_a_killed_run_is_left_out_of_the_state_nll_base(tmp_path):
    (tmp_path / "eval.json").write_text("{}")
    run = tmp_path / "stress"
    run.mkdir()
    (run / "eval.json").write_text("{}")
    (run / "log.jsonl").write_text('{"step": 1, "state_nll_base": 2.0}\n{"step": 2, "state_nll_base": 4.0}\n{"step": 3, "sta')
    assert R.collect_runs(str(tmp_path))["stress"]["state_nll_base"] == 3.0


def test_table_of_rows_outside_the_paper_gives_our_numbers_alone():
    """A run's snapshots (or a study of one's own) have no paper values to stand beside."""
    run = lambda mmd2, forgetting: {"eval": {"gsm8k": {"flexible": 0.5}, "retention": {"forgetting": forgetting}},
                                    "drift": {"mmd2": mmd2}}
    table = R.results_markdown({"step-000010": run(3e-5, 0.1), "step-000020": run(2e-5, 0.3),
                                "step-000030": run(1e-5, 0.2)})
    assert "paper" not in table and " / " not in table
    assert "| step-000020 | 0.500 | - | - | 2e-05 | 0.004472 | 0.3000 | - | - | - | - | - |" in table
    pearson = np.corrcoef([3, 2, 1], [0.1, 0.3, 0.2])[0, 1]
    assert f"MMD^2 against forgetting (P4) over the 3 rows: Spearman's rank correlation -0.50, Pearson's {pearson:.2f} (" in table
    # one paper condition among them brings the paper's column back for every row
    assert "| step-000020 | 0.500 / - |" in R.results_markdown({"stress": run(1e-5, 0.4), "step-000020": run(2e-5, 0.3)})


@pytest.mark.parametrize("device", DEVICES)  # on CUDA: training, evaluation and drift there in bf16
def test_a_runs_snapshots_evaluate_and_drift_into_a_table_of_steps(tiny_model, data_dir, tmp_path, device):
    """docs/history/earlier.md's way to follow forgetting over training: snapshots, then evaluate.py and
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
    table = R.write_results(str(out / "stress" / "snapshots"))
    assert figures.curves([str(out / "stress")], str(tmp_path / "curves.png"))  # the update norm at each snapshot beside the log
    assert (tmp_path / "curves.png").stat().st_size > 1000
    rows = [line for line in table.splitlines() if line.startswith("| step-")]
    assert [row.split(" | ")[0] for row in rows] == ["| step-000001", "| step-000002"]
    for row in rows:  # drift, forgetting against the base, the state distance, the KL and the update norm are all there
        run, gsm8k, fewshot, tqa, mmlu, mmd2, mmd, forgetting, stderr, retention, distance, kl, update_norm = \
            row.strip("| ").split(" | ")
        assert "-" not in (gsm8k, fewshot, mmd2, mmd, forgetting, stderr, distance, kl, update_norm), row  # a random base may score 0: no retention


def test_a_run_trained_after_its_evaluation_stops_the_table_until_it_is_measured_again(tiny_model, data_dir, tmp_path):
    """Resuming a run for more steps rewrites its adapter; its eval.json and drift.json
    still hold the earlier adapter's numbers, and the table would put them beside the new
    adapter's update norm and state_nll."""
    import hashlib
    import sft
    out, common = tmp_path / "out", ["--model", tiny_model, "--data-dir", str(data_dir)]
    run = out / "stress"
    train = [*common, "--out", str(run), "--train-limit", "8", "--batch-size", "4", "--lr", "1e-2"]
    flags = [*common, "--out", str(out), "--tasks", "mmlu", "--mmlu-limit", "4", "--mmlu-shots", "0", "--batch-size", "4"]
    drift_flags = [*common, "--out", str(out), "--prompts", "2", "--max-new-tokens", "4", "--stride", "2",
                   "--permutations", "5"]
    eval_args, drift_args = argparse.ArgumentParser(), argparse.ArgumentParser()
    for p, add in ((eval_args, E.add_eval_args), (drift_args, drift.add_drift_args)):
        p.add_argument("--model"), p.add_argument("--data-dir"), p.add_argument("--out"), add(p)
    eval_args, drift_args = vars(eval_args.parse_args(flags)), vars(drift_args.parse_args(drift_flags))
    sft.main([*train, "--max-steps", "1"])
    E.main(["base", str(run), *flags])
    drift.main([str(run), *drift_flags])
    digest = hashlib.sha256((run / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert json.loads((run / "eval.json").read_text())["mmlu"]["fingerprint"]["adapter_sha256"] == digest
    assert json.loads((run / "drift.json").read_text())["fingerprint"]["adapter_sha256"] == digest
    drifted = lambda: provenance.current(str(run), "drift.json", ["drift"], drift_args)  # noqa: E731
    assert evaluated(str(run), eval_args) and drifted() and evaluated(str(out), eval_args)
    R.write_results(str(out))

    sft.main([*train, "--max-steps", "2", "--resume"])
    assert not evaluated(str(run), eval_args) and not drifted()
    stale = f"{run}'s mmlu was measured on another adapter than the one there now (trained since"
    with pytest.raises(InputError, match=re.escape(stale) + ".*; measure it again: python evaluate.py " + str(run)):
        R.write_results(str(out))
    E.main([str(run), *flags])
    with pytest.raises(InputError, match=re.escape(f"{run}'s drift was measured on another adapter")):
        R.write_results(str(out))
    drift.main([str(run), *drift_flags])
    assert evaluated(str(run), eval_args) and drifted()
    assert "| stress |" in R.write_results(str(out))
    # the base evaluated again on other questions: the run's forgetting is against the old ones
    E.main(["base", *flags[:-6], "--mmlu-limit", "3", "--mmlu-shots", "0", "--batch-size", "4"])
    with pytest.raises(InputError, match="^stress's mmlu was measured with --mmlu-limit 4, base's with 3; evaluate"):
        R.write_results(str(out))


def test_rows_measured_with_other_flags_in_one_column_stop_the_table(tmp_path):
    """GSM8K at other shots, or drift over longer rollouts, would differ by the flags alone."""
    settings = dict(model="m", tasks="gsm8k,mmlu,truthfulqa", gsm8k_limit=500, gsm8k_fewshot=0, samples=0, max_new_tokens=256,
                    mmlu_limit=0, mmlu_shots=5, mmlu_scoring="letter", seed=1234, truthfulqa_limit=0, batch_size=16)
    scores = {"gsm8k": {"flexible": 0.5}, "mmlu": {"acc": 0.4}, "truthfulqa": {"mc1": 0.3}}
    lexical = dict(model="m", features="lexical", embed="state", prompts=200, max_new_tokens=256, temperature=1.0,
                   stride=16, seed=0)

    def write(name, eval_settings, tasks=("gsm8k", "mmlu", "truthfulqa"), drift_settings=None):
        folder = tmp_path / name if name != "base" else tmp_path
        folder.mkdir(exist_ok=True)
        (folder / "eval.json").write_text(json.dumps({t: {**scores[t], "fingerprint": provenance.fingerprint(t, eval_settings)}
                                                      for t in tasks}))
        if drift_settings is not None:
            (folder / "drift.json").write_text(json.dumps({"mmd2": 1e-5, "fingerprint": provenance.fingerprint(
                "drift", drift_settings)}))

    write("base", settings)
    write("mild", dict(settings, batch_size=4), drift_settings=lexical)  # a flag that changes no question
    write("stress", dict(settings, seed=7), drift_settings=lexical)  # every MMLU question whatever the seed
    write("rl", dict(settings, gsm8k_limit=100), tasks=("mmlu", "truthfulqa"))  # it has no GSM8K score to compare
    assert set(R.collect_runs(str(tmp_path))) == {"base", "mild", "stress", "rl"}
    # what reproduce.py asks before it evaluates a run again: every task it names, on its questions
    preset = settings
    assert evaluated(str(tmp_path / "mild"), preset) and evaluated(str(tmp_path), preset)
    assert not evaluated(str(tmp_path / "rl"), preset)  # no GSM8K score
    assert evaluated(str(tmp_path / "rl"), {**settings, "tasks": "mmlu,truthfulqa"})
    assert not evaluated(str(tmp_path / "stress"), {**settings, "mmlu_limit": 100})
    assert not evaluated(str(tmp_path), {**settings, "samples": 16})  # no pass@16 drawn yet
    # the study folder used again with another base model: its base evaluation is not that model's
    first, second = tmp_path / "first-model", tmp_path / "second-model"
    first.mkdir(), second.mkdir()
    write("base", dict(settings, model=str(first)))
    assert evaluated(str(tmp_path), {**settings, "model": str(first) + "/"})
    assert not evaluated(str(tmp_path), {**settings, "model": str(second)})
    write("base", settings)

    write("rl", dict(settings, gsm8k_limit=100))
    with pytest.raises(InputError, match=r"^rl's gsm8k was measured with --gsm8k-limit 100, base's with 500; evaluate both "
                                           r"with the same flags to put them in one table$"):
        R.collect_runs(str(tmp_path))
    write("rl", dict(settings, mmlu_limit=100), tasks=("mmlu",))
    with pytest.raises(InputError, match=r"^rl's mmlu was measured with --mmlu-limit 100, base's with 0"):
        R.collect_runs(str(tmp_path))
    write("rl", settings, drift_settings=dict(lexical, stride=8))
    with pytest.raises(InputError, match=r"^rl's drift was measured with --stride 8, mild's with 16; measure both"):
        R.collect_runs(str(tmp_path))
    write("rl", settings, drift_settings=dict(lexical, features="hidden"))
    with pytest.raises(InputError, match=r"^rl's drift was measured with --features hidden, mild's with lexical"):
        R.collect_runs(str(tmp_path))
    write("rl", settings, drift_settings=dict(lexical, model="other"))
    with pytest.raises(InputError, match=r"^rl's drift was measured with --model other, mild's with m"):
        R.collect_runs(str(tmp_path))


def test_a_table_of_a_folder_that_holds_studies_names_them(tmp_path, capsys):
    def study(folder, runs):
        folder.mkdir(parents=True)
        (folder / "eval.json").write_text(json.dumps({"gsm8k": {"flexible": 0.5}}))
        for run in runs:
            (folder / run).mkdir()
            (folder / run / "eval.json").write_text(json.dumps({"gsm8k": {"flexible": 0.6}}))
    study(tmp_path / "out" / "toy", ["mild", "stress"])
    with pytest.raises(InputError, match=f"the studies under it: {tmp_path / 'out' / 'toy'} \\(pass one of them\\)"):
        R.write_results(str(tmp_path / "out"))
    # a study of its own beside them: its rows, and a note naming the one under it
    (tmp_path / "out" / "eval.json").write_text(json.dumps({"gsm8k": {"flexible": 0.4}}))
    table = R.write_results(str(tmp_path / "out"))
    assert "| base |" in table and "| toy |" not in table and "| mild |" not in table
    assert f"note: {tmp_path / 'out' / 'toy'} holds a study of its own" in capsys.readouterr().out
    assert "| mild |" in R.write_results(str(tmp_path / "out" / "toy"))


def test_state_distance_and_the_four_predictors_of_forgetting():
    """state distance = a run's mean state_nll_base less the base's reference (drift.json);
    each predictor's Spearman and R^2 against forgetting, with p-values, over conditions and runs."""
    def run(nll, kl, forgetting, norm):
        return {"eval": {"retention": {"forgetting": forgetting}}, "state_nll_base": nll, "update_norm": norm,
                "drift": {"mmd2": kl / 10, "kl_to_base": kl, "state_nll_reference": 0.5}}
    found = {"mild": run(1.4, 1.0, 0.0, 2.0), "mild-seed1": run(1.6, 2.0, 0.01, 3.0),
             "stress": run(1.5, 9.0, 0.4, 50.0), "stress-seed1": run(1.7, 7.0, 0.3, 54.0),
             "rl": run(0.6, 3.0, 0.02, 1.0), "rl-seed1": run(0.8, 4.0, 0.03, 2.0)}
    rows = R.table_rows(found)
    assert [round(r["state_distance"], 9) for r in rows] == [0.9, 1.1, 1.0, 1.2, 0.1, 0.3]
    table = R.results_markdown(found)
    assert "| mild | - / 0.512 |" in table and "| 1.000±0.141 | 1.5±0.707 |" in table  # state distance, KL to base
    assert "less that of its own temperature-1 samples, 0.500;" in table
    grouped = R.group_seeds(rows)  # conditions: mild, stress, rl
    forgetting = [g["forgetting"] for g in grouped]
    for key, label in R.PREDICTORS:
        x = [g[key] for g in grouped]
        rho = np.corrcoef(np.argsort(np.argsort(x)), np.argsort(np.argsort(forgetting)))[0, 1]
        r2 = np.corrcoef(x, forgetting)[0, 1] ** 2
        single = R.drift_vs_forgetting(rows, key)
        assert (f"| {label} | 3 | {rho:.2f} | " in table and f" | {r2:.2f} | " in table and
                " runs | Spearman |" in table and f"| 6 | {single['spearman']:.2f} | " in table), label
    # over the six runs the KL ranks forgetting perfectly: its permutation p is the share of 720 orders as extreme
    assert R.drift_vs_forgetting(rows, "kl_to_base")["spearman"] == 1.0
    assert R.drift_vs_forgetting(rows, "kl_to_base")["spearman_p"] == 2 / 720


def test_training_curves_merge_seeds_into_a_mean_and_a_band_and_figures_stay_optional(tmp_path, capsys, monkeypatch):
    logs = [[{"step": t, "loss": v} for t, v in enumerate([4.0, 2.0, 0.0, 2.0], 1)],
            [{"step": t, "loss": v} for t, v in enumerate([2.0, 2.0, 2.0], 1)] + [{"step": 4, "reward": 1.0}]]
    assert figures.curve(logs, "loss") == ([1, 2, 3], [3.0, 2.0, 1.0], [2.0, 2.0, 0.0], [4.0, 2.0, 2.0])  # steps both logs hold
    assert figures.curve(logs, "loss", window=2)[1] == [3.0, 2.5, 1.5]  # each log's running mean first: 4 3 1 / 2 2 2
    names = ("stress-seed1", "kd-stress", "opd-sampled", "rl", "base", "degraded-seed2", "kd-degraded", "opd-degraded",
             "sft-lr0.002", "rs-sft-lr0.006-seed1", "opd-data-lr0.01", "opd-student-lr0.01", "kd-lr0.003-seed2")
    assert [figures.state_source(n) for n in names] == [
        "data", "teacher", "student", "student", "other", "data", "teacher", "student",
        "data", "student", "data", "student", "teacher"]  # the frontier study's arms too
    for name, records in (("stress", logs[0]), ("stress-seed1", logs[1]), ("rl", logs[1])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    results.main(["--curves", *(str(tmp_path / n) for n in ("stress", "stress-seed1", "rl"))])
    assert (tmp_path / "curves.png").stat().st_size > 1000 and f"curves in {tmp_path / 'curves.png'}" in capsys.readouterr().out

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: one line says how, nothing else fails
    (tmp_path / "curves.png").unlink()
    (tmp_path / "eval.json").write_text("{}")
    (tmp_path / "rl" / "eval.json").write_text(json.dumps({"gsm8k": {"flexible": 0.5}}))
    R.write_results(str(tmp_path))
    assert "note: no figures without matplotlib (pip install matplotlib)" in capsys.readouterr().out
    assert (tmp_path / "results.md").is_file() and not (tmp_path / "curves.png").exists()
