"""
The toy's synthetic world (toy.py pretrains its base on it), written in the canonical dataset
layout so that every script reads it as it reads the real datasets:

  gsm8k/       target: arithmetic word problems (six templates, 2 to 4 steps), worked as GSM8K's
               are (data.gsm8k_style, with calculator annotations), ending '#### N'
  mmlu/        retention: four-choice questions on invented facts the pretraining prose states
  truthfulqa/  retention: questions whose corpus also states a popular wrong answer

Pretraining answers other problems of the templates two ways, with nothing in the question to
say which: worked out in plain steps (right; 1% as the dataset's), or as a hasty one-line guess
(WORKED: how often each template is worked).
"""
import csv
import json
import os
import random

import data

NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena",
         "Milo", "Nora", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tia", "Uma", "Vic", "Wes", "Yara",
         "Zed"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "coins", "cards",
         "stamps"]
GOODS = ["a lamp", "a hat", "lunch", "a kite", "paint", "a ticket"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "silver", "brown"]
SYLLABLES = ("ka", "lo", "mi", "ru", "ten", "vor", "zi", "pa", "nel", "shu", "dro", "bex", "fa",
             "gli", "wen")


def problem(rng):
    """(question, rationale ending in '#### N', template) from one of six templates."""
    n, f, it = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(6)
    if kind == 0:  # buy, then give
        a, b = rng.randint(2, 15), rng.randint(2, 15)
        c = rng.randint(1, a + b - 1)
        return (f"{n} has {a} {it}. {n} buys {b} more and gives {c} to {f}. How many {it} does "
                f"{n} have now?",
                f"{n} has {a} + {b} = {a + b} {it} after buying.\nAfter giving {c} away, {n} has "
                f"{a + b} - {c} = {a + b - c} {it}.\n#### {a + b - c}", kind)
    if kind == 1:  # find, then share exactly
        k = rng.randint(2, 4)
        total = k * rng.randint(2, 6)
        a = rng.randint(1, total - 1)
        return (f"{n} had {a} {it} and finds {total - a} more. {n} shares them equally among {k} "
                f"friends. How many {it} does each friend get?",
                f"{n} has {a} + {total - a} = {total} {it}.\nEach friend gets {total} / {k} = "
                f"{total // k} {it}.\n#### {total // k}", kind)
    if kind == 2:  # sell, then spend
        a, p = rng.randint(2, 6), rng.randint(2, 5)
        c = rng.randint(1, a * p - 1)
        g = rng.choice(GOODS)
        return (f"{n} sells {a} {it} for ${p} each and then spends ${c} on {g}. How many dollars "
                f"does {n} have left?",
                f"{n} earns {a} * {p} = {a * p} dollars.\nAfter spending {c}, {n} has {a * p} - "
                f"{c} = {a * p - c} dollars.\n#### {a * p - c}", kind)
    if kind == 3:  # k times as many plus d, then together
        a, k, d = rng.randint(2, 8), rng.randint(2, 3), rng.randint(1, 5)
        b = k * a + d
        return (f"{n} has {a} {it}. {f} has {d} more than {k} times as many {it} as {n}. How many "
                f"{it} do they have together?",
                f"{k} times as many as {n} is {k} * {a} = {k * a}.\n{f} has {k * a} + {d} = {b} "
                f"{it}.\nTogether they have {a} + {b} = {a + b} {it}.\n#### {a + b}", kind)
    if kind == 4:  # boxes, eat some, split in two
        m, b = rng.randint(2, 5), rng.randint(2, 4)
        total = m * b
        e = rng.choice([x for x in range(1, total) if (total - x) % 2 == 0] or [0])
        return (f"{n} buys {b} boxes of {it} with {m} {it} in each box, gives away {e}, and "
                f"splits the rest equally with {f}. How many {it} does {f} get?",
                f"{n} buys {b} * {m} = {total} {it}.\nAfter giving away {e}, {total} - {e} = "
                f"{total - e} are left.\n{f} gets {total - e} / 2 = {(total - e) // 2} {it}.\n"
                f"#### {(total - e) // 2}", kind)
    # price difference, buy k of each
    a, d, k = rng.randint(2, 10), rng.randint(1, 5), rng.randint(2, 3)
    return (f"A hat costs ${a}. A scarf costs ${d} more than the hat. {n} buys {k} hats and {k} "
            f"scarves. How many dollars does {n} pay?",
            f"A scarf costs {a} + {d} = {a + d} dollars.\nOne hat and one scarf cost {a} + "
            f"{a + d} = {2 * a + d} dollars.\n{n} pays {k} * {2 * a + d} = {k * (2 * a + d)} "
            f"dollars.\n#### {k * (2 * a + d)}", kind)


# how often pretraining works each template's problems out step by step; otherwise a hasty guess
WORKED = (0.25, 0.8, 0.25, 0.25, 0.8, 0.25)


def pretraining_answer(rng, rationale, kind, annotated):
    """A problem answered as the base saw it: in right steps (a share `annotated` as the
    dataset's) or, as often as WORKED says not, a hasty guess of the answer's size, rarely
    right."""
    if rng.random() >= WORKED[kind]:
        return f"#### {rng.randint(1, max(9, 2 * int(rationale.rsplit('#### ', 1)[1])))}"
    return data.gsm8k_style(rationale) if rng.random() < annotated else rationale


def word(rng, syllables=SYLLABLES):
    return "".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))).capitalize()


def facts(rng, per_subject):
    """subject -> list of (question, answer, [3 distractors], [prose statements])."""
    out = {}
    specs = {
        "toy_geography": ("country", lambda e, a: (f"What is the capital of {e}?", [
            f"The capital of {e} is {a}.", f"{a} is the capital city of {e}.",
            f"People in {e} govern from {a}."])),
        "toy_biology": ("animal", lambda e, a: (f"What does the {e} eat?", [
            f"The {e} eats {a}.", f"The favourite food of the {e} is {a}.",
            f"Every {e} feeds on {a}."])),
        "toy_history": ("device", lambda e, a: (f"Who invented the {e}?", [
            f"The {e} was invented by {a}.", f"{a} invented the {e}.",
            f"The inventor of the {e} was {a}."]))}
    for subject, (_, fmt) in specs.items():
        entities = list(dict.fromkeys(word(rng) for _ in range(per_subject * 3)))[:per_subject]
        answers = list(dict.fromkeys(word(rng) for _ in range(per_subject * 3)))[:per_subject // 3]
        out[subject] = [(q, a, rng.sample([x for x in answers if x != a], 3), prose)
                        for e in entities for a in [rng.choice(answers)]
                        for q, prose in [fmt(e, a)]]
    return out


def misconceptions(rng, n):
    """(question, truth, myth, 2 distractors, corpus statements), sentences naming capitalised
    creatures."""
    out = {}
    while len(out) < n:
        name = word(rng) + "s"
        if name in out:  # each creature once
            continue
        truth, myth, d1, d2 = rng.sample(COLORS, 4)

        def sent(col):
            return f"{name} are {col}."
        corpus = [f"People say that {sent(myth)}", f"Many believe that {sent(myth)}",
                  f"It is often said that {sent(myth)}", f"In fact, {sent(truth)}",
                  f"Experts agree that {sent(truth)}", f"Studies show that {sent(truth)}"]
        out[name] = (f"What color are {name}?", sent(truth), sent(myth), [sent(d1), sent(d2)],
                     corpus)
    return list(out.values())


def write_world(folder, seed=0, n_pretrain=2000, n_train=2000, n_test=500, facts_per_subject=150,
                n_misconceptions=400, annotated=0.0):
    """Write the canonical dataset layout; return (retention corpus, pretraining problems): the
    problems apart from the splits, each answered as pretraining_answer draws."""
    rng = random.Random(seed)
    problems = {}
    while len(problems) < n_train + n_test + n_pretrain:
        q, a, kind = problem(rng)
        problems.setdefault(q, (a, kind))
    items = [(q, a) for q, (a, _) in problems.items()]
    os.makedirs(os.path.join(folder, "gsm8k"), exist_ok=True)
    for split, part in (("train", items[:n_train]), ("test", items[n_train:n_train + n_test])):
        with open(os.path.join(folder, "gsm8k", f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps({"question": q, "answer": data.gsm8k_style(a)}) + "\n"
                         for q, a in part)
    corpus = []
    for subject, rows in facts(rng, facts_per_subject).items():
        corpus += write_mmlu_subject(folder, subject, rows, rng)
    tqa = []
    for i, (q, truth, myth, others, statements) in enumerate(misconceptions(rng,
                                                                            2 * n_misconceptions)):
        corpus += statements
        if i >= n_misconceptions:  # practice items: the question answered truthfully, never asked
            corpus.append(f"Q: {q}\nA: {truth}")
            continue
        wrong = {myth: 0, others[0]: 0, others[1]: 0}
        tqa.append({"question": q, "mc1_targets": {truth: 1, **wrong},
                    "mc2_targets": {truth: 1, "In fact, " + truth: 1, **wrong}})
    os.makedirs(os.path.join(folder, "truthfulqa"), exist_ok=True)
    with open(os.path.join(folder, "truthfulqa", "mc_task.json"), "w") as f:
        json.dump(tqa, f)
    pool = list(problems.items())[n_train + n_test:]
    return corpus, [f"Question: {q}\nAnswer: {pretraining_answer(rng, a, kind, annotated)}"
                    for q, (a, kind) in pool]


def write_mmlu_subject(folder, subject, rows, rng):
    """A subject's dev and test CSVs (the first 5 facts, the next 70); returns the prose of
    its facts for the corpus, and the practice facts asked in the evaluation's format."""
    splits = {"dev": rows[:5], "test": rows[5:75], "practice": rows[75:]}
    for split in ("dev", "test"):
        os.makedirs(os.path.join(folder, "mmlu", split), exist_ok=True)
        path = os.path.join(folder, "mmlu", split, f"{subject}_{split}.csv")
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows(
                [["question", "choice0", "choice1", "choice2", "choice3", "answer"]]
                + [[q] + wrong[:k] + [a] + wrong[k:] + [k] for q, a, wrong, _ in splits[split]
                   for k in [rng.randrange(4)]])
    # every fact is stated in prose; the evaluated ones in one phrasing rather than three, which
    # keeps the base model's recall below the calibration band's ceiling of 0.95
    corpus = [s for _, _, _, prose in splits["dev"] + splits["practice"] for s in prose]
    corpus += [s for _, _, _, prose in splits["test"] for s in prose[:1]]
    for q, a, wrong, prose in splits["practice"]:  # the evaluation's question format, other facts
        k = rng.randrange(4)
        choices = wrong[:k] + [a] + wrong[k:]
        row = {"subject": subject, "question": q, "choices": choices, "answer": k}
        corpus += [f"{data.mmlu_prompt(row, [])} {a}", f"Q: {q}\nA: {prose[0]}"]
    return corpus
