"""
The study's report: every run folder's eval.json, drift.json and log gathered into one
table in the layout of the paper's Table 2, with the paper's numbers beside ours, seeds
merged into a mean and a spread, and what predicts forgetting: for each candidate (the
update norm, MMD^2 of the states (the paper's P4), the distance of the training states
from the base's own, the KL to the base on the target (RL's Razor's)) Spearman's rank
correlation and R^2 with forgetting, with permutation p-values; then the readings, the
paper's predictions by the rules written before the runs (readings.py). write_results
writes results.md, results.json and (with matplotlib) results.png into the study folder;
results.py is its command.

A table puts only numbers that compare in one column: every result carries a fingerprint
(the model, the adapter's sha256, the flags that decide its questions or rollouts), and
a run trained since it was measured, or two rows measured otherwise, stop the table in
one line that names the difference and the command that fixes it.
"""
import itertools
import os
import random
import statistics

import lora
from plumbing import provenance, runs
from plumbing.files import InputError, read_json, write_atomic, write_json
from study import figures, readings

# Table 2 of the paper (Nie 2026, arXiv 2605.22731), keyed by our run folder names
PAPER = {
    "base": dict(gsm8k=0.448, truthfulqa=0.300, mmlu=0.436),
    "mild": dict(gsm8k=0.512, truthfulqa=0.295, mmlu=0.444, mmd=0.00956, forgetting=-0.0015,
                 retention=1.0008),
    "stress": dict(gsm8k=0.420, truthfulqa=0.245, mmlu=0.364, mmd=0.01093, forgetting=0.0635,
                   retention=0.8258),
    "opd-mild": dict(gsm8k=0.512, truthfulqa=0.290, mmlu=0.434, mmd=0.01470, forgetting=0.0060,
                     retention=0.9810),
    "opd-stress": dict(gsm8k=0.466, truthfulqa=0.275, mmlu=0.430, mmd=0.01092, forgetting=0.0155,
                       retention=0.9515),
    "opd-logits": dict(gsm8k=0.040),
    "rl": dict(gsm8k=0.472, truthfulqa=0.290, mmlu=0.442, mmd=0.01098, forgetting=0.0020,
               retention=0.9902),
}
# the table's row order: the paper's, with kd-stress and opd-sampled (not in the paper)
# beside the runs they contrast, then P3's degraded teacher and its pair
RUN_ORDER = ["base", "mild", "stress", "opd-mild", "opd-stress", "kd-stress", "opd-logits",
             "opd-sampled", "rl", "degraded", "opd-degraded", "kd-degraded"]
# the table's columns that come from a result with a fingerprint (eval.json's tasks; drift.json)
COLUMNS = ("gsm8k", "gsm8k_fewshot", "gsm8k_samples", "mmlu", "truthfulqa")
# the candidate predictors of forgetting: (column, what results.md calls it)
PREDICTORS = (("update_norm", "update norm"), ("mmd2", "MMD^2 of the states (P4)"),
              ("state_distance", "state distance"), ("kl_to_base", "KL to the base (RL's Razor)"))


def study_folders(root):
    """The folders under root that hold a study of their own, as reproduce.py's --out does: a
    base evaluation (eval.json) beside run folders with theirs. Their runs are not root's."""
    found = []
    for base, folders, files in os.walk(root):
        if base != root and "eval.json" in files and any(
                os.path.isfile(os.path.join(base, f, "eval.json")) for f in folders):
            found.append(base)
            folders.clear()  # its runs are its own
    return sorted(found)


def measured(found):
    """(row, folder, column, fingerprint, the script that measures it) of every number of the
    table that carries a fingerprint: each eval.json column, each drift.json."""
    out = []
    for name, run in found.items():
        out += [(name, run["folder"], task, r.get("fingerprint", {}), "evaluate")
                for task, r in run["eval"].items() if task in COLUMNS]
        if "drift" in run:
            out.append((name, run["folder"], "drift", run["drift"].get("fingerprint", {}), "drift"))
    return out


def collect_runs(root):
    """name -> {"folder", "eval", "drift", "update_norm", "state_nll_base"} for the base (root's own
    eval.json) and each run folder in root, in the table's order; checked comparable first."""
    found = {}
    if os.path.isfile(os.path.join(root, "eval.json")):
        found["base"] = {"folder": root, "eval": read_json(os.path.join(root, "eval.json"))}
    studies = study_folders(root)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        folder = os.path.join(root, name)
        if not os.path.isfile(os.path.join(folder, "eval.json")) or folder in studies:
            continue
        run = found[name] = {"folder": folder,
                             "eval": read_json(os.path.join(folder, "eval.json"))}
        if os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
            run["update_norm"] = lora.update_norm(folder)
        if os.path.isfile(os.path.join(folder, "drift.json")):
            run["drift"] = read_json(os.path.join(folder, "drift.json"))
        if os.path.isfile(os.path.join(folder, "log.jsonl")):
            nll = [r["state_nll_base"] for r in runs.read_log(os.path.join(folder, "log.jsonl"))
                   if r.get("state_nll_base") is not None]
            run["state_nll_base"] = sum(nll) / len(nll) if nll else None
    provenance.check_comparable(measured(found))
    def rank(name):
        c = runs.condition(name)
        return (RUN_ORDER.index(c) if c in RUN_ORDER else len(RUN_ORDER)), name
    return {n: found[n] for n in sorted(found, key=rank)}


def table_rows(found):
    rows = []
    for name, run in found.items():
        e, d = run["eval"], run.get("drift", {})
        ret, nll, reference = (e.get("retention", {}), run.get("state_nll_base"),
                               d.get("state_nll_reference"))
        drawn = e.get("gsm8k_samples", {})  # evaluate.py --samples K: pass@K and the samples' mean
        rows.append(dict(
            run=name, gsm8k=e.get("gsm8k", {}).get("flexible"),
            gsm8k_fewshot=e.get("gsm8k_fewshot", {}).get("flexible"),
            gsm8k_pass=drawn.get(f"pass@{drawn.get('samples')}"), gsm8k_mean=drawn.get("mean"),
            truthfulqa=e.get("truthfulqa", {}).get("mc1"), mmlu=e.get("mmlu", {}).get("acc"),
            mmd2=d.get("mmd2"), mmd=None if d.get("mmd2") is None else max(d["mmd2"], 0.0) ** 0.5,
            forgetting=ret.get("forgetting"), forgetting_stderr=ret.get("forgetting_stderr"),
            retention=ret.get("retention"), update_norm=run.get("update_norm"),
            state_distance=None if nll is None or reference is None else nll - reference,
            kl_to_base=d.get("kl_to_base")))
    return rows


METRICS = ("gsm8k", "gsm8k_fewshot", "gsm8k_pass", "gsm8k_mean", "truthfulqa", "mmlu", "mmd2",
           "mmd", "forgetting", "forgetting_stderr", "retention", "state_distance", "kl_to_base",
           "update_norm")


def group_seeds(rows):
    """Rows of runs repeated over seeds (name-seed<s>) merged into one row per condition:
    each metric's mean, its standard deviation over seeds in <metric>_std (None with fewer
    than two values) and the number of seeds that have it in <metric>_n."""
    groups = {}
    for r in rows:
        groups.setdefault(runs.condition(r["run"]), []).append(r)
    out = []
    for name, members in groups.items():
        row = dict(run=name, seeds=len(members))
        for k in METRICS:
            row[k], row[k + "_std"] = mean_sd([r[k] for r in members])
            row[k + "_n"] = sum(r[k] is not None for r in members)
        out.append(row)
    return out


def mean_sd(values):
    """(mean, standard deviation) of the values that are not None: None where there are none,
    the deviation None with fewer than two."""
    values = [v for v in values if v is not None]
    return (statistics.mean(values) if values else None,
            statistics.stdev(values) if len(values) > 1 else None)


def ranks(values):
    """1-based ranks, ties sharing the mean of the ranks they span."""
    ordered = sorted(values)  # v's ties span ranks first + 1 .. first + count
    return [ordered.index(v) + (ordered.count(v) + 1) / 2 for v in values]


def permutation_p(x, y, rounds=10_000, seed=0):
    """Two-sided p-value of the correlation of x and y under the hypothesis that they are
    unrelated: the share of pairings of y's values with x whose correlation is at least as
    far from zero as the observed one. Every pairing up to eight rows (40,320), else the
    observed one and `rounds` random ones. With five rows, as in the paper's Table 2, no
    p-value falls below 2/120 = 0.017, and only a perfect rank order reaches it."""
    # float sums of a permuted order may differ in the last bit
    observed = abs(statistics.correlation(x, y)) * (1 - 1e-9)
    if len(y) <= 8:
        pairings = list(itertools.permutations(y))
    else:
        rng = random.Random(seed)
        pairings = [y] + [rng.sample(y, len(y)) for _ in range(rounds)]
    return sum(abs(statistics.correlation(x, p)) >= observed for p in pairings) / len(pairings)


def drift_vs_forgetting(rows, measure="mmd2"):
    """The paper's P4 as two numbers: Spearman's rank correlation and Pearson's correlation
    between a drift measure (MMD^2 of the states, or the adapter's update_norm in weight
    space) and forgetting over the rows that have both (the base has neither), each with
    its permutation p-value. None for fewer than three such rows or a column without spread."""
    pairs = [(r[measure], r["forgetting"]) for r in rows
             if r.get(measure) is not None and r.get("forgetting") is not None]
    drift, forgetting = [p[0] for p in pairs], [p[1] for p in pairs]
    if len(pairs) < 3 or len(set(drift)) < 2 or len(set(forgetting)) < 2:
        return None
    drift_ranks, forgetting_ranks = ranks(drift), ranks(forgetting)
    return dict(n=len(pairs), spearman=statistics.correlation(drift_ranks, forgetting_ranks),
                spearman_p=permutation_p(drift_ranks, forgetting_ranks),
                pearson=statistics.correlation(drift, forgetting),
                pearson_p=permutation_p(drift, forgetting))


def drift_forgetting_correlations(single_rows, measure="mmd2"):
    """drift_vs_forgetting over the conditions (seeds merged, group_seeds) and over the
    single runs, each seed apart: what results.md prints under its table and results.json keeps."""
    return dict(conditions=drift_vs_forgetting(group_seeds(single_rows), measure),
                runs=drift_vs_forgetting(single_rows, measure))


def fmt(x, spec=".3f", std=None):
    if x is None:
        return "-"
    return f"{x:{spec}}" + (f"±{std:{spec}}" if std is not None else "")


def p_value(p):
    return f"{p:.2f}" if p >= 0.01 else f"{p:.1g}"  # two decimals, but below 0.01, where 0


def p_values(correlations):
    spearman, pearson = (p_value(correlations[k]) for k in ("spearman_p", "pearson_p"))
    return f"p-values {spearman} and {pearson}"


def table_columns(rows, K):
    """results.md's columns, (key, header, format, how the cell reads): "paper" ours / the
    paper's, "spread" ours with the spread over seeds, "mean" ours alone (a standard error's
    spread over seeds says little). MMD^2 in significant digits: a small model's drift can be
    1e-5 where the paper's is 1e-2. K: the samples of evaluate.py --samples, 0 for none."""
    cols = [("gsm8k", "GSM8K 0-shot", ".3f", "paper")]
    if any(r["gsm8k_fewshot"] is not None for r in rows):
        cols.append(("gsm8k_fewshot", "GSM8K few-shot", ".3f", "spread"))
    if K:
        cols += [("gsm8k_pass", f"pass@{K}", ".3f", "spread"),
                 ("gsm8k_mean", "sampled", ".3f", "spread")]
    return cols + [
        ("truthfulqa", "TruthfulQA", ".3f", "paper"), ("mmlu", "MMLU", ".3f", "paper"),
        ("mmd2", "MMD^2", ".4g", "spread"), ("mmd", "MMD", ".4g", "paper"),
        ("forgetting", "forgetting", ".4f", "paper"),
        ("forgetting_stderr", "forgetting s.e.", ".4f", "mean"),
        ("retention", "retention", ".4f", "paper"),
        ("state_distance", "state distance", ".3f", "spread"),
        ("kl_to_base", "KL to base", ".3g", "spread"),
        ("update_norm", "update norm", ".2f", "spread")]


def column_notes(fewshot, K, with_paper):
    """results.md's first line: what each column is."""
    return (
        ("Each cell: ours / the paper's Table 2 (Nie 2026). " if with_paper else "")
        + "GSM8K flexible accuracy, greedy, 0-shot in the format the methods train on"
        + (" (few-shot: lm-evaluation-harness's 5 solved examples first)" if fewshot else "")
        + (f"; pass@{K} and sampled: of {K} temperature-1 samples a question, the chance that "
           f"one of {K} is right (Chen et al. 2021's estimator) and their mean accuracy" if K
           else "")
        + "; TruthfulQA MC1; MMLU accuracy; MMD^2 of rollout states against the base and MMD = "
        "sqrt(max(MMD^2, 0))" + (" (Table 2's column is headed MMD)" if with_paper else "")
        + "; forgetting and retention averaged over TruthfulQA and MMLU. forgetting s.e.: the "
        "standard error of a run's forgetting from the finite number of questions, over each "
        "question's difference from the base's answer to it (ours alone). state distance: where "
        "the states each run trained on lie, the base's per-token NLL of the tokens its loss is "
        "computed on (state_nll_base, the mean over steps) less that of its own temperature-1 "
        "samples (0: the base's own states). KL to base: KL(base || run) at the states of the "
        "base's own rollouts on target prompts, summed over each rollout (RL's Razor's "
        "predictor). update norm: how far training moved the weights, the Frobenius norm of the "
        "adapter's update over all the layers it adapts (lora.update_norm).")


def results_markdown(found):
    """results.md: one row per condition (seeds merged), each cell ours / the paper's Table 2,
    and the drift-forgetting correlations under it. Rows none of which is a paper condition
    (a run's snapshots, a study of one's own) get our numbers alone."""
    single_rows = table_rows(found)
    rows = group_seeds(single_rows)
    K = next((r["eval"]["gsm8k_samples"]["samples"] for r in found.values()
              if "gsm8k_samples" in r["eval"]), 0)
    cols = table_columns(rows, K)
    with_paper = any(row["run"] in PAPER for row in rows)
    fewshot = any(c[0] == "gsm8k_fewshot" for c in cols)
    lines = [column_notes(fewshot, K, with_paper), "",
             "| run | " + " | ".join(c[1] for c in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    seeds = any(r["seeds"] > 1 for r in rows)
    if seeds:
        lines[0] += (f" Ours: mean±std over {max(r['seeds'] for r in rows)} seeds (the base model "
                     f"is evaluated once; forgetting s.e.: the mean over seeds).")
    for row in rows:
        paper = PAPER.get(row["run"], {})
        cells = [fmt(row[k], d, None if reads == "mean" else row[k + "_std"])
                 + (f" / {fmt(paper.get(k), d)}" if with_paper and reads == "paper" else "")
                 for k, _, d, reads in cols]
        lines.append(f"| {row['run']} | " + " | ".join(cells) + " |")
    over = "post-trained conditions" if with_paper else "rows"
    mmd2 = drift_forgetting_correlations(single_rows)
    lines += reference_lines(found) + correlation_lines(single_rows, mmd2, over, with_paper, seeds)
    questions = found.get("base", {}).get("eval", {}).get("gsm8k", {})
    if questions.get("n"):  # the rules' readings, where the paper's conditions have seeds
        lines += readings.readings_lines(rows, {"mmd2": mmd2}, questions["n"])
    return "\n".join(lines) + "\n"


def reference_lines(found):
    """What the state distance column measures, with the reference it is read against."""
    d = next((run["drift"] for run in found.values()
              if "state_nll_reference" in run.get("drift", {})), None)
    if d is None:
        return []
    return ["", f"Where the states lie for the base (state distance): its per-token NLL of the "
                f"tokens a run's loss is computed on (SFT's gold answers or samples, RL's and "
                f"OPD's rollouts, OPD's teacher continuations), the mean over training, less "
                f"that of its own temperature-1 samples, {d['state_nll_reference']:.3f}; SFT's "
                f"is how far off-policy its data is for the base (C1)."]


def cells(c):
    """A predictor's cells: rows, Spearman's rho and its p-value, R^2 and its p-value."""
    if c is None:
        return "- | - | - | - | -"
    return (f"{c['n']} | {c['spearman']:.2f} | {p_value(c['spearman_p'])} | "
            f"{c['pearson'] ** 2:.2f} | {p_value(c['pearson_p'])}")


def correlation_lines(single_rows, correlations, over, with_paper, seeds):
    """What results.md says under its table: MMD^2 against forgetting (P4) beside the paper's
    Table 2, then every candidate predictor (PREDICTORS), which the paper does not compare;
    over the conditions, and over the single runs where there are seeds; correlations: MMD^2's
    (drift_forgetting_correlations)."""
    lines = []
    ours, single = correlations["conditions"], correlations["runs"]
    if ours:  # P4: does drift explain forgetting?
        lines += ["", f"MMD^2 against forgetting (P4) over the {ours['n']} {over}: Spearman's "
                      f"rank correlation {ours['spearman']:.2f}, Pearson's {ours['pearson']:.2f} "
                      f"(two-sided permutation {p_values(ours)}"]
        if with_paper:
            table2 = [dict(run=name, **values) for name, values in PAPER.items()]
            paper = drift_vs_forgetting(table2, "mmd")
            lines[-1] += (f"; the paper's Table 2, {paper['n']} runs: {paper['spearman']:.2f} and "
                          f"{paper['pearson']:.2f}, {p_values(paper)}")
        lines[-1] += ")."
        if seeds and single:
            lines[-1] += (f" Over the {single['n']} single runs, each seed apart: "
                          f"{single['spearman']:.2f} and {single['pearson']:.2f} "
                          f"({p_values(single)}).")
    predictors = [(label, drift_forgetting_correlations(single_rows, key))
                  for key, label in PREDICTORS]
    predictors = [(label, c) for label, c in predictors if c["conditions"]]
    if predictors:  # P4's question asked of every candidate, the paper's own (MMD^2) among them
        both = seeds and any(c["runs"] for _, c in predictors)
        header = ("| predictor | n | Spearman | p | R^2 | p |"
                  + (" runs | Spearman | p | R^2 | p |" if both else ""))
        lines += ["", f"What predicts forgetting, over the {over}"
                  + (" and over the single runs, each seed apart" if both else "")
                  + ": Spearman's rank correlation and R^2 of a straight-line fit, each with its "
                  "two-sided permutation p-value.", "", header,
                  "|---" * (header.count("|") - 1) + "|"]
        lines += [f"| {label} | {cells(c['conditions'])} |"
                  + (f" {cells(c['runs'])} |" if both else "") for label, c in predictors]
    return lines


def write_results(root, **extra):
    """Print and write root/results.md, results.json (the rows, the correlations, the paper's
    numbers and extra, e.g. reproduce.py's preset and timings) and results.png; the studies
    in folders under root are named, not mixed in. Returns results.md's text."""
    found, nested = collect_runs(root), study_folders(root)
    if not found:
        where = f"; the studies under it: {', '.join(nested)} (pass one of them)" if nested else ""
        raise InputError(f"no eval.json in {root} or its run folders{where}; run `python "
                         f"evaluate.py base ...` first")
    text, rows = results_markdown(found), table_rows(found)
    write_atomic(os.path.join(root, "results.md"), lambda p: open(p, "w").write(text))
    predictors = {key: drift_forgetting_correlations(rows, key) for key, _ in PREDICTORS}
    write_json(os.path.join(root, "results.json"),
                 dict(rows=rows, predictors=predictors, paper=PAPER, **extra))
    figures.plot(root, rows)
    figures.curves([run["folder"] for name, run in found.items() if name != "base"],
                   os.path.join(root, "curves.png"))
    for folder in nested:
        print(f"note: {folder} holds a study of its own, left out of this table: python "
              f"results.py {folder}")
    return text
