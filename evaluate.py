"""
Evaluation: GSM8K accuracy (target task), MMLU and TruthfulQA multiple choice (retention),
forgetting and retention ratio against the base model (the paper's eq. 12), and the
results table in the layout of the paper's Table 2.

    python evaluate.py base out/mild out/stress          # base model and two run folders
    python evaluate.py --table out                      # print and write out/results.md

Conventions follow lm-evaluation-harness: GSM8K 'Question:/Answer:' prompts, greedy, strict
('#### N') and flexible (last number) extraction, scored 0-shot (the format RL, OPD and drift
prompt with, and the table's column) and 5-shot (lm-eval's); MMLU 5-shot with the subject
header, the prediction is the letter whose ' A'..' D' continuation is most likely;
TruthfulQA MC1/MC2 with the six-question QA primer and summed log-likelihoods. Every score
comes with its standard error over the questions as lm-evaluation-harness gives it, and
forgetting with one that pairs each question with the base model's answer to it.
"""
import argparse
import itertools
import json
import math
import os
import random
import re
import statistics

import torch
from tqdm import tqdm

import data
import drift
import lora
import model as M
import runs
from sample import generate, left_pad

TASKS = ("gsm8k", "mmlu", "truthfulqa")
RETENTION_TASKS = ("truthfulqa", "mmlu")  # the paper averages forgetting over TruthfulQA MC1 and MMLU
# Table 2 of the paper (Nie 2026, arXiv 2605.22731), keyed by our run folder names
PAPER = {
    "base": dict(gsm8k=0.448, truthfulqa=0.300, mmlu=0.436),
    "mild": dict(gsm8k=0.512, truthfulqa=0.295, mmlu=0.444, mmd=0.00956, forgetting=-0.0015, retention=1.0008),
    "stress": dict(gsm8k=0.420, truthfulqa=0.245, mmlu=0.364, mmd=0.01093, forgetting=0.0635, retention=0.8258),
    "opd-mild": dict(gsm8k=0.512, truthfulqa=0.290, mmlu=0.434, mmd=0.01470, forgetting=0.0060, retention=0.9810),
    "opd-stress": dict(gsm8k=0.466, truthfulqa=0.275, mmlu=0.430, mmd=0.01092, forgetting=0.0155, retention=0.9515),
    "opd-logits": dict(gsm8k=0.040),
    "rl": dict(gsm8k=0.472, truthfulqa=0.290, mmlu=0.442, mmd=0.01098, forgetting=0.0020, retention=0.9902),
}
# the table's row order: the paper's, with kd-stress (not in the paper) beside the run it contrasts
RUN_ORDER = ["base", "mild", "stress", "opd-mild", "opd-stress", "kd-stress", "opd-logits", "rl"]


# -----------------------------------------------------------------------------
# scoring

@torch.no_grad()
def score_choices(model, tok, contexts, choices, batch_size=8, desc="scoring"):
    """Summed log-likelihood of every continuation in choices[i] after contexts[i], tokenised
    as lm-evaluation-harness does (a continuation's tokens are those of the whole string
    after the context's). Each context runs once and its KV cache is copied to its choices,
    so a 5-shot prompt is not computed again for every option, and what a batch's contexts
    share at their start runs once for all of them; where every continuation of a batch is
    one token (MMLU's ' A'..' D'), the context's last state alone scores them. Returns a
    list of lists of floats."""
    device = model.lm_head.weight.device
    ctx_ids = tok.encode_batch(contexts)
    cont_ids = [[whole[len(c):] for whole in tok.encode_batch([ctx + o for o in opts])]
                for ctx, c, opts in zip(contexts, ctx_ids, choices)]
    order = sorted(range(len(contexts)), key=lambda i: -len(ctx_ids[i]))  # like lengths share a batch: less padding
    batches, scores = [order[start:start + batch_size] for start in range(0, len(order), batch_size)], []
    for batch in tqdm(batches[slice(*runs.split(len(batches)))], desc=desc, leave=False):  # torchrun: a share
        conts = [c for i in batch for c in cont_ids[i]]
        owner = torch.tensor([q for q, i in enumerate(batch) for _ in cont_ids[i]], device=device)
        # what the batch's contexts share at their start (TruthfulQA's primer) runs once, one row
        # copied to every context's; the rest of each runs after it, left-padded
        shared = min(runs.common_length(ctx_ids[batch[0]], ctx_ids[i]) for i in batch)
        shared = min([shared] + [len(ctx_ids[i]) - 1 for i in batch]) if shared >= runs.SHARED_MIN else 0
        ids, mask = left_pad([ctx_ids[i][shared:] for i in batch], tok.pad_id, device)
        L = max(map(len, conts))
        cache = model.new_cache(1 if shared else len(batch), shared + ids.shape[1] + L) if L > 1 or shared else None
        if shared:
            model(torch.tensor([ctx_ids[batch[0]][:shared]], device=device), cache=cache)
            cache.select_rows(torch.zeros(len(batch), dtype=torch.long, device=device))
            mask = torch.cat([mask.new_ones(len(batch), shared), mask], 1)
        last = model(ids, attention_mask=mask, cache=cache, hidden_only=True)[:, -1]  # (B, hidden)
        if L == 1:  # MMLU's ' A'..' D': the last state scores them
            sums = model.token_logprobs(last[owner], torch.tensor([c[0] for c in conts], device=device)).tolist()
        else:
            cache.select_rows(owner)  # each context's keys and values copied to its choices' rows
            c_ids = torch.tensor([c + [tok.pad_id] * (L - len(c)) for c in conts], device=device)
            c_mask = torch.tensor([[1] * len(c) + [0] * (L - len(c)) for c in conts], device=device)
            hidden = model(c_ids, attention_mask=torch.cat([mask[owner], c_mask], 1), cache=cache, hidden_only=True)
            states = torch.cat([last[owner][:, None], hidden[:, :-1]], 1)  # the state before each continuation token
            keep = c_mask.bool()  # right padding: after every real token, never read by one
            logp = model.token_logprobs(states[keep], c_ids[keep])
            rows = torch.arange(len(conts), device=device)[:, None].expand_as(keep)[keep]
            sums = torch.zeros(len(conts), device=device).index_add_(0, rows, logp).tolist()
        scores.append(sums)
    results = [None] * len(contexts)
    for batch, sums in zip(batches, runs.joined(scores)):
        for i in batch:
            results[i], sums = sums[:len(cont_ids[i])], sums[len(cont_ids[i]):]
    return results


def eval_gsm8k(model, tok, args, shots):
    """Greedy GSM8K accuracy with `shots` solved train examples before each question: 0 is the
    format RL, OPD and drift prompt with (the states the methods train on), 5 lm-eval's."""
    test, train = data.load_gsm8k("test", args.data_dir), data.load_gsm8k("train", args.data_dir)
    rows = test[:args.gsm8k_limit] if args.gsm8k_limit > 0 else test
    if shots > len(train):  # slicing would give fewer shots than asked, silently
        raise M.InputError(f"--gsm8k-fewshot {shots}: the train split holds {len(train)} examples; pass "
                           f"--gsm8k-fewshot {len(train)} or fewer (lm-evaluation-harness uses 5)")
    prompts = [data.gsm8k_prompt(r["question"], train[:shots]) for r in rows]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # like lengths share a batch
    batches = [order[start:start + args.batch_size] for start in range(0, len(order), args.batch_size)]
    texts = []
    for batch in tqdm(batches[slice(*runs.split(len(batches)))], desc=f"gsm8k {shots}-shot", leave=False):
        outs = generate(model, tok, [prompts[i] for i in batch], max_new_tokens=args.max_new_tokens,
                        temperature=0, stop=data.GSM8K_STOP)
        texts.append([r.text for r in outs])
    completions = [None] * len(prompts)
    for batch, outs in zip(batches, runs.joined(texts)):  # under torchrun, every process's batches
        for i, text in zip(batch, outs):
            completions[i] = text
    samples = []
    for i, (row, text) in enumerate(zip(rows, completions)):
        strict, flexible = data.extract_answer(text, "strict"), data.extract_answer(text, "flexible")
        samples.append(dict(task=gsm8k_key(shots), index=i, prompt=prompts[i], completion=text, gold=row["gold"],
                            strict=strict, flexible=flexible, correct=data.same_number(flexible, row["gold"]),
                            strict_correct=data.same_number(strict, row["gold"])))
    return dict(**mean_and_stderr("flexible", [s["correct"] for s in samples]),
                **mean_and_stderr("strict", [s["strict_correct"] for s in samples]),
                n=len(samples), shots=shots), samples


def gsm8k_key(shots):
    """eval.json's key of a GSM8K score: gsm8k for the 0-shot one, gsm8k_fewshot for the other."""
    return "gsm8k" if shots == 0 else "gsm8k_fewshot"


def eval_mmlu(model, tok, args):
    dev, test = data.load_mmlu("dev", args.data_dir), data.load_mmlu("test", args.data_dir)
    rows = data.mmlu_subset(test, args.mmlu_limit, seed=args.seed)
    fewest, subject = min((len(dev.get(r["subject"], [])), r["subject"]) for r in rows)
    if args.mmlu_shots > fewest:  # slicing would give that subject fewer shots than asked, silently
        raise M.InputError(f"--mmlu-shots {args.mmlu_shots}: the dev split holds {fewest} examples of {subject}; "
                           f"pass --mmlu-shots {fewest} or fewer")
    prompts = [data.mmlu_prompt(r, dev.get(r["subject"], [])[:args.mmlu_shots]) for r in rows]
    lls = score_choices(model, tok, prompts, [data.mmlu_continuations(r, args.mmlu_scoring) for r in rows],
                        args.batch_size, desc="mmlu")
    samples = []
    for i, (row, ll) in enumerate(zip(rows, lls)):
        pred = max(range(4), key=lambda c: ll[c])
        samples.append(dict(task="mmlu", index=i, subject=row["subject"], prompt=prompts[i], loglikelihoods=ll,
                            prediction=pred, answer=row["answer"], correct=pred == row["answer"]))
    return dict(**mean_and_stderr("acc", [s["correct"] for s in samples]), n=len(samples),
                scoring=args.mmlu_scoring), samples


def mc2_score(lls, labels):
    """Normalised probability mass on the true answers (TruthfulQA MC2). The largest
    log-likelihood is taken out before exp, which the ratio does not see: a long answer's
    summed log-likelihood below -745 would otherwise underflow to 0, and all of them 0/0."""
    top = max(lls)
    p = [math.exp(x - top) for x in lls]
    return sum(pi for pi, lab in zip(p, labels) if lab) / sum(p)


def eval_truthfulqa(model, tok, args):
    rows = data.load_truthfulqa(args.data_dir)
    rows = rows[:args.truthfulqa_limit] if args.truthfulqa_limit > 0 else rows
    prompts = [data.truthfulqa_prompt(r) for r in rows]
    mc1 = score_choices(model, tok, prompts, [[f" {c}" for c in r["mc1_targets"]] for r in rows], args.batch_size, "tqa mc1")
    mc2 = score_choices(model, tok, prompts, [[f" {c}" for c in r["mc2_targets"]] for r in rows], args.batch_size, "tqa mc2")
    samples = []
    for i, row in enumerate(rows):
        labels1, labels2 = list(row["mc1_targets"].values()), list(row["mc2_targets"].values())
        pred = max(range(len(labels1)), key=lambda c: mc1[i][c])
        samples.append(dict(task="truthfulqa", index=i, prompt=prompts[i], mc1_loglikelihoods=mc1[i],
                            mc2_loglikelihoods=mc2[i], prediction=pred, correct=bool(labels1[pred]),
                            mc2=mc2_score(mc2[i], labels2)))
    return dict(**mean_and_stderr("mc1", [s["correct"] for s in samples]),
                **mean_and_stderr("mc2", [s["mc2"] for s in samples]), n=len(samples)), samples


# -----------------------------------------------------------------------------
# retention and tables

def standard_error(values):
    """The standard error of a mean over questions as lm-evaluation-harness reports it, the
    sample standard deviation over sqrt(n): how far the mean could move on another draw of
    as many questions."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def mean_and_stderr(name, values):
    return {name: sum(values) / len(values), name + "_stderr": standard_error(values)}


# which flags decide the questions and prompts of a retention task: forgetting compares a
# run with the base on the very same ones
SAME_QUESTIONS = {"mmlu": ("mmlu_limit", "mmlu_shots", "mmlu_scoring", "seed"), "truthfulqa": ("truthfulqa_limit",)}


# and the flags that decide a table column's questions, prompts or rollouts: numbers in
# one column are comparable only when these agree (check_comparable)
SAME_COLUMN = {"gsm8k": ("gsm8k_limit", "max_new_tokens"), "gsm8k_fewshot": ("gsm8k_limit", "gsm8k_fewshot",
                                                                              "max_new_tokens"), **SAME_QUESTIONS}


def deciding_flags(task, settings):
    """The flags of SAME_COLUMN[task] that decide its questions under settings (an
    eval.json's): with --mmlu-limit 0 every MMLU question is asked, whichever the seed."""
    return [flag for flag in SAME_COLUMN[task] if not (flag == "seed" and settings.get("mmlu_limit") == 0)]


def check_comparable(found):
    """Stop when two rows of one table column were measured on other questions (evaluate.py's
    flags) or other rollouts and features (drift.py's): a difference between them would
    be the flags', not the training's. found: the runs as collect_runs gathers them."""
    first = {}

    def same(name, column, flag, value, fix):
        seen_name, seen_value = first.setdefault((column, flag), (name, value))
        if value != seen_value:
            raise M.InputError(f"{name}'s {column} was measured with --{flag.replace('_', '-')} {value}, {seen_name}'s "
                               f"with {seen_value}; {fix} both with the same flags to put them in one table")

    for name, run in found.items():
        settings = run["eval"].get("settings", {})
        for task in SAME_COLUMN:
            for flag in deciding_flags(task, settings) if task in run["eval"] else ():
                if flag in settings:
                    same(name, task, flag, settings[flag], "evaluate")
        result = run.get("drift", {})
        for flag in drift.SAME_COLUMN if result else ():
            value = drift.setting(result, flag)
            if value is not None:
                same(name, "drift", flag, value, "measure")


def check_same_questions(base_result, args, base_path):
    settings = base_result.get("settings", {})
    if "model" in settings and runs.same_model(settings["model"], args.model) is False:
        raise M.InputError(f"{base_path} is the evaluation of base {settings['model']}, but --model is {args.model}; "
                           f"forgetting compares a run with its own base: pass --model {settings['model']}, or another "
                           f"--out for this base")
    for task in SAME_QUESTIONS:
        if task not in base_result or task not in args.tasks.split(","):
            continue
        for flag in deciding_flags(task, settings):
            if flag in settings and settings[flag] != getattr(args, flag):
                option = "--" + flag.replace("_", "-")
                raise M.InputError(f"{base_path} scored {task} with {option} {settings[flag]}, this evaluation with "
                                   f"{getattr(args, flag)}; forgetting compares the same questions: pass {option} "
                                   f"{settings[flag]}, or evaluate 'base' again first")


def read_samples(folder):
    path = os.path.join(folder, "eval_samples.jsonl")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return [json.loads(line) for line in f]


def paired_stderr(base_samples, post_samples, base_folder):
    """The standard error of each retention task's forgetting from its finite questions.
    Base and post answer the same questions, so it is the error of the mean of the
    per-question differences (base right minus post right): smaller than the two scores'
    errors combined, by as much as the two models get the same questions right."""
    out = {}
    for task in RETENTION_TASKS:
        base = {s["index"]: s for s in base_samples or [] if s["task"] == task}
        post = {s["index"]: s for s in post_samples if s["task"] == task}
        if not base or not post:
            continue
        if base.keys() != post.keys() or any(base[i]["prompt"] != post[i]["prompt"] for i in post):
            raise M.InputError(f"the base's answers in {base_folder} are to other {task} questions than this "
                               f"evaluation's; evaluate 'base' again with this evaluation's --data-dir and flags")
        out[task] = standard_error([int(base[i]["correct"]) - int(post[i]["correct"]) for i in sorted(post)])
    return out


def retention_scores(result):
    """The two retention numbers the paper averages: TruthfulQA MC1 and MMLU accuracy."""
    out = {}
    if "truthfulqa" in result:
        out["truthfulqa"] = result["truthfulqa"]["mc1"]
    if "mmlu" in result:
        out["mmlu"] = result["mmlu"]["acc"]
    return out


def retention(base, post, stderr=None):
    """Forgetting F = base - post and retention ratio post / base per task (eq. 12), and
    their means over the tasks both have; given each task's forgetting's standard error
    (paired_stderr) also the mean's."""
    tasks = [t for t in RETENTION_TASKS if t in base and t in post]
    # a base score of zero has no ratio: None (JSON null) rather than a NaN
    per = {t: dict(forgetting=base[t] - post[t], retention=post[t] / base[t] if base[t] else None) for t in tasks}
    out = dict(per_task=per, base={t: base[t] for t in tasks})  # what it was measured against (collect_runs)
    if tasks:
        out["forgetting"] = sum(per[t]["forgetting"] for t in tasks) / len(tasks)
        ratios = [per[t]["retention"] for t in tasks]
        out["retention"] = None if None in ratios else sum(ratios) / len(ratios)
    errors = [(stderr or {}).get(t) for t in tasks]
    for t, e in zip(tasks, errors):
        per[t]["forgetting_stderr"] = e
    if tasks and None not in errors:
        # the tasks' questions are drawn independently, so their errors add in squares
        out["forgetting_stderr"] = math.sqrt(sum(e * e for e in errors)) / len(tasks)
    return out


read_json = M.read_json


def condition(run_name):
    """The condition a run folder belongs to: 'stress-seed2' -> 'stress'."""
    return re.sub(r"-seed\d+$", "", run_name)


def current(folder, args=None):
    """Whether the run folder holds an eval.json of the adapter it holds now (one written
    before evaluations recorded their adapter cannot be told, and counts as that) and,
    given args (evaluate.py's flags), of every task they name, on the questions they ask
    (reproduce.py evaluates again a run evaluated by hand with other flags), and of the
    model args name, if they name one."""
    path = os.path.join(folder, "eval.json")
    if not os.path.isfile(path):
        return False
    result = read_json(path)
    if result.get("adapter_sha256") not in (None, lora.adapter_sha256(folder)):
        return False
    settings = result.get("settings", {})
    if args is not None and getattr(args, "model", None) and "model" in settings:
        if runs.same_model(settings["model"], args.model) is False:  # a study folder used again for another model
            return False
    for key in result_keys(args) if args is not None else ():
        if key not in result or any(settings.get(flag, getattr(args, flag)) != getattr(args, flag)
                                    for flag in SAME_COLUMN[key]):
            return False
    return True


def result_keys(args):
    """The keys of eval.json that evaluate.py's flags ask for."""
    tasks = args.tasks.split(",")
    return [k for t in tasks for k in ([t, "gsm8k_fewshot"] if t == "gsm8k" and args.gsm8k_fewshot else [t])]


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


def collect_runs(root):
    """name -> merged eval.json / drift.json / log summary for the base (root) and each run
    folder. Numbers that do not compare stop the table with the command that fixes them: a
    run trained further (or again) after its evaluation or drift was measured (the old
    adapter's scores would stand beside the new one's update norm and state_nll), a run's
    forgetting measured against other base scores than the base row's, and two rows of
    one column measured with other flags (check_comparable)."""
    found = {}
    if os.path.isfile(os.path.join(root, "eval.json")):
        found["base"] = {"eval": read_json(os.path.join(root, "eval.json"))}
    base_scores = retention_scores(found["base"]["eval"]) if found else {}
    studies = study_folders(root)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        folder = os.path.join(root, name)
        if os.path.isfile(os.path.join(folder, "eval.json")) and folder not in studies:
            found[name] = {"eval": read_json(os.path.join(folder, "eval.json"))}
            # forgetting measured against an earlier evaluation of the base (one of other questions, or another model)
            measured_against = found[name]["eval"].get("retention", {}).get("base", {})
            changed = [t for t, score in measured_against.items() if t in base_scores and base_scores[t] != score]
            if changed:
                t = changed[0]
                raise M.InputError(f"{folder}/eval.json measured forgetting against a base {t} score of "
                                   f"{measured_against[t]}, but {root}/eval.json now holds {base_scores[t]}; "
                                   f"evaluate the run again: python evaluate.py {folder} --out {root} with the base's flags")
            if os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
                if not current(folder):
                    raise M.InputError(f"{folder}/eval.json scored an earlier adapter than the one {folder} holds now "
                                       f"(trained since); evaluate it again: python evaluate.py {folder} with the flags in "
                                       f"its settings")
                found[name]["update_norm"] = lora.update_norm(folder)
            if os.path.isfile(os.path.join(folder, "drift.json")):
                if not drift.current(folder):
                    raise M.InputError(f"{folder}/drift.json measured an earlier adapter than the one {folder} holds "
                                       f"now, or came from an older estimator; measure it again: python drift.py "
                                       f"{folder} with the flags in its settings")
                found[name]["drift"] = read_json(os.path.join(folder, "drift.json"))
            log = os.path.join(folder, "log.jsonl")
            if os.path.isfile(log):
                nll = [r["state_nll"] for r in runs.read_log(log) if r.get("state_nll") is not None]
                found[name]["state_nll"] = sum(nll) / len(nll) if nll else None
    check_comparable(found)
    rank = lambda n: RUN_ORDER.index(condition(n)) if condition(n) in RUN_ORDER else len(RUN_ORDER)
    ordered = sorted(found, key=lambda n: (rank(n), n))
    return {n: found[n] for n in ordered}


def table_rows(found):
    rows = []
    for name, run in found.items():
        e, d = run["eval"], run.get("drift", {})
        ret = e.get("retention", {})
        rows.append(dict(run=name, gsm8k=e.get("gsm8k", {}).get("flexible"),
                         gsm8k_fewshot=e.get("gsm8k_fewshot", {}).get("flexible"),
                         truthfulqa=e.get("truthfulqa", {}).get("mc1"), mmlu=e.get("mmlu", {}).get("acc"),
                         mmd2=d.get("mmd2"), mmd=None if d.get("mmd2") is None else max(d["mmd2"], 0.0) ** 0.5,
                         forgetting=ret.get("forgetting"), forgetting_stderr=ret.get("forgetting_stderr"),
                         retention=ret.get("retention"), state_nll=run.get("state_nll"),
                         update_norm=run.get("update_norm")))
    return rows


METRICS = ("gsm8k", "gsm8k_fewshot", "truthfulqa", "mmlu", "mmd2", "mmd", "forgetting", "forgetting_stderr",
           "retention", "state_nll", "update_norm")


def group_seeds(rows):
    """Rows of runs repeated over seeds (name-seed<s>) merged into one row per condition:
    each metric's mean, and its standard deviation over seeds in <metric>_std."""
    groups = {}
    for r in rows:
        groups.setdefault(condition(r["run"]), []).append(r)
    out = []
    for name, members in groups.items():
        row = dict(run=name, seeds=len(members))
        for k in METRICS:
            values = [r[k] for r in members if r[k] is not None]
            row[k] = statistics.mean(values) if values else None
            row[k + "_std"] = statistics.stdev(values) if len(values) > 1 else None
        out.append(row)
    return out


def ranks(values):
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


def permutation_p(x, y, rounds=10_000, seed=0):
    """Two-sided p-value of the correlation of x and y under the hypothesis that they are
    unrelated: the share of pairings of y's values with x whose correlation is at least as
    far from zero as the observed one. Every pairing up to eight rows (40,320), else the
    observed one and `rounds` random ones. With five rows, as in the paper's Table 2, no
    p-value falls below 2/120 = 0.017, and only a perfect rank order reaches it."""
    observed = abs(statistics.correlation(x, y)) * (1 - 1e-9)  # float sums of a permuted order may differ in the last bit
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
                pearson=statistics.correlation(drift, forgetting), pearson_p=permutation_p(drift, forgetting))


def drift_forgetting_correlations(single_rows, measure="mmd2"):
    """drift_vs_forgetting over the conditions (seeds merged, group_seeds) and over the
    single runs, each seed apart: what results.md prints under its table and results.json keeps."""
    return dict(conditions=drift_vs_forgetting(group_seeds(single_rows), measure),
                runs=drift_vs_forgetting(single_rows, measure))


def fmt(x, spec=".3f", std=None):
    if x is None:
        return "-"
    return f"{x:{spec}}" + (f"±{std:{spec}}" if std is not None else "")


def p_values(correlations):
    # two decimals, except below 0.01, where they would print a p-value of 0
    p = [f"{correlations[k]:.2f}" if correlations[k] >= 0.01 else f"{correlations[k]:.1g}" for k in ("spearman_p", "pearson_p")]
    return f"p-values {p[0]} and {p[1]}"


def results_markdown(found):
    """results.md: one row per condition (seeds merged), each cell ours / the paper's Table 2,
    and the drift-forgetting correlations under it. Rows none of which is a paper condition
    (a run's snapshots, a study of one's own) get our numbers alone."""
    # MMD^2 in significant digits: a small model's drift can be 1e-5 where the paper's is 1e-2
    # (key, header, format, how the cell reads): "paper" ours / the paper's, "spread" ours with
    # the spread over seeds, "mean" ours alone (a standard error's spread over seeds says little)
    single_rows = table_rows(found)
    rows = group_seeds(single_rows)
    fewshot = [("gsm8k_fewshot", "GSM8K few-shot", ".3f", "spread")] if any(
        r["gsm8k_fewshot"] is not None for r in rows) else []
    cols = [("gsm8k", "GSM8K 0-shot", ".3f", "paper"), *fewshot, ("truthfulqa", "TruthfulQA", ".3f", "paper"),
            ("mmlu", "MMLU", ".3f", "paper"), ("mmd2", "MMD^2", ".4g", "spread"), ("mmd", "MMD", ".4g", "paper"),
            ("forgetting", "forgetting", ".4f", "paper"), ("forgetting_stderr", "forgetting s.e.", ".4f", "mean"),
            ("retention", "retention", ".4f", "paper"), ("state_nll", "state_nll", ".3f", "spread"),
            ("update_norm", "update norm", ".2f", "spread")]
    with_paper = any(row["run"] in PAPER for row in rows)
    lines = [("Each cell: ours / the paper's Table 2 (Nie 2026). " if with_paper else "") +
             "GSM8K flexible accuracy, greedy, 0-shot in the format the methods train on" +
             (" (few-shot: lm-evaluation-harness's 5 solved examples first)" if fewshot else "") +
             "; TruthfulQA MC1; MMLU accuracy; MMD^2 of rollout states against the base and MMD = sqrt(max(MMD^2, 0))" +
             (" (Table 2's column is headed MMD)" if with_paper else "") +
             "; forgetting and retention averaged over TruthfulQA and MMLU. "
             "forgetting s.e.: the standard error of a "
             "run's forgetting from the finite number of questions, over each question's difference from the base's "
             "answer to it (ours alone). state_nll: mean NLL of the states each run trained on. update norm: how far "
             "training moved the weights, the Frobenius norm of the adapter's update over all the layers it adapts "
             "(lora.update_norm).", "",
             "| run | " + " | ".join(c[1] for c in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    seeds = any(r["seeds"] > 1 for r in rows)
    if seeds:
        lines[0] += (f" Ours: mean±std over {max(r['seeds'] for r in rows)} seeds (the base model is evaluated once; "
                     f"forgetting s.e.: the mean over seeds).")
    for row in rows:
        paper = PAPER.get(row["run"], {})
        cells = [fmt(row[k], d, None if reads == "mean" else row[k + "_std"]) +
                 (f" / {fmt(paper.get(k), d)}" if with_paper and reads == "paper" else "") for k, _, d, reads in cols]
        lines.append(f"| {row['run']} | " + " | ".join(cells) + " |")
    over = "post-trained conditions" if with_paper else "rows"
    correlations = drift_forgetting_correlations(single_rows)
    ours, single = correlations["conditions"], correlations["runs"]
    if ours:  # P4: does drift explain forgetting?
        lines += ["", f"MMD^2 against forgetting (P4) over the {ours['n']} {over}: Spearman's rank correlation "
                      f"{ours['spearman']:.2f}, Pearson's {ours['pearson']:.2f} (two-sided permutation {p_values(ours)}"]
        if with_paper:
            paper = drift_vs_forgetting([dict(run=name, **values) for name, values in PAPER.items()], "mmd")
            lines[-1] += (f"; the paper's Table 2, {paper['n']} runs: {paper['spearman']:.2f} and {paper['pearson']:.2f}, "
                          f"{p_values(paper)}")
        lines[-1] += ")."
        if seeds and single:
            lines[-1] += (f" Over the {single['n']} single runs, each seed apart: {single['spearman']:.2f} and "
                          f"{single['pearson']:.2f} ({p_values(single)}).")
    correlations = drift_forgetting_correlations(single_rows, "update_norm")
    ours, single = correlations["conditions"], correlations["runs"]
    if ours:  # the same question in weight space, which the paper does not ask
        lines += ["", f"The update norm against forgetting over the {ours['n']} {over}: Spearman's "
                      f"{ours['spearman']:.2f}, Pearson's {ours['pearson']:.2f} ({p_values(ours)})."]
        if seeds and single:
            lines[-1] += (f" Over the {single['n']} single runs: {single['spearman']:.2f} and "
                          f"{single['pearson']:.2f} ({p_values(single)}).")
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------
# command line

def task_list(text):
    """An argparse type: comma-separated names from TASKS, checked before anything runs
    (rather than after hours of the tasks named before a misspelt one); a task named
    twice runs once."""
    unknown = [t for t in text.split(",") if t not in TASKS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown task {unknown[0]!r} in {text!r}; name tasks from {','.join(TASKS)}, "
                                         f"separated by commas")
    return ",".join(dict.fromkeys(text.split(",")))


def add_eval_args(p):
    p.add_argument("--tasks", type=task_list, default="gsm8k,mmlu,truthfulqa",
                   help="comma-separated subset of gsm8k,mmlu,truthfulqa")
    p.add_argument("--gsm8k-limit", type=runs.number(int, 0), default=500,
                   help="first N GSM8K test questions (0 = all 1,319)")
    p.add_argument("--gsm8k-fewshot", type=runs.number(int, 0), default=5,
                   help="also score GSM8K with this many solved train examples before each question, as "
                        "lm-evaluation-harness does (0 = only the 0-shot score, the format the methods train on)")
    p.add_argument("--max-new-tokens", type=runs.number(int, 1), default=256, help="GSM8K generation budget")
    p.add_argument("--mmlu-limit", type=runs.number(int, 0), default=500,
                   help="MMLU test questions, stratified over subjects (0 = all 14,042)")
    p.add_argument("--mmlu-shots", type=runs.number(int, 0), default=5, help="dev examples per subject")
    p.add_argument("--mmlu-scoring", choices=["letter", "text"], default="letter",
                   help="score ' A'..' D' (lm-eval mmlu) or each choice's own text (lm-eval continuation variant)")
    p.add_argument("--truthfulqa-limit", type=runs.number(int, 0), default=0,
                   help="first N TruthfulQA questions (0 = all 817)")
    p.add_argument("--batch-size", type=runs.number(int, 1), default=16, help="prompts per batch")
    p.add_argument("--seed", type=int, default=1234, help="seed of the MMLU subset")


def evaluate(model, tok, args):
    """Run the selected tasks on whatever adapter is active; returns (results, samples)."""
    results, samples = {}, []
    for task in args.tasks.split(","):
        if task == "gsm8k":
            for shots in [0] + [args.gsm8k_fewshot] * (args.gsm8k_fewshot > 0):
                results[gsm8k_key(shots)], part = eval_gsm8k(model, tok, args, shots)
                samples += part
        else:
            results[task], part = {"mmlu": eval_mmlu, "truthfulqa": eval_truthfulqa}[task](model, tok, args)
            samples += part
    return results, samples


def write_eval(folder, results, samples):
    os.makedirs(folder, exist_ok=True)
    M.write_json(os.path.join(folder, "eval.json"), results)
    M.write_atomic(os.path.join(folder, "eval_samples.jsonl"),
                   lambda p: open(p, "w").write("".join(json.dumps(s) + "\n" for s in samples)))


def write_table(root):
    """Print and write root/results.md; the studies in folders under root are named, not mixed in."""
    found, nested = collect_runs(root), study_folders(root)
    if not found:
        where = f"; the studies under it: {', '.join(nested)} (pass one of them)" if nested else ""
        raise M.InputError(f"no eval.json in {root} or its run folders{where}; run `python evaluate.py base ...` first")
    text = results_markdown(found)
    M.write_atomic(os.path.join(root, "results.md"), lambda p: open(p, "w").write(text))
    for folder in nested:
        print(f"note: {folder} holds a study of its own, left out of this table: python evaluate.py --table {folder}")
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="'base' and/or run folders (base model + that run's adapter)")
    runs.add_model_args(p)
    p.add_argument("--out", default=None, help="the study folder, where the base model's eval.json is (default: the "
                                               "folder holding the first run folder given, else out)")
    p.add_argument("--table", metavar="ROOT", default=None, help="only print and write ROOT/results.md")
    add_eval_args(p)
    args = p.parse_args(argv)
    if args.table:
        print(write_table(args.table))
        return
    if not args.runs:
        p.error("name 'base' and/or run folders to evaluate, or use --table ROOT")
    args.runs = list(dict.fromkeys(args.runs))  # a run named twice (overlapping globs) is evaluated once
    folders = [run for run in args.runs if run != "base"]
    args.out = args.out or (os.path.dirname(os.path.normpath(folders[0])) or "." if folders else "out")
    runs.model_and_data_from(args, *folders)
    for run in folders:
        runs.check_run_folder(run, args.model, also=", or 'base'")
    if "base" in args.runs and os.path.isfile(os.path.join(args.out, "adapter_config.json")):
        raise M.InputError(f"--out {args.out} is a run folder: the base's eval.json would replace the run's; pass the "
                           f"folder that holds the runs (out, say)")
    base_path = os.path.join(args.out, "eval.json")
    if args.runs[0] != "base" and os.path.isfile(base_path):  # else the base is evaluated anew, with these flags
        check_same_questions(read_json(base_path), args, base_path)
    print(vars(args))
    if "base" not in args.runs and not os.path.isfile(base_path):
        print(f"note: no base evaluation in {args.out} ({base_path}), so no forgetting or retention for these runs; "
              f"evaluate 'base' there first, or pass the --out that holds it")
    device, dtype = runs.device_from_args(args)
    # held while evaluated: a second evaluation would mix its eval.json with this one's samples,
    # and a run resumed meanwhile would leave these scores of an adapter it no longer holds
    with runs.holding(*[args.out if run == "base" else run for run in args.runs], instead=""):
        model, tok = M.load(args.model, device, dtype)
        for run in args.runs:
            if run == "base":
                lora.set_adapter(model, None)
                folder = args.out
            else:
                name = f"run{args.runs.index(run)}"
                lora.load_adapter(model, run, name=name)
                folder = run
            results, samples = evaluate(model, tok, args)
            if run != "base":  # which adapter these scores are of (current)
                results["adapter_sha256"] = model.lora_config[name]["sha256"]
            if run != "base" and os.path.isfile(base_path):
                results["retention"] = retention(retention_scores(read_json(base_path)), retention_scores(results),
                                                 paired_stderr(read_samples(args.out), samples, args.out))
            results["settings"] = {k: v for k, v in vars(args).items() if k not in ("runs", "table")}
            if not runs.RANK:  # under torchrun, one process writes
                write_eval(folder, results, samples)
            print(f"{run}: " + json.dumps({k: v for k, v in results.items() if k != "settings"}))


if __name__ == "__main__":
    runs.run_script(main, "rerun with a smaller --batch-size")
