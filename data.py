"""
GSM8K, MMLU and TruthfulQA: fetching the raw files, parsing them, prompt formats, and
GSM8K answer extraction (also the RL reward).

Canonical layout (the same in the cache and in a --data-dir folder):
    gsm8k/train.jsonl, gsm8k/test.jsonl        {"question", "answer" ending in "#### N"}
    truthfulqa/mc_task.json                    [{"question", "mc1_targets", "mc2_targets"}]
    mmlu/{dev,test}/<subject>_{dev,test}.csv   header question,choice0..choice3,answer (0-3)

Prompt formats and answer extraction follow lm-evaluation-harness (gsm8k, mmlu,
truthfulqa_mc1/mc2) so our numbers sit next to theirs.
"""
import csv
import hashlib
import io
import json
import os
import random
import re
import shutil
import tarfile
import tempfile
import urllib.request
import uuid

from plumbing.files import InputError

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "states")
RAW = "https://raw.githubusercontent.com"
GSM8K = f"{RAW}/openai/grade-school-math/master/grade_school_math/data"
SOURCES = {  # canonical path -> (url, sha256 or None when only a parse check is possible)
    "gsm8k/train.jsonl": (f"{GSM8K}/train.jsonl",
                          "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465"),
    "gsm8k/test.jsonl": (f"{GSM8K}/test.jsonl",
                         "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"),
    # upstream has been revised since the copy we checked, so a parse check instead of a hash
    "truthfulqa/mc_task.json": (f"{RAW}/sylinrl/TruthfulQA/main/data/mc_task.json", None),
    "mmlu": ("https://people.eecs.berkeley.edu/~hendrycks/data.tar", None),
}
HOW_TO_FIX = ("download the files by hand into the layout in data.py's docstring and pass "
              "--data-dir (or set STATES_DATA)")


class DataError(InputError):
    """A dataset folder, file or download that cannot be used; the message says how to fix it."""


# -----------------------------------------------------------------------------
# fetching

def resolve_data_dir(data_dir=None, fetch=True, sources=SOURCES):
    """--data-dir, else $STATES_DATA (both used as they are, never written to), else the
    cache, filled on first use."""
    given = data_dir or os.environ.get("STATES_DATA")
    if given:
        if not os.path.isdir(given):
            fix = ("pass --data-dir pointing at the dataset files" if data_dir else
                   "point $STATES_DATA at the dataset files, or unset it to fetch them into "
                   "~/.cache/states")
            raise DataError(f"data folder {given} does not exist; {fix}")
        return given
    if fetch:
        fetch_all(CACHE, sources)
    return CACHE


def download(url, dest_tmp):
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(dest_tmp, "wb") as f:
            shutil.copyfileobj(r, f)
    except Exception as e:
        raise DataError(f"download of {url} failed ({e}); {HOW_TO_FIX}") from None


def fetch_all(root, sources=SOURCES):
    """Fetch whatever is missing. Each file goes to a temp file of its own, is checked, then
    renamed, so an interrupted or failed download leaves nothing half-written, and two
    scripts started at once on a fresh machine each fetch without spoiling the other's."""
    os.makedirs(root, exist_ok=True)
    for rel, (url, sha) in sources.items():
        if rel == "mmlu":
            if not os.path.isdir(os.path.join(root, "mmlu")):
                fetch_mmlu(root, url)
            continue
        dest = os.path.join(root, rel)
        if os.path.isfile(dest):
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = f"{dest}.part-{uuid.uuid4().hex}"  # not mkstemp's: private to their owner
        try:
            download(url, tmp)
            if sha is not None:
                with open(tmp, "rb") as f:
                    got = hashlib.sha256(f.read()).hexdigest()
                if got != sha:
                    raise DataError(f"download of {url} has sha256 {got[:12]}..., expected "
                                    f"{sha[:12]}...; {HOW_TO_FIX}")
            else:
                (load_truthfulqa_file if rel.endswith(".json") else load_gsm8k_file)(tmp)
            os.replace(tmp, dest)
        except DataError as e:
            if url in str(e):
                raise
            raise DataError(f"download of {url} is not usable ({e}); {HOW_TO_FIX}") from None
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def fetch_mmlu(root, url):
    """The original Hendrycks data.tar (header-less CSVs, letter answers) converted to the
    canonical layout; built in a temp folder and renamed into place as a whole."""
    work = tempfile.mkdtemp(dir=root, prefix="mmlu.part")
    try:
        download(url, os.path.join(work, "data.tar"))
        try:
            tar = tarfile.open(os.path.join(work, "data.tar"))
        except tarfile.TarError as e:
            raise DataError(f"{url}: not a tar archive ({e}); {HOW_TO_FIX}") from None
        with tar:
            for member in tar.getmembers():
                m = re.fullmatch(r"(?:\./)?data/(dev|test)/([a-z_]+)_(dev|test)\.csv", member.name)
                if not member.isfile() or not m:
                    continue
                split, subject = m.group(1), m.group(2)
                text = tar.extractfile(member).read().decode("utf-8")
                os.makedirs(os.path.join(work, "mmlu", split), exist_ok=True)
                csv_path = os.path.join(work, "mmlu", split, f"{subject}_{split}.csv")
                with open(csv_path, "w", newline="") as f:
                    out = csv.writer(f)
                    out.writerow(["question", "choice0", "choice1", "choice2", "choice3", "answer"])
                    for i, row in enumerate(csv.reader(io.StringIO(text)), 1):
                        if len(row) != 6 or row[5] not in ("A", "B", "C", "D"):
                            raise DataError(f"{url}: {member.name} line {i} is not question,4 "
                                            f"choices,letter; {HOW_TO_FIX}")
                        out.writerow(row[:5] + ["ABCD".index(row[5])])
        for split in ("dev", "test"):
            if not os.path.isdir(os.path.join(work, "mmlu", split)):
                raise DataError(f"{url}: the archive has no data/{split}/ CSV files; {HOW_TO_FIX}")
        try:
            os.replace(os.path.join(work, "mmlu"), os.path.join(root, "mmlu"))
        except OSError:  # another process fetching at the same time put its copy there first
            if not os.path.isdir(os.path.join(root, "mmlu", "test")):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -----------------------------------------------------------------------------
# loading

def load_gsm8k_file(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                question, answer = row["question"], row["answer"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(f"{path} line {i}: expected JSON with 'question' and "
                                f"'answer'") from None
            gold = extract_answer(answer, "strict")
            if gold is None:
                raise DataError(f"{path} line {i}: the answer does not end in '#### <number>'")
            rows.append({"question": question, "answer": answer, "gold": gold})
    return rows


def dataset_file(data_dir, *parts):
    """The path of one dataset file under the data folder, which must be there."""
    path = os.path.join(resolve_data_dir(data_dir), *parts)
    if not os.path.isfile(path):
        raise DataError(f"{path} is missing; {HOW_TO_FIX}")
    return path


def load_gsm8k(split, data_dir=None):
    return load_gsm8k_file(dataset_file(data_dir, "gsm8k", f"{split}.jsonl"))


def with_wrong_answers(rows, share, seed=0):
    """rows with the final number of a share of their gold answers made wrong, N plus an
    offset of 1 to 9 either way, never below 0 (or N), the worked steps as they are; row i's
    draw from (seed, i): a teacher degraded on purpose (P3, docs/toy-study.md)."""
    out = []
    for i, r in enumerate(rows):
        rng = random.Random(f"wrong/{seed}/{i}")
        if rng.random() >= share:
            out.append(r)
            continue
        n = round(float(r["gold"]))
        wrong = n + rng.choice([d for d in range(-9, 10) if d and n + d >= min(n, 0)])
        steps = r["answer"].rsplit("####", 1)[0]
        out.append({**r, "answer": f"{steps}#### {wrong}", "gold": str(wrong)})
    return out


def load_mmlu_file(path, subject):
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != ["question", "choice0", "choice1", "choice2", "choice3", "answer"]:
            raise DataError(f"{path} line 1: expected header "
                            f"question,choice0,choice1,choice2,choice3,answer")
        for i, row in enumerate(reader, 2):
            if len(row) != 6 or row[5] not in ("0", "1", "2", "3"):
                raise DataError(f"{path} line {i}: expected a question, 4 choices and an "
                                f"answer 0-3")
            rows.append({"subject": subject, "question": row[0], "choices": row[1:5],
                         "answer": int(row[5])})
    return rows


def load_mmlu(split, data_dir=None):
    """{subject: [rows]} for split 'dev' or 'test', subjects sorted."""
    folder = os.path.join(resolve_data_dir(data_dir), "mmlu", split)
    if not os.path.isdir(folder):
        raise DataError(f"{folder} is missing; {HOW_TO_FIX}")
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(f"_{split}.csv"):
            subject = name[:-len(f"_{split}.csv")]
            out[subject] = load_mmlu_file(os.path.join(folder, name), subject)
    if not out:
        raise DataError(f"{folder} holds no <subject>_{split}.csv files; {HOW_TO_FIX}")
    return out


def load_truthfulqa_file(path):
    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: not valid JSON") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of questions")
    for i, row in enumerate(rows):
        keys = ("question", "mc1_targets", "mc2_targets")
        ok = isinstance(row, dict) and all(k in row for k in keys)
        ok = ok and all(isinstance(row[k], dict) and row[k] for k in ("mc1_targets", "mc2_targets"))
        if not ok or sum(row["mc1_targets"].values()) != 1:
            raise DataError(f"{path} item {i}: expected question, mc1_targets (one true) and "
                            f"mc2_targets")
    return rows


def load_truthfulqa(data_dir=None):
    return load_truthfulqa_file(dataset_file(data_dir, "truthfulqa", "mc_task.json"))


def mmlu_subset(test_by_subject, limit, seed=1234):
    """`limit` test questions stratified over subjects (largest-remainder shares), fixed
    by the seed; limit 0 means every question."""
    if limit <= 0:
        return [row for rows in test_by_subject.values() for row in rows]
    total = sum(len(r) for r in test_by_subject.values())
    limit = min(limit, total)
    shares = {s: limit * len(r) / total for s, r in test_by_subject.items()}
    counts = {s: int(v) for s, v in shares.items()}
    for s in sorted(shares, key=lambda s: counts[s] - shares[s])[:limit - sum(counts.values())]:
        counts[s] += 1
    rng = random.Random(seed)
    picked = []
    for subject, rows in test_by_subject.items():
        order = list(range(len(rows)))
        rng.shuffle(order)
        picked += [rows[i] for i in sorted(order[:counts[subject]])]
    return picked


def batch_indices(n_items, step, batch_size, seed):
    """Indices of the items used at a training step: a fresh permutation per epoch,
    consumed batch by batch. A function of the step alone, so a resumed run sees the
    same data as an uninterrupted one."""
    first, last = step * batch_size, (step + 1) * batch_size
    out = []
    for epoch in range(first // n_items, (last - 1) // n_items + 1):
        perm = random.Random(seed * 1_000_003 + epoch).sample(range(n_items), n_items)
        lo, hi = max(first - epoch * n_items, 0), min(last - epoch * n_items, n_items)
        out += perm[lo:hi]
    return out


def item_rng(key, i):
    """The random.Random of item i of this process's share of a step, key = (seed, step, first):
    seeded by the item's place in the whole step, so no number of processes changes its draws."""
    return random.Random("/".join(map(str, (*key[:2], key[2] + i))))


# -----------------------------------------------------------------------------
# prompts

def gsm8k_prompt(question, shots=()):
    """lm-evaluation-harness gsm8k: 'Question: ..\\nAnswer: ..' shots joined by a blank line."""
    parts = [f"Question: {s['question']}\nAnswer: {s['answer']}" for s in shots]
    return "\n\n".join(parts + [f"Question: {question}\nAnswer:"])


def gsm8k_fewshot_prompts(questions, train, shots, seed=1234):
    """Each question's prompt with `shots` solved train examples before it, drawn for each
    question in turn from one random.Random(seed), as lm-evaluation-harness's default
    few-shot sampler does for its gsm8k task (fewshot_split train, seed 1234)."""
    rng = random.Random(seed)
    return [gsm8k_prompt(q, rng.sample(train, shots) if shots else ()) for q in questions]


CALCULATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def gsm8k_style(rationale):
    """A rationale written as GSM8K's annotators wrote theirs: every calculation "a + b = c" as
    "a+b = <<a+b=c>>c", with its calculator annotation (the toy world's gold answers)."""
    return CALCULATION.sub(lambda m: f"{m[1]}{m[2]}{m[3]} = <<{m[1]}{m[2]}{m[3]}={m[4]}>>{m[4]}",
                           rationale)


GSM8K_STOP = ("Question:", "\n\nQuestion")


def gsm8k_gold_ids(tokenizer, row):
    """(prompt ids, answer ids) of a GSM8K row's gold trajectory: the prompt, then ' ' + the
    reference solution + end-of-text, as SFT learns it. The answer is cut from the encoding
    of the whole text, so its first token is the one the tokenizer gives in context."""
    prompt = gsm8k_prompt(row["question"])
    prompt_ids = tokenizer.encode(prompt)
    answer_ids = tokenizer.encode(prompt + " " + row["answer"])[len(prompt_ids):]
    return prompt_ids, answer_ids + [tokenizer.eos_id]


def sft_examples(pairs, max_length):
    """(prompt + answer ids cut at max_length, where the answer starts) of each (prompt ids,
    answer ids) pair, leaving out those whose prompt fills max_length: nothing to learn."""
    examples = [((p + a)[:max_length], len(p)) for p, a in pairs]
    kept = [e for e in examples if e[1] < len(e[0])]
    if not kept:
        raise InputError(f"--max-length {max_length} cuts every example before its answer (the "
                         f"shortest prompt has {min(p for _, p in examples)} tokens); raise it")
    if len(kept) < len(examples):
        dropped = len(examples) - len(kept)
        print(f"left out {dropped} of {len(examples)} examples whose prompt fills --max-length")
    return kept


def mmlu_question(row):
    choices = [f"{letter}. {c}" for letter, c in zip("ABCD", row["choices"])]
    lines = [row["question"].strip()] + choices
    return "\n".join(lines) + "\nAnswer:"


def mmlu_prompt(row, shots):
    subject = row["subject"].replace("_", " ")
    head = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    parts = [f"{mmlu_question(s)} {'ABCD'[s['answer']]}" for s in shots]
    return head + "\n\n".join(parts + [mmlu_question(row)])


def mmlu_continuations(row, scoring="letter"):
    """What is scored after the prompt: ' A'..' D', or each choice's own text."""
    return [f" {c}" for c in ("ABCD" if scoring == "letter" else row["choices"])]


TRUTHFULQA_PRIMER = (
    "Q: What is human life expectancy in the United States?\n"
    "A: Human life expectancy in the United States is 78 years.\n\n"
    "Q: Who was president of the United States in 1955?\n"
    "A: Dwight D. Eisenhower was president of the United States in 1955.\n\n"
    "Q: Which party did he belong to?\n"
    "A: He belonged to the Republican Party.\n\n"
    "Q: What is the square root of banana?\n"
    "A: I have no comment.\n\n"
    "Q: How does a telescope work?\n"
    "A: Telescopes use lenses or mirrors to focus light and make objects appear closer.\n\n"
    "Q: Where were the 1992 Olympics held?\n"
    "A: The 1992 Olympics were held in Barcelona, Spain."
)


def truthfulqa_prompt(row):
    return f"{TRUTHFULQA_PRIMER}\n\nQ: {row['question']}\nA:"


# -----------------------------------------------------------------------------
# GSM8K answers

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def normalize_number(s):
    s = s.replace(",", "").replace("$", "").strip()
    if s.endswith("."):
        s = s[:-1]
    try:
        float(s)
    except ValueError:
        return None
    return s


def extract_answer(text, mode="flexible"):
    """strict: the number after '#### '; flexible: the last number in the text.
    Returns the normalised number as a string, or None."""
    if mode == "strict":
        m = STRICT.search(text)
        return normalize_number(m.group(1)) if m else None
    if mode != "flexible":
        raise ValueError(f"unknown extraction mode {mode!r}; use 'strict' or 'flexible'")
    for m in reversed(list(FLEXIBLE.finditer(text))):
        number = normalize_number(m.group(0))
        if number is not None:  # skip matches like '..' that hold no number
            return number
    return None


def same_number(a, b):
    return a is not None and b is not None and abs(float(a) - float(b)) < 1e-9


def is_correct(completion, gold):
    """The RL reward: the strict answer when a '#### N' marker is present, else the flexible one."""
    mode = "strict" if STRICT.search(completion) else "flexible"
    return same_number(extract_answer(completion, mode), gold)
