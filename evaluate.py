"""
Evaluation: GSM8K accuracy (target task), MMLU and TruthfulQA multiple choice (retention),
forgetting and retention ratio against the base (the paper's eq. 12); a study's table: results.py.

    python evaluate.py base out/mild out/stress          # base model and two run folders
    python results.py out                               # their table, out/results.md

Conventions follow lm-evaluation-harness: GSM8K 'Question:/Answer:' prompts, greedy, strict
('#### N') and flexible (last number) extraction, scored 0-shot (the format RL, OPD and drift
prompt with, and the table's column) and 5-shot (lm-eval's); MMLU 5-shot with the subject
header, the prediction is the letter whose ' A'..' D' continuation is most likely;
TruthfulQA MC1/MC2 with the six-question QA primer and summed log-likelihoods. Every score
has its standard error over the questions as lm-evaluation-harness gives it, forgetting one
that pairs each question with the base's answer, and each its fingerprint (plumbing/provenance.py).
"""
import argparse
import json
import math
import os
import statistics
from dataclasses import replace

import torch
from tqdm import tqdm

import data
import lora
import model as M
import train
from plumbing import cli, processes, provenance, runs
from plumbing.files import InputError, read_json, write_atomic, write_json
from sample import Sampling, generate, left_pad

TASKS = ("gsm8k", "mmlu", "truthfulqa")
RETENTION_TASKS = ("truthfulqa", "mmlu")  # the paper averages forgetting over these two
FLAGS = ("tasks", "gsm8k_limit", "gsm8k_fewshot", "samples", "max_new_tokens", "mmlu_limit",
         "mmlu_shots", "mmlu_scoring", "truthfulqa_limit", "batch_size", "seed")
MEASURED = sorted({f for k in ("gsm8k_fewshot", "mmlu", "truthfulqa") for f in provenance.FLAGS[k]})


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
    # like lengths share a batch: less padding
    order = sorted(range(len(contexts)), key=lambda i: -len(ctx_ids[i]))
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    scores, mine = [], batches[slice(*processes.split(len(batches)))]  # torchrun's share
    for batch in tqdm(mine, desc=desc, leave=False):
        conts = [c for i in batch for c in cont_ids[i]]
        owner = torch.tensor([q for q, i in enumerate(batch) for _ in cont_ids[i]], device=device)
        # what the batch's contexts share at their start (TruthfulQA's primer) runs once, one row
        # copied to every context's; the rest of each runs after it, left-padded
        shared = min(train.common_length(ctx_ids[batch[0]], ctx_ids[i]) for i in batch)
        shared = min([shared] + [len(ctx_ids[i]) - 1 for i in batch])
        shared = shared if shared >= train.SHARED_MIN else 0
        ids, mask = left_pad([ctx_ids[i][shared:] for i in batch], tok.pad_id, device)
        L = max(map(len, conts))
        rows = 1 if shared else len(batch)
        cache = model.new_cache(rows, shared + ids.shape[1] + L) if L > 1 or shared else None
        if shared:
            model(torch.tensor([ctx_ids[batch[0]][:shared]], device=device), cache=cache)
            cache.select_rows(torch.zeros(len(batch), dtype=torch.long, device=device))
            mask = torch.cat([mask.new_ones(len(batch), shared), mask], 1)
        last = model(ids, attention_mask=mask, cache=cache, hidden_only=True)[:, -1]  # (B, hidden)
        if L == 1:  # MMLU's ' A'..' D': the last state scores them
            first = torch.tensor([c[0] for c in conts], device=device)
            sums = model.token_logprobs(last[owner], first).tolist()
        else:
            cache.select_rows(owner)  # each context's keys and values copied to its choices' rows
            c_ids = torch.tensor([c + [tok.pad_id] * (L - len(c)) for c in conts], device=device)
            c_mask = torch.tensor([[1] * len(c) + [0] * (L - len(c)) for c in conts], device=device)
            hidden = model(c_ids, attention_mask=torch.cat([mask[owner], c_mask], 1), cache=cache,
                           hidden_only=True)
            # the state before each continuation token
            states = torch.cat([last[owner][:, None], hidden[:, :-1]], 1)
            keep = c_mask.bool()  # right padding: after every real token, never read by one
            logp = model.token_logprobs(states[keep], c_ids[keep])
            rows = torch.arange(len(conts), device=device)[:, None].expand_as(keep)[keep]
            sums = torch.zeros(len(conts), device=device).index_add_(0, rows, logp).tolist()
        scores.append(sums)
    results = [None] * len(contexts)
    for batch, sums in zip(batches, processes.joined(scores)):
        for i in batch:
            results[i], sums = sums[:len(cont_ids[i])], sums[len(cont_ids[i]):]
    return results


def complete(model, tok, prompts, batch_size, sampling, desc):
    """sampling.n completions of each prompt (a list of n texts a prompt), in batches of like
    lengths; seeded, batch b's draw from seed + b * batch_size * n on, as under torchrun."""
    n, seed = sampling.n, sampling.seed
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # like lengths together
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    texts = []
    for b in tqdm(range(*processes.split(len(batches))), desc=desc, leave=False):  # a share
        first = None if seed is None else seed + b * batch_size * n
        outs = generate(model, tok, [prompts[i] for i in batches[b]],
                        replace(sampling, seed=first))
        texts.append([r.text for r in outs])
    completions = {i: outs[k * n:(k + 1) * n]  # under torchrun, every process's batches
                   for batch, outs in zip(batches, processes.joined(texts))
                   for k, i in enumerate(batch)}
    return [completions[i] for i in range(len(prompts))]


def eval_gsm8k(model, tok, rows, train_rows, shots, batch_size, max_new_tokens):
    """Greedy GSM8K accuracy on rows with `shots` solved train examples before each question:
    0 is the format RL, OPD and drift prompt with (the states the methods train on), 5
    lm-eval's."""
    if shots > len(train_rows):  # slicing would give fewer shots than asked, silently
        raise InputError(f"--gsm8k-fewshot {shots}: the train split holds {len(train_rows)} "
                         f"examples; pass --gsm8k-fewshot {len(train_rows)} or fewer")
    prompts = data.gsm8k_fewshot_prompts([r["question"] for r in rows], train_rows, shots)
    greedy = Sampling(max_new_tokens=max_new_tokens, temperature=0.0, stop=data.GSM8K_STOP)
    completions = complete(model, tok, prompts, batch_size, greedy, f"gsm8k {shots}-shot")
    samples = []
    for i, (row, [text]) in enumerate(zip(rows, completions)):
        strict, flexible = (data.extract_answer(text, way) for way in ("strict", "flexible"))
        samples.append(dict(task="gsm8k_fewshot" if shots else "gsm8k", index=i, prompt=prompts[i],
                            completion=text, gold=row["gold"], strict=strict, flexible=flexible,
                            correct=data.same_number(flexible, row["gold"]),
                            strict_correct=data.same_number(strict, row["gold"])))
    return dict(**mean_and_stderr("flexible", [s["correct"] for s in samples]),
                **mean_and_stderr("strict", [s["strict_correct"] for s in samples]),
                n=len(samples), shots=shots), samples


def pass_at_k(n, c, k):
    """The unbiased estimator of pass@k from n samples of which c are right (Chen et al. 2021,
    arXiv 2107.03374): 1 - C(n - c, k) / C(n, k), written as a product that cannot overflow."""
    return 1.0 if n - c < k else 1.0 - math.prod(1 - k / i for i in range(n - c + 1, n + 1))


SAMPLE_SEED = 0  # the draws of --samples: the same for every model, so that their pass@k compare


def eval_gsm8k_samples(model, tok, rows, K, batch_size, max_new_tokens):
    """--samples K temperature-1 completions of each 0-shot GSM8K question of rows: pass@k for
    every k up to K, and the samples' mean accuracy (pass@1), each right by the flexible answer."""
    prompts = [data.gsm8k_prompt(r["question"]) for r in rows]
    drawn = Sampling(n=K, max_new_tokens=max_new_tokens, temperature=1.0, stop=data.GSM8K_STOP,
                     seed=SAMPLE_SEED)
    completions = complete(model, tok, prompts, batch_size, drawn, f"gsm8k {K} samples")
    samples = [dict(task="gsm8k_samples", index=i, prompt=prompts[i], completions=texts,
                    gold=row["gold"], correct=[data.same_number(data.extract_answer(t, "flexible"),
                                                                row["gold"]) for t in texts])
               for i, (row, texts) in enumerate(zip(rows, completions))]
    right = [sum(s["correct"]) for s in samples]
    passes = {f"pass@{k}": sum(pass_at_k(K, c, k) for c in right) / len(right)
              for k in range(1, K + 1)}
    return dict(**mean_and_stderr("mean", [c / K for c in right]), n=len(samples), samples=K,
                **passes), samples


def eval_mmlu(model, tok, data_dir, limit, shots, scoring, seed, batch_size):
    """MMLU accuracy on `limit` test questions (0: all) drawn by seed, `shots` dev examples of
    the subject before each, scored by each choice's letter or text."""
    dev, test = data.load_mmlu("dev", data_dir), data.load_mmlu("test", data_dir)
    rows = data.mmlu_subset(test, limit, seed=seed)
    fewest, subject = min((len(dev.get(r["subject"], [])), r["subject"]) for r in rows)
    if shots > fewest:  # slicing would give that subject fewer shots than asked, silently
        raise InputError(f"--mmlu-shots {shots}: the dev split holds {fewest} examples of "
                         f"{subject}; pass --mmlu-shots {fewest} or fewer")
    prompts = [data.mmlu_prompt(r, dev.get(r["subject"], [])[:shots]) for r in rows]
    choices = [data.mmlu_continuations(r, scoring) for r in rows]
    lls = score_choices(model, tok, prompts, choices, batch_size, desc="mmlu")
    samples = []
    for i, (row, ll) in enumerate(zip(rows, lls)):
        pred = max(range(4), key=lambda c: ll[c])
        samples.append(dict(task="mmlu", index=i, subject=row["subject"], prompt=prompts[i],
                            loglikelihoods=ll, prediction=pred, answer=row["answer"],
                            correct=pred == row["answer"]))
    return dict(**mean_and_stderr("acc", [s["correct"] for s in samples]), n=len(samples),
                scoring=scoring), samples


def mc2_score(lls, labels):
    """Normalised probability mass on the true answers (TruthfulQA MC2). The largest
    log-likelihood is taken out before exp, which the ratio does not see: a long answer's
    summed log-likelihood below -745 would otherwise underflow to 0, and all of them 0/0."""
    top = max(lls)
    p = [math.exp(x - top) for x in lls]
    return sum(pi for pi, lab in zip(p, labels) if lab) / sum(p)


def eval_truthfulqa(model, tok, data_dir, limit, batch_size):
    """TruthfulQA MC1 and MC2 on the first `limit` questions (0: all)."""
    rows = data.load_truthfulqa(data_dir)[:limit or None]
    prompts = [data.truthfulqa_prompt(r) for r in rows]
    # MC2's targets repeat MC1's (as TruthfulQA's own files do): each choice is scored once
    union = [list(dict.fromkeys([*r["mc1_targets"], *r["mc2_targets"]])) for r in rows]
    lls = score_choices(model, tok, prompts, [[f" {c}" for c in u] for u in union], batch_size,
                        "truthfulqa")
    scored = [dict(zip(u, ll)) for u, ll in zip(union, lls)]
    mc1 = [[s[c] for c in r["mc1_targets"]] for s, r in zip(scored, rows)]
    mc2 = [[s[c] for c in r["mc2_targets"]] for s, r in zip(scored, rows)]
    samples = []
    for i, row in enumerate(rows):
        labels1, labels2 = list(row["mc1_targets"].values()), list(row["mc2_targets"].values())
        pred = max(range(len(labels1)), key=lambda c: mc1[i][c])
        samples.append(dict(task="truthfulqa", index=i, prompt=prompts[i],
                            mc1_loglikelihoods=mc1[i], mc2_loglikelihoods=mc2[i], prediction=pred,
                            correct=bool(labels1[pred]), mc2=mc2_score(mc2[i], labels2)))
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


def columns(settings):
    """The eval.json columns that evaluate.py's flags ask for (each a kind of provenance.FLAGS)."""
    gsm8k = ["gsm8k"] + ["gsm8k_fewshot"] * (settings["gsm8k_fewshot"] > 0)
    gsm8k += ["gsm8k_samples"] * (settings["samples"] > 0)
    return [k for t in settings["tasks"].split(",") for k in (gsm8k if t == "gsm8k" else [t])]


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
            raise InputError(f"the base's answers in {base_folder} are to other {task} questions "
                             f"than this evaluation's; evaluate 'base' again with its flags")
        out[task] = standard_error([int(base[i]["correct"]) - int(post[i]["correct"])
                                    for i in sorted(post)])
    return out


def retention_scores(result):
    """The two retention numbers the paper averages: TruthfulQA MC1 and MMLU accuracy."""
    return {t: result[t][k] for t, k in (("truthfulqa", "mc1"), ("mmlu", "acc")) if t in result}


def retention(base, post, stderr=None):
    """Forgetting F = base - post and retention ratio post / base per task (eq. 12), and
    their means over the tasks both have; given each task's forgetting's standard error
    (paired_stderr) also the mean's."""
    tasks = [t for t in RETENTION_TASKS if t in base and t in post]
    # a base score of zero has no ratio: None (JSON null) rather than a NaN
    per = {t: dict(forgetting=base[t] - post[t], retention=post[t] / base[t] if base[t] else None)
           for t in tasks}
    # base: what it was measured against (report.collect_runs)
    out = dict(per_task=per, base={t: base[t] for t in tasks})
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


def task_list(text):
    """An argparse type: comma-separated names from TASKS, checked before anything runs
    (rather than after hours of the tasks named before a misspelt one); a task named
    twice runs once."""
    unknown = [t for t in text.split(",") if t not in TASKS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown task {unknown[0]!r} in {text!r}; name tasks "
                                         f"from {','.join(TASKS)}, separated by commas")
    return ",".join(dict.fromkeys(text.split(",")))


def add_eval_args(p):
    p.add_argument("--tasks", type=task_list, default="gsm8k,mmlu,truthfulqa",
                   help="comma-separated subset of gsm8k,mmlu,truthfulqa")
    p.add_argument("--gsm8k-limit", type=cli.number(int, 0), default=500,
                   help="first N GSM8K test questions (0 = all 1,319)")
    p.add_argument("--gsm8k-fewshot", type=cli.number(int, 0), default=5,
                   help="also score GSM8K with this many solved train examples before each "
                        "question, as lm-evaluation-harness does (0 = only the 0-shot score, the "
                        "format the methods train on)")
    p.add_argument("--samples", type=cli.number(int, 0), default=0,
                   help="also draw this many temperature-1 completions of each 0-shot GSM8K "
                        "question: pass@k for every k up to it (Chen et al. 2021's unbiased "
                        "estimator) and their mean accuracy")
    p.add_argument("--max-new-tokens", type=cli.number(int, 1), default=256,
                   help="GSM8K generation budget")
    p.add_argument("--mmlu-limit", type=cli.number(int, 0), default=500,
                   help="MMLU test questions, stratified over subjects (0 = all 14,042)")
    p.add_argument("--mmlu-shots", type=cli.number(int, 0), default=5,
                   help="dev examples per subject")
    p.add_argument("--mmlu-scoring", choices=["letter", "text"], default="letter",
                   help="score ' A'..' D' (lm-eval mmlu) or each choice's own text (lm-eval "
                        "continuation variant)")
    p.add_argument("--truthfulqa-limit", type=cli.number(int, 0), default=0,
                   help="first N TruthfulQA questions (0 = all 817)")
    p.add_argument("--batch-size", type=cli.number(int, 1), default=16, help="prompts per batch")
    p.add_argument("--seed", type=int, default=1234, help="seed of the MMLU subset")


def evaluate(model, tok, data_dir, flags):
    """Run the tasks on whatever adapter is active, with flags, the values of FLAGS by name
    (add_eval_args gives them); returns (results, samples)."""
    results, drawn, batch_size = {}, [], flags["batch_size"]
    for task in flags["tasks"].split(","):
        if task == "gsm8k":
            rows = data.load_gsm8k("test", data_dir)[:flags["gsm8k_limit"] or None]
            train_rows = data.load_gsm8k("train", data_dir)
            for shots in sorted({0, flags["gsm8k_fewshot"]}):  # 0-shot, and few-shot if asked
                key = "gsm8k_fewshot" if shots else "gsm8k"  # eval.json's column
                results[key], part = eval_gsm8k(model, tok, rows, train_rows, shots, batch_size,
                                                flags["max_new_tokens"])
                drawn += part
            if flags["samples"]:
                results["gsm8k_samples"], part = eval_gsm8k_samples(
                    model, tok, rows, flags["samples"], batch_size, flags["max_new_tokens"])
                drawn += part
        elif task == "mmlu":
            results[task], part = eval_mmlu(model, tok, data_dir, flags["mmlu_limit"],
                                            flags["mmlu_shots"], flags["mmlu_scoring"],
                                            flags["seed"], batch_size)
            drawn += part
        else:
            results[task], part = eval_truthfulqa(model, tok, data_dir, flags["truthfulqa_limit"],
                                                  batch_size)
            drawn += part
    return results, drawn


def write_eval(folder, results, samples):
    os.makedirs(folder, exist_ok=True)
    write_json(os.path.join(folder, "eval.json"), results)
    write_atomic(os.path.join(folder, "eval_samples.jsonl"),
                   lambda p: open(p, "w").write("".join(json.dumps(s) + "\n" for s in samples)))


def with_other_tasks(folder, scores, samples, model, sha):
    """scores and samples, with the columns (and their samples) that folder's eval.json holds
    of tasks this evaluation did not run, measured on the same model and adapter: evaluating
    one task again leaves the other tasks' numbers in place."""
    path, model = os.path.join(folder, "eval.json"), provenance.model_identity(model)
    old = read_json(path) if os.path.isfile(path) else {}
    prints = {k: v["fingerprint"] for k, v in old.items()
              if k not in scores and isinstance(v, dict) and "fingerprint" in v}
    kept = {k: old[k] for k, v in prints.items()
            if (v.get("model"), v.get("adapter_sha256")) == (model, sha)}
    if not kept:
        return scores, samples
    before = [s for s in read_samples(folder) or [] if s["task"] in kept]
    return {**kept, **scores}, before + samples


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*",
                   help="'base' and/or run folders (base model + that run's adapter)")
    cli.add_model_args(p)
    p.add_argument("--out", default=None,
                   help="the study folder, with the base's eval.json, whose flags a run takes "
                        "where not given (default: the first run's parent, else out)")
    add_eval_args(p)
    defaults = cli.left_unset(p, MEASURED)  # not given: as the study's base was measured
    args = p.parse_args(argv)
    if not args.runs:
        p.error("name 'base' and/or run folders to evaluate (the table of a study: python "
                "results.py ROOT)")
    args.runs = list(dict.fromkeys(args.runs))  # a run named twice (overlapping globs): once
    folders = [run for run in args.runs if run != "base"]
    args.out = args.out or (os.path.dirname(os.path.normpath(folders[0])) or "." if folders
                            else "out")
    cli.model_and_data_from(args, *map(provenance.run_record, folders))
    for run in folders:
        runs.check_run_folder(run, args.model, also=", or 'base'")
    if "base" in args.runs and os.path.isfile(os.path.join(args.out, "adapter_config.json")):
        raise InputError(f"--out {args.out} is a run folder: the base's eval.json would replace "
                         f"the run's; pass the folder that holds the runs (out, say)")
    base_path = os.path.join(args.out, "eval.json")
    base = read_json(base_path) if args.runs[0] != "base" and os.path.isfile(base_path) else {}
    cli.unless_given(args, defaults, provenance.measured_with(base), base_path)  # or base anew
    if base:
        retained = [t for t in RETENTION_TASKS if t in columns(vars(args))]
        provenance.check_measured_alike(base_path, retained, vars(args))
    print(vars(args))
    if "base" not in args.runs and not os.path.isfile(base_path):
        print(f"note: no base evaluation {base_path}, so no forgetting or retention for these "
              f"runs; evaluate 'base' there first, or pass the --out that holds it")
    device, dtype = cli.device_from_args(args)
    flags = {k: getattr(args, k) for k in FLAGS}
    # held while evaluated: a second evaluation would mix its eval.json with this one's samples,
    # and a run resumed meanwhile would leave these scores of an adapter it no longer holds
    with runs.locked(*[args.out if run == "base" else run for run in args.runs], instead=""):
        model, tok = M.load(args.model, device, dtype)
        for i, run in enumerate(args.runs):
            folder, sha = args.out, None
            lora.set_adapter(model, None)
            if run != "base":
                lora.load_adapter(model, run, name=f"run{i}")
                folder, sha = run, model.lora_config[f"run{i}"]["sha256"]
            scores, samples = evaluate(model, tok, args.data_dir, flags)
            for column, result in scores.items():  # what each number is of
                result["fingerprint"] = provenance.fingerprint(column, vars(args), sha)
            scores, samples = with_other_tasks(folder, scores, samples, args.model, sha)
            if run != "base" and os.path.isfile(base_path):
                base = retention_scores(read_json(base_path))
                scores["retention"] = retention(base, retention_scores(scores), paired_stderr(
                    read_samples(args.out), samples, args.out))
            scores["settings"] = {k: v for k, v in vars(args).items() if k != "runs"}
            if not processes.RANK:  # under torchrun, one process writes
                write_eval(folder, scores, samples)
            print(f"{run}: " + json.dumps({k: v for k, v in scores.items() if k != "settings"}))


if __name__ == "__main__":
    cli.run_script(main, "rerun with a smaller --batch-size")
