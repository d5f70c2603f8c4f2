"""
Rollout-state drift: how far has training moved the distribution of states a model
visits, measured against the base model (the paper's section 5 and prediction P4).

For the base model and each run, one rollout per prompt on a fixed prompt set (default 200
GSM8K test prompts, temperature 1.0). Sample i of every model draws from the same seed,
so the models differ only where their distributions differ. Prefix states s_t = (x, y_<t)
are taken every --stride tokens (and at the end of each rollout), embedded, and compared
with the base states:

  mmd2                MMD^2, RBF kernel; bandwidth fixed once from the *base* states
                      (median heuristic) so every run is measured with the same ruler;
                      unbiased for these paired samples: every mean over pairs of states
                      from different prompts, the p-value from swapping a prompt's two
                      sets of states (mmd2_test). mmd = sqrt(max(mmd2, 0)) beside it: the
                      paper's column is headed MMD without saying whether it is squared
  mmd2_unpaired       the plain unbiased MMD^2, as if the samples were independent. It sees
                      what the paired one cannot (how an answer relates to its own
                      question), but the pairs of one prompt pull it below zero when
                      nothing changed, and its p-value is then meaningless (near 1)
  centroid            distance between the mean feature vectors
  sliced_wasserstein  mean 1-D Wasserstein-1 distance over random projections
  jaccard             mean Jaccard distance between the word sets of paired rollouts
  kl_to_base          RL's Razor's predictor of forgetting: KL(base || run) over the
                      vocabulary at the states of the base's own rollouts, summed over each
                      rollout, averaged over prompts (kl_to_base)

With them, state_nll_reference: the base's per-token NLL of its own temperature-1 samples on
the first --prompts train questions (own_samples_nll), against which results.py reads each run's
logged state_nll_base, the base's NLL of the tokens its loss is computed on: the run's state
distance.

Features: --features lexical (hashed word unigrams and bigrams, L2-normalised, as in the
paper) or --features hidden (the base model's mean-pooled last hidden state of each
state, which sees meaning rather than surface words). --embed state (the paper's)
embeds the whole state, prompt included; --embed generated embeds only y_<t, the part
the model wrote (hidden features still read the prompt, and pool over y_<t only), since
the prompts are the same for every model and only dilute the difference. Results go to
<run>/drift.json, or the file named by --save-as.

    python drift.py out/mild out/stress --model Qwen/Qwen3-0.6B-Base
"""
import argparse
import json
import os
import re
import zlib

import torch
from tqdm import tqdm

import data
import lora
import model as M
import train
from plumbing import cli, processes, provenance, runs
from plumbing.files import InputError, read_json, write_json
from sample import Sampling, generate, left_pad

# MMD^2 values this close count as equal (float64 sums over up to ~10^7 kernel entries)
ROUNDING = 1e-12

WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


# -----------------------------------------------------------------------------
# features

def words(text):
    return WORD.findall(text.lower())


def lexical_features(texts, buckets=4096):
    """Hashed word unigrams and bigrams, L2-normalised, (N, buckets). crc32 rather than
    Python's hash(), which is randomised per process."""
    rows, columns = [], []  # one entry per gram, counted into X in one call
    for i, text in enumerate(texts):
        w = words(text)
        grams = w + [f"{a} {b}" for a, b in zip(w, w[1:])]
        rows += [i] * len(grams)
        columns += [zlib.crc32(gram.encode()) % buckets for gram in grams]
    X = torch.zeros(len(texts), buckets)
    X.index_put_((torch.tensor(rows, dtype=torch.long), torch.tensor(columns, dtype=torch.long)),
                 torch.ones(len(rows)), accumulate=True)
    return X / X.norm(dim=1, keepdim=True).clamp(min=1e-12)


@torch.no_grad()
def hidden_features(model, states, batch_size=16, starts=None):
    """Mean-pooled last hidden state of the base model (adapter off) for each state, pooled
    over its positions from starts[i] on (all of them when starts is None)."""
    out = []
    device = model.lm_head.weight.device
    starts = starts or [0] * len(states)
    with lora.use_adapter(model, None):
        for i in range(0, len(states), batch_size):
            batch = states[i:i + batch_size]
            ids, mask = left_pad(batch, 0, device)
            h = model(ids, attention_mask=mask, hidden_only=True).float()
            # left padding: state j's token k sits at column width - len(state j) + k
            first = torch.tensor([ids.shape[1] - len(s) + start for s, start in
                                  zip(batch, starts[i:i + batch_size])], device=device)
            columns = torch.arange(ids.shape[1], device=device)
            pool = (columns[None, :] >= first[:, None]).to(h.dtype)
            out.append(((h * pool[..., None]).sum(1) / pool.sum(1, keepdim=True)).cpu())
    return torch.cat(out)


# -----------------------------------------------------------------------------
# distances (pure tensor functions)

def sq_dists(X, Y):
    return (X.pow(2).sum(1)[:, None] + Y.pow(2).sum(1)[None, :] - 2 * X @ Y.T).clamp(min=0)


def median_bandwidth(X, max_points=2000):
    """Median heuristic: sigma = median pairwise distance among the (base) states."""
    X = X[:max_points].double()
    d = sq_dists(X, X)
    off = d[~torch.eye(len(X), dtype=torch.bool)]
    return off[off > 0].median().sqrt().item() if (off > 0).any() else 1.0


def mmd2_from_kernel(K, is_x, groups):
    """MMD^2 for each column of labels is_x (N, P), 1 marking the first sample, from the
    pooled kernel matrix K (N, N) whose entries between states of one group are zero:
    each of the three means is over pairs of states from different groups (groups (N,),
    ids 0..G-1). With every state a group of its own this is the usual unbiased estimator;
    with a group per prompt, see mmd2_test."""
    s, t = is_x.to(K.dtype), 1 - is_x.to(K.dtype)
    G = int(groups.max()) + 1

    def pairs(a, b):  # (i, j) with a_i and b_j set, from different groups
        per_group = lambda c: torch.zeros(G, c.shape[1], dtype=c.dtype).index_add_(0, groups, c)
        return a.sum(0) * b.sum(0) - (per_group(a) * per_group(b)).sum(0)

    xx = (s * (K @ s)).sum(0) / pairs(s, s)
    yy = (t * (K @ t)).sum(0) / pairs(t, t)
    xy = (s * (K @ t)).sum(0) / pairs(s, t)
    return xx + yy - 2 * xy


def mmd2_test(X, Y, bandwidth, permutations=200, seed=0, x_prompts=None, y_prompts=None):
    """(MMD^2 with RBF kernel exp(-|x-y|^2 / (2 bandwidth^2)), permutation p-value).

    Without prompts: the unbiased estimator over independent samples, and a p-value from
    random relabellings. With x_prompts and y_prompts (the prompt index of each state),
    the two samples are paired: every model answered the same prompts, with the same seed
    per prompt, and each rollout gives several states. A state of the base and one of a run
    from the same prompt are then alike whatever the models do; the usual estimator counts
    those pairs in its cross term and comes out below zero, and a relabelling that splits
    them looks larger than the truth, so p = 1. Here every mean is over pairs of states
    from different prompts, independent as the formula needs, so the estimate has
    expectation 0 when the models agree; the permutations swap the labels of one prompt's
    two sets of states at once, the exchange that equal models allow (a sign-flip test)."""
    Z = torch.cat([X, Y]).double()
    K = torch.exp(-sq_dists(Z, Z) / (2 * bandwidth ** 2))
    g = torch.Generator().manual_seed(seed)
    first = torch.zeros(len(Z), dtype=torch.bool)
    first[:len(X)] = True
    labels = torch.empty(len(Z), 1 + permutations, dtype=torch.bool)
    labels[:, 0] = first
    if x_prompts is None:
        groups = torch.arange(len(Z))
        for p in range(1, permutations + 1):
            labels[:, p] = False
            labels[torch.randperm(len(Z), generator=g)[:len(X)], p] = True
    else:
        both = torch.cat([torch.as_tensor(x_prompts), torch.as_tensor(y_prompts)])
        _, groups = both.unique(return_inverse=True)
        flips = torch.rand(int(groups.max()) + 1, permutations, generator=g) < 0.5
        labels[:, 1:] = first[:, None] ^ flips[groups]
    K.masked_fill_(groups[:, None] == groups[None, :], 0.0)
    stats = mmd2_from_kernel(K, labels, groups)
    # equal up to rounding counts as equal: two models that roll out the same states give
    # every swap the same MMD^2, so p = 1, and an MMD^2 of 0 rather than a stray -2e-16
    p_value = (1 + (stats[1:] >= stats[0] - ROUNDING).sum().item()) / (1 + permutations)
    observed = stats[0].item()
    return (0.0 if abs(observed) < ROUNDING else observed), p_value


def sliced_wasserstein(X, Y, projections=64, seed=0):
    """Mean over random unit directions of the 1-D Wasserstein-1 distance between the
    projected samples, compared at a common grid of quantiles (sizes may differ)."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(X.shape[1], projections, generator=g, dtype=torch.float64)
    D = D / D.norm(dim=0, keepdim=True)
    q = torch.linspace(0, 1, max(len(X), len(Y)), dtype=torch.float64)
    px = torch.quantile(X.double() @ D, q, dim=0)
    py = torch.quantile(Y.double() @ D, q, dim=0)
    return (px - py).abs().mean().item()


def jaccard_distance(texts_a, texts_b):
    """Mean over pairs (a_i, b_i) of 1 - |A and B| / |A or B| on word sets."""
    out = []
    for a, b in zip(texts_a, texts_b):
        A, B = set(words(a)), set(words(b))
        out.append(1 - len(A & B) / len(A | B) if A | B else 0.0)
    return sum(out) / max(1, len(out))


# -----------------------------------------------------------------------------
# states

def rollout_states(rollouts, stride):
    """Token ids of every prefix state (x, y_<t), t = stride, 2*stride, ... and the end;
    the prompt's length in each, and its prompt's index."""
    states, prompt_lengths, prompts = [], [], []
    for r in rollouts:
        cuts = list(range(stride, len(r.completion_ids) + 1, stride))
        if not cuts or cuts[-1] != len(r.completion_ids):
            cuts.append(len(r.completion_ids))
        states += [r.sequence[:r.start + t] for t in cuts]
        prompt_lengths += [r.start] * len(cuts)
        prompts += [r.prompt_index] * len(cuts)
    return states, prompt_lengths, prompts


def collect(model, tok, prompts, rollout):
    """One rollout of each prompt, prompt i's drawn from seed + i, and its states; rollout:
    the flags of ROLLOUT by name."""
    first, last = processes.split(len(prompts))  # under torchrun, each process rolls out its share
    sampling = Sampling(max_new_tokens=rollout["max_new_tokens"], stop=data.GSM8K_STOP,
                        temperature=rollout["temperature"], seed=rollout["seed"] + first,
                        progress=True)
    rollouts = generate(model, tok, prompts[first:last], sampling)
    for r in rollouts:
        r.prompt_index += first
    rollouts = processes.joined(rollouts)
    states, prompt_lengths, prompts = rollout_states(rollouts, rollout["stride"])
    return dict(states=states, prompt_lengths=prompt_lengths, prompts=prompts,
                texts=[r.text for r in rollouts])


def featurize(model, tok, rollout_set, kind, embed="state"):
    """Features (N, d) of a collect() result's states, and each one's prompt index.
    embed="generated" keeps each state's generated part only, and leaves out states with
    none (an empty completion)."""
    states, starts, prompts = (rollout_set[k] for k in ("states", "prompt_lengths", "prompts"))
    if embed == "state":
        starts = [0] * len(states)
    else:
        kept = [i for i, (s, start) in enumerate(zip(states, starts)) if len(s) > start]
        states, starts, prompts = ([v[i] for i in kept] for v in (states, starts, prompts))
    if kind == "lexical":
        texts = [tok.decode(s[start:]) for s, start in zip(states, starts)]
        return lexical_features(texts), prompts
    return hidden_features(model, states, starts=starts), prompts


# -----------------------------------------------------------------------------
# where states lie, and how far the policy moved there: under the base model's eyes

@torch.no_grad()
def continuation_nll(model, tok, pairs):
    """The base's (adapter off) mean per-token NLL of each (prompt, continuation)'s continuation."""
    sequences, starts = [p + c for p, c in pairs], [len(p) for p, _ in pairs]
    total, n = train.base_nll(train.base_logprobs(model, sequences, starts, tok.pad_id,
                                                  train.Passes(max_tokens=4096)))
    return total / max(1, n)


@torch.no_grad()
def own_samples_nll(model, tok, rows, max_new_tokens, seed=0):
    """The base's mean per-token NLL of its own temperature-1 samples on rows' prompts (an
    on-policy method's first states): the reference a run's state_nll_base is read against."""
    with lora.use_adapter(model, None):
        own = generate(model, tok, [data.gsm8k_prompt(r["question"]) for r in rows],
                       Sampling(max_new_tokens=max_new_tokens, temperature=1.0,
                                stop=data.GSM8K_STOP, seed=seed))
    return continuation_nll(model, tok, [(r.prompt_ids, r.completion_ids) for r in own
                                         if r.completion_ids])


@torch.no_grad()
def offpolicy_gap(model, tok, rows, max_new_tokens, seed=0):
    """(gold, own): the base's mean per-token NLL of the gold answers of rows (SFT's states) and
    of its own samples on the same prompts (own_samples_nll); their difference is how far
    off-policy SFT's data is for the base."""
    gold = continuation_nll(model, tok, [data.gsm8k_gold_ids(tok, r) for r in rows])
    return gold, own_samples_nll(model, tok, rows, max_new_tokens, seed)


def report_offpolicy_gap(model_path, data_dir, prompts=200, max_new_tokens=96):
    """Print offpolicy_gap of a base model on the first train questions (toy.py's at its
    defaults)."""
    rows = data.load_gsm8k("train", data_dir)[:prompts]
    gold, own = offpolicy_gap(*M.load(model_path), rows, max_new_tokens)
    print(f"the base's per-token NLL of SFT's gold answers {gold:.3f}, of its own temperature-1 "
          f"samples on the same prompts {own:.3f}: SFT's states lie {gold - own:.3f} nats per "
          f"token off the base's own")
    return gold, own


def full_rollouts(rollout_set):
    """(token ids, prompt length) of each whole rollout in a collect() result: its longest state."""
    longest = {}
    keys = ("states", "prompt_lengths", "prompts")
    for state, start, prompt in zip(*(rollout_set[k] for k in keys)):
        if prompt not in longest or len(state) > len(longest[prompt][0]):
            longest[prompt] = (state, start)
    return [longest[p] for p in sorted(longest)]


@torch.no_grad()
def kl_to_base(model, adapter, rollouts, batch_size=16, base_states=None):
    """RL's Razor's predictor of forgetting (Shenfeld et al. 2025, arXiv 2509.04259):
    KL(pi_base(.|s) || pi(.|s)), exactly over the vocabulary, at every state s of the base's
    own rollouts (token ids, prompt length), summed over each rollout, averaged over rollouts.
    base_states, a dict, keeps the base's side of each batch for the next run's call."""
    total, written = 0.0, [r for r in rollouts if len(r[0]) > r[1]]  # an empty one has no state
    base_states = {} if base_states is None else base_states
    for i in range(0, len(written), batch_size):
        sequences, starts = map(list, zip(*written[i:i + batch_size]))
        if i not in base_states:
            base_states[i] = train.frozen_states(model, None, sequences, starts)[0]
        run_h = train.frozen_states(model, adapter, sequences, starts)[0]
        kl = train.token_kl(model, run_h, base_states[i], model.lm_head.weight, "forward")
        total += kl.sum().item()
    return total / max(1, len(rollouts))


# collect()'s flags: what decides the rollouts and their states
ROLLOUT = ("max_new_tokens", "temperature", "stride", "seed")
BASE_CACHE = "drift_base.json"  # in a study's folder: the base's rollouts, for every run's drift


def add_drift_args(p):
    p.add_argument("--prompts", default=200, help="first N GSM8K test questions: the prompt set",
                   type=cli.number(int, 2, why="MMD^2 compares states of different prompts"))
    p.add_argument("--max-new-tokens", type=cli.number(int, 1), default=256, help="longest rollout")
    p.add_argument("--temperature", type=cli.number(float, 0), default=1.0,
                   help="rollout temperature")
    p.add_argument("--stride", type=cli.number(int, 1), default=16,
                   help="take a prefix state every N generated tokens")
    p.add_argument("--features", choices=["lexical", "hidden"], default="lexical",
                   help="state embedding")
    p.add_argument("--embed", choices=["state", "generated"], default="state",
                   help="embed the whole state (x, y_<t), or only its generated part y_<t")
    p.add_argument("--permutations", type=cli.number(int, 1), default=200,
                   help="permutations for the MMD p-value")
    p.add_argument("--projections", type=cli.number(int, 1), default=64,
                   help="random directions of the sliced Wasserstein distance")
    p.add_argument("--seed", type=int, default=0, help="rollout and permutation seed")


def base_rollouts(model, tok, prompts, train_rows, out, rollout):
    """The base model's rollouts of the prompts (collect with the flags in rollout) and its
    own_samples_nll on the train rows, cached in out/drift_base.json for the runs measured
    later: a cache serves only rollouts of the same prompts (another --data-dir has others)
    taken with the same numbers, since another dtype or device rounds differently and the
    paired estimator would count that as drift."""
    weight = model.lm_head.weight
    settings = dict(model=model.name_or_path, prompts=len(prompts), **rollout,
                    device=weight.device.type, dtype=str(weight.dtype).removeprefix("torch."),
                    prompts_sha256=provenance.digest(prompts),
                    train_sha256=provenance.digest(train_rows))
    base = cached(out)
    if base is None or base["settings"] != settings or "prompts" not in base:
        lora.set_adapter(model, None)
        model.eval()
        own = own_samples_nll(model, tok, train_rows, rollout["max_new_tokens"], rollout["seed"])
        base = dict(settings=settings, state_nll_reference=own,
                    **collect(model, tok, prompts, rollout))
        if not processes.RANK:  # under torchrun, one process writes
            os.makedirs(out, exist_ok=True)
            write_json(os.path.join(out, BASE_CACHE), base)
    return base


def cached(out):
    """The base's rollouts cached in out/drift_base.json, or None (a damaged cache is made
    again): their settings are the study's, which a run's drift is measured with by default."""
    try:
        return read_json(os.path.join(out, BASE_CACHE))
    except (OSError, InputError):
        return None


def json_name(text):
    """An argparse type: --save-as, a file name ending in .json (written into each run folder)."""
    if os.path.basename(text) != text or not text.endswith(".json"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a file name ending in .json (it is "
                                         f"written into each run folder)")
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders to compare with the base model")
    cli.add_model_args(p)
    p.add_argument("--out", default=None,
                   help="the study folder, with the base's rollouts (drift_base.json), whose "
                        "flags a run takes where not given (default: the first run's parent)")
    p.add_argument("--save-as", default="drift.json", type=json_name,
                   help="file name of the result in each run folder (e.g. another name for "
                        "another --embed)")
    add_drift_args(p)
    defaults = cli.left_unset(p, ("prompts", *ROLLOUT))  # not given: as the base's rollouts were
    args = p.parse_args(argv)
    args.out = args.out or os.path.dirname(os.path.normpath(args.runs[0])) or "."
    cli.model_and_data_from(args, *map(provenance.run_record, args.runs))
    cli.unless_given(args, defaults, (cached(args.out) or {}).get("settings", {}),
                     os.path.join(args.out, BASE_CACHE))
    for run in args.runs:
        runs.check_run_folder(run, args.model)
    print(vars(args))
    model, tok = M.load(args.model, *cli.device_from_args(args))
    test, train_rows = (data.load_gsm8k(split, args.data_dir) for split in ("test", "train"))
    if args.prompts > len(test):  # else fewer prompts than asked, and drift.json would say not so
        raise InputError(f"--prompts {args.prompts}: the GSM8K test split holds {len(test)} "
                         f"questions; pass --prompts {len(test)} or fewer")
    prompts = [data.gsm8k_prompt(r["question"]) for r in test[:args.prompts]]
    rollout = {k: getattr(args, k) for k in ROLLOUT}
    base = base_rollouts(model, tok, prompts, train_rows[:args.prompts], args.out, rollout)
    rollouts = full_rollouts(base)
    X, x_prompts = featurize(model, tok, base, args.features, args.embed)
    bandwidth = median_bandwidth(X)
    base_states = {}  # the base's side of kl_to_base, computed for the first run, read by the rest

    for i, run in enumerate(tqdm(args.runs, desc="drift")):
        lora.load_adapter(model, run, name=f"run{i}")
        model.eval()
        ours = collect(model, tok, prompts, rollout)
        Y, y_prompts = featurize(model, tok, ours, args.features, args.embed)
        mmd2, p_value = mmd2_test(X, Y, bandwidth, args.permutations, args.seed, x_prompts,
                                  y_prompts)
        unpaired, unpaired_p = mmd2_test(X, Y, bandwidth, args.permutations, args.seed)
        sha = model.lora_config[f"run{i}"]["sha256"]
        result = dict(mmd2=mmd2, mmd=max(mmd2, 0.0) ** 0.5, p_value=p_value,
                      mmd2_unpaired=unpaired, p_value_unpaired=unpaired_p, bandwidth=bandwidth,
                      features=args.features, embed=args.embed,
                      centroid=(X.mean(0) - Y.mean(0)).norm().item(),
                      sliced_wasserstein=sliced_wasserstein(X, Y, args.projections, args.seed),
                      jaccard=jaccard_distance(base["texts"], ours["texts"]),
                      kl_to_base=kl_to_base(model, f"run{i}", rollouts, base_states=base_states),
                      state_nll_reference=base["state_nll_reference"], n_states_base=len(X),
                      n_states_run=len(Y), settings=base["settings"],
                      fingerprint=provenance.fingerprint("drift", vars(args), sha))
        if not processes.RANK:
            write_json(os.path.join(run, args.save_as), result)
        print(f"{run}: " + json.dumps({k: v for k, v in result.items() if k != "settings"}))


if __name__ == "__main__":
    cli.run_script(main)
