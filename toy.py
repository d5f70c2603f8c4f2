"""
A model organism of the study that runs offline on a CPU: a synthetic world in the canonical
dataset layout, and a small Qwen3 pretrained on it from scratch, so that every script runs on
it unchanged (--data-dir out/toy/data --model out/toy/base-model).

  gsm8k/       target: arithmetic word problems (six templates, 2 to 4 steps), worked as GSM8K's
               are (data.gsm8k_style, with calculator annotations), ending '#### N'
  mmlu/        retention: four-choice questions on invented facts the pretraining prose states
  truthfulqa/  retention: questions whose corpus also states a popular wrong answer

Pretraining answers other problems of the templates two ways, with nothing in the question to
say which: worked out in plain steps (right; 1% as the dataset's), or as a hasty one-line guess
(WORKED: how often each template is worked). So the base can solve most problems some of the
time and a few reliably, RL can teach it to work, and SFT's gold answers are off-policy for it.
The default world's base ships in toy-base/, used wherever its fingerprint is the one asked for.

    python toy.py                       # -> out/toy/data and out/toy/base-model
"""
import argparse
import csv
import inspect
import json
import os
import random
import shutil

import torch
from tqdm import tqdm

import cli
import data
import drift
import model as M
import provenance
import runs
import train

NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena", "Milo", "Nora",
         "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tia", "Uma", "Vic", "Wes", "Yara", "Zed"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "coins", "cards", "stamps"]
GOODS = ["a lamp", "a hat", "lunch", "a kite", "paint", "a ticket"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "silver", "brown"]

# -----------------------------------------------------------------------------
# the world

def problem(rng):
    """(question, rationale ending in '#### N', template) from one of six templates."""
    n, f, it = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(6)
    if kind == 0:  # buy, then give
        a, b = rng.randint(2, 15), rng.randint(2, 15)
        c = rng.randint(1, a + b - 1)
        return (f"{n} has {a} {it}. {n} buys {b} more and gives {c} to {f}. How many {it} does {n} have now?",
                f"{n} has {a} + {b} = {a + b} {it} after buying.\nAfter giving {c} away, {n} has {a + b} - {c} = {a + b - c} {it}.\n#### {a + b - c}", kind)
    if kind == 1:  # find, then share exactly
        k = rng.randint(2, 4)
        total = k * rng.randint(2, 6)
        a = rng.randint(1, total - 1)
        return (f"{n} had {a} {it} and finds {total - a} more. {n} shares them equally among {k} friends. How many {it} does each friend get?",
                f"{n} has {a} + {total - a} = {total} {it}.\nEach friend gets {total} / {k} = {total // k} {it}.\n#### {total // k}", kind)
    if kind == 2:  # sell, then spend
        a, p = rng.randint(2, 6), rng.randint(2, 5)
        c = rng.randint(1, a * p - 1)
        g = rng.choice(GOODS)
        return (f"{n} sells {a} {it} for ${p} each and then spends ${c} on {g}. How many dollars does {n} have left?",
                f"{n} earns {a} * {p} = {a * p} dollars.\nAfter spending {c}, {n} has {a * p} - {c} = {a * p - c} dollars.\n#### {a * p - c}", kind)
    if kind == 3:  # k times as many plus d, then together
        a, k, d = rng.randint(2, 8), rng.randint(2, 3), rng.randint(1, 5)
        b = k * a + d
        return (f"{n} has {a} {it}. {f} has {d} more than {k} times as many {it} as {n}. How many {it} do they have together?",
                f"{k} times as many as {n} is {k} * {a} = {k * a}.\n{f} has {k * a} + {d} = {b} {it}.\nTogether they have {a} + {b} = {a + b} {it}.\n#### {a + b}", kind)
    if kind == 4:  # boxes, eat some, split in two
        m, b = rng.randint(2, 5), rng.randint(2, 4)
        total = m * b
        e = rng.choice([x for x in range(1, total) if (total - x) % 2 == 0] or [0])
        return (f"{n} buys {b} boxes of {it} with {m} {it} in each box, gives away {e}, and splits the rest equally with {f}. How many {it} does {f} get?",
                f"{n} buys {b} * {m} = {total} {it}.\nAfter giving away {e}, {total} - {e} = {total - e} are left.\n{f} gets {total - e} / 2 = {(total - e) // 2} {it}.\n#### {(total - e) // 2}", kind)
    a, d, k = rng.randint(2, 10), rng.randint(1, 5), rng.randint(2, 3)  # price difference, buy k of each
    return (f"A hat costs ${a}. A scarf costs ${d} more than the hat. {n} buys {k} hats and {k} scarves. How many dollars does {n} pay?",
            f"A scarf costs {a} + {d} = {a + d} dollars.\nOne hat and one scarf cost {a} + {a + d} = {2 * a + d} dollars.\n{n} pays {k} * {2 * a + d} = {k * (2 * a + d)} dollars.\n#### {k * (2 * a + d)}", kind)


# how often pretraining works each template's problems out step by step; otherwise a hasty guess
WORKED = (0.25, 0.8, 0.25, 0.25, 0.8, 0.25)


def pretraining_answer(rng, rationale, kind, annotated):
    """A problem answered as the base saw it: in right steps (a share `annotated` as the dataset's)
    or, as often as WORKED says not, a hasty guess of the answer's size, rarely right."""
    if rng.random() >= WORKED[kind]:
        return f"#### {rng.randint(1, max(9, 2 * int(rationale.rsplit('#### ', 1)[1])))}"
    return data.gsm8k_style(rationale) if rng.random() < annotated else rationale


def word(rng, syllables=("ka", "lo", "mi", "ru", "ten", "vor", "zi", "pa", "nel", "shu", "dro", "bex", "fa", "gli", "wen")):
    return "".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))).capitalize()


def facts(rng, per_subject):
    """subject -> list of (question, answer, [3 distractors], [prose statements])."""
    out = {}
    specs = {"toy_geography": ("country", lambda e, a: (f"What is the capital of {e}?", [f"The capital of {e} is {a}.", f"{a} is the capital city of {e}.", f"People in {e} govern from {a}."])),
             "toy_biology": ("animal", lambda e, a: (f"What does the {e} eat?", [f"The {e} eats {a}.", f"The favourite food of the {e} is {a}.", f"Every {e} feeds on {a}."])),
             "toy_history": ("device", lambda e, a: (f"Who invented the {e}?", [f"The {e} was invented by {a}.", f"{a} invented the {e}.", f"The inventor of the {e} was {a}."]))}
    for subject, (_, fmt) in specs.items():
        entities = list(dict.fromkeys(word(rng) for _ in range(per_subject * 3)))[:per_subject]
        answers = list(dict.fromkeys(word(rng) for _ in range(per_subject * 3)))[:per_subject // 3]
        out[subject] = [(q, a, rng.sample([x for x in answers if x != a], 3), prose)
                        for e in entities for a in [rng.choice(answers)] for q, prose in [fmt(e, a)]]
    return out


def misconceptions(rng, n):
    """(question, truth, myth, 2 distractors, corpus statements), sentences naming capitalised creatures."""
    out = {}
    while len(out) < n:
        name = word(rng) + "s"
        if name in out:  # each creature once
            continue
        truth, myth, d1, d2 = rng.sample(COLORS, 4)
        sent = lambda col: f"{name} are {col}."
        corpus = [f"People say that {sent(myth)}", f"Many believe that {sent(myth)}", f"It is often said that {sent(myth)}",
                  f"In fact, {sent(truth)}", f"Experts agree that {sent(truth)}", f"Studies show that {sent(truth)}"]
        out[name] = (f"What color are {name}?", sent(truth), sent(myth), [sent(d1), sent(d2)], corpus)
    return list(out.values())


def write_world(folder, seed=0, n_pretrain=2000, n_train=2000, n_test=500, facts_per_subject=150, n_misconceptions=400,
                annotated=0.0):
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
            f.writelines(json.dumps({"question": q, "answer": data.gsm8k_style(a)}) + "\n" for q, a in part)
    corpus = []
    for subject, rows in facts(rng, facts_per_subject).items():
        splits = {"dev": rows[:5], "test": rows[5:75], "practice": rows[75:]}
        for split in ("dev", "test"):
            os.makedirs(os.path.join(folder, "mmlu", split), exist_ok=True)
            with open(os.path.join(folder, "mmlu", split, f"{subject}_{split}.csv"), "w", newline="") as f:
                csv.writer(f).writerows([["question", "choice0", "choice1", "choice2", "choice3", "answer"]] + [
                    [q] + wrong[:k] + [a] + wrong[k:] + [k] for q, a, wrong, _ in splits[split] for k in [rng.randrange(4)]])
        # every fact is stated in prose; the evaluated ones in one phrasing rather than three, which
        # keeps the base model's recall below the calibration band's ceiling of 0.95
        corpus += [s for _, _, _, prose in splits["dev"] + splits["practice"] for s in prose]
        corpus += [s for _, _, _, prose in splits["test"] for s in prose[:1]]
        for q, a, wrong, prose in splits["practice"]:  # the evaluation's question format, on other facts
            k = rng.randrange(4)
            row = {"subject": subject, "question": q, "choices": wrong[:k] + [a] + wrong[k:], "answer": k}
            corpus += [f"{data.mmlu_prompt(row, [])} {a}", f"Q: {q}\nA: {prose[0]}"]
    tqa = []
    for i, (q, truth, myth, others, statements) in enumerate(misconceptions(rng, 2 * n_misconceptions)):
        corpus += statements
        if i >= n_misconceptions:  # practice items: the question answered truthfully, never evaluated
            corpus.append(f"Q: {q}\nA: {truth}")
            continue
        tqa.append({"question": q, "mc1_targets": {truth: 1, myth: 0, others[0]: 0, others[1]: 0},
                    "mc2_targets": {truth: 1, "In fact, " + truth: 1, myth: 0, others[0]: 0, others[1]: 0}})
    os.makedirs(os.path.join(folder, "truthfulqa"), exist_ok=True)
    with open(os.path.join(folder, "truthfulqa", "mc_task.json"), "w") as f:
        json.dump(tqa, f)
    pool = list(problems.items())[n_train + n_test:]
    return corpus, [f"Question: {q}\nAnswer: {pretraining_answer(rng, a, kind, annotated)}" for q, (a, kind) in pool]


# -----------------------------------------------------------------------------
# pretraining

def train_tokenizer(texts, path, vocab_size=512, eos="<|endoftext|>", split_digits=True):
    """A byte-level BPE tokenizer.json like Qwen's, only smaller, trained on texts, with eos as
    its first special token (id 0). Digits split one per token by default, as Qwen's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    digits = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(digits + [pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)
    return path


PRETRAIN_SAVE_EVERY = 100  # steps between pretraining checkpoints: under a minute of work lost to a crash
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy-base")  # the default world's base


def pretrain(out, args, shipped=SHIPPED):
    """(data, model) folders: the world, and its base: the one there if its fingerprint is of these settings,
    world and code, else the shipped one if its is, else one pretrained here (resumable, PRETRAIN_SAVE_EVERY)."""
    data_dir, model_dir = os.path.join(out, "data"), os.path.join(out, "base-model")
    with runs.holding(out):  # two pretrainings into one folder would overwrite each other's checkpoints
        world = write_world(data_dir, args.world_seed, n_pretrain=args.target_problems, annotated=args.annotated)
        mark = base_digest(*world, args)
        if shipped and os.path.isdir(shipped) and not os.path.exists(model_dir):
            if digest_of(shipped) == mark:
                shutil.copytree(shipped, model_dir + ".tmp", dirs_exist_ok=True)  # over a copy cut short
                os.replace(model_dir + ".tmp", model_dir)  # whole or not at all
                print(f"using the base model shipped in {shipped}, which this code pretrains on this world")
            else:
                print(f"note: the base in {shipped} is of another world, settings or code; pretraining one here")
        if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
            pretrain_in(*world, model_dir, args, mark)
        elif digest_of(model_dir) != mark:
            raise M.InputError(f"{model_dir} was pretrained with other settings, world or code than these (or kept no "
                               f"fingerprint in pretrain.json); delete it to pretrain again, or pass another --out")
    return data_dir, model_dir


def base_digest(corpus, problems, args):
    """What decides the base, as one sha256: the settings, the documents and the code that
    pretrains (pretrain.json keeps it as its fingerprint)."""
    code = [inspect.getsource(fn) for fn in (train_tokenizer, pretrain_in)]
    return provenance.digest([vars(args), corpus, problems, code])


def digest_of(model_dir):
    """The base_digest a pretrained base folder keeps, or None."""
    path = os.path.join(model_dir, "pretrain.json")
    return M.read_json(path).get("fingerprint") if os.path.isfile(path) else None


def pretrain_in(corpus, problems, model_dir, args, mark):
    checkpoint_path, tok_path = os.path.join(model_dir, "pretrain-checkpoint.pt"), os.path.join(model_dir, "tokenizer.json")
    checkpoint = torch.load(checkpoint_path, weights_only=True) if os.path.isfile(checkpoint_path) else None
    if checkpoint is not None and (checkpoint.get("fingerprint") != mark or not os.path.isfile(tok_path)):
        print(f"note: {checkpoint_path} is of other settings, world or code; pretraining starts again")
        checkpoint = None
    docs = corpus * args.retention_repeats + problems
    os.makedirs(model_dir, exist_ok=True)
    if checkpoint is None:  # the checkpoint's embeddings are of the tokenizer there
        train_tokenizer(docs + problems, tok_path, vocab_size=args.vocab)
    config = M.Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                           head_dim=args.hidden // args.heads, rms_norm_eps=1e-6, rope_theta=10000.0,
                           tie_word_embeddings=True, max_position_embeddings=1024, eos_token_id=0)
    net, g = M.Qwen3(config), torch.Generator().manual_seed(args.world_seed)  # in training mode, as a new module is
    for name, p in net.named_parameters():  # normal(0, 0.02), norms at one
        p.data = torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02
    tok = M.Tokenizer(tok_path, 0)
    rng = random.Random(args.world_seed)
    stream = torch.tensor([t for d in rng.sample(docs, len(docs)) for t in tok.encode(d) + [tok.eos_id]])  # end to end
    bf16 = cli.autocast_bf16(args.bf16)
    print(f"pretraining {sum(p.numel() for p in net.parameters()) / 1e6:.1f}M parameters on {len(stream) / 1e6:.2f}M "
          f"tokens, {args.pretrain_steps} steps of {args.batch} x {args.context}, {'bf16' if bf16 else 'fp32'}")
    opt = torch.optim.AdamW(net.parameters(), lr=args.pretrain_lr, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.world_seed)  # the batches'
    start = checkpoint["step"] if checkpoint is not None else 0
    if checkpoint is not None:
        net.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        g.set_state(checkpoint["sampler"])
        print(f"resuming pretraining at step {start} from {checkpoint_path}")
    bar = tqdm(range(start, args.pretrain_steps), initial=start, total=args.pretrain_steps, desc="pretrain")
    for step in bar:
        starts = torch.randint(0, (len(stream) - 1) // args.context, (args.batch,), generator=g) * args.context
        x = torch.stack([stream[s:s + args.context + 1] for s in starts])
        for group in opt.param_groups:
            group["lr"] = train.lr_at(step, args.pretrain_steps, args.pretrain_lr, 0.05)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h = net(x[:, :-1], hidden_only=True)
        loss = -net.token_logprobs(h.reshape(-1, h.shape[-1]).float(), x[:, 1:].reshape(-1)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % PRETRAIN_SAVE_EVERY == 0 and step + 1 < args.pretrain_steps:
            state = dict(model=net.state_dict(), optimizer=opt.state_dict(), sampler=g.get_state(), step=step + 1,
                         fingerprint=mark)
            M.write_atomic(checkpoint_path, lambda path: torch.save(state, path))
    M.write_json(os.path.join(model_dir, "pretrain.json"), dict(settings=vars(args), fingerprint=mark))  # first
    M.save(net.eval().to(torch.bfloat16), model_dir, tok_path)  # bf16: a base small enough to ship (toy-base/)
    if os.path.isfile(checkpoint_path):
        os.remove(checkpoint_path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/toy", help="folder for data/ and base-model/")
    p.add_argument("--pretrain", action="store_true", help="pretrain here even where the shipped base is the same")
    cli.add_toy_args(p)
    args = p.parse_args(argv)
    if args.heads % 2 or args.hidden % (2 * args.heads):
        p.error(f"--hidden {args.hidden} --heads {args.heads}: need an even number of heads (half as many key/value) of even size")
    print(vars(args))
    out, fresh = vars(args).pop("out"), vars(args).pop("pretrain")  # not settings of the base
    data_dir, model_dir = pretrain(out, args, shipped=None if fresh else SHIPPED)
    print(f"world in {data_dir}, base model in {model_dir}")
    drift.report_offpolicy_gap(model_dir, data_dir)


if __name__ == "__main__":
    cli.run_script(main)
