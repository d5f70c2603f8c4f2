"""
Batched sampling with the KV cache: the one place where on-policy states are produced.

A *state* of an autoregressive policy is the prompt plus the prefix generated so far,
s_t = (x, y_<t). SFT trains on states taken from a fixed dataset; RL and OPD train on
states the current learner visits itself, and drift.py compares the states different
models visit. All of them get those states from generate() below, so "on-policy" means
one thing in this code base: tokens this function returned for the current weights, with
the log-probs the training pass (train.sequence_logprobs) gives them.

Prompts are left-padded into one batch and prefilled once; a prompt's n samples copy its
rows of the KV cache, and a prompt that opens another (OPD's cut points of one trajectory)
reads that one's. Each sample draws its randomness from a generator of its own, so it
does not depend on what else is in the batch. Off CUDA, finished rows leave the batch, so
that a long straggler does not make every other row pay for its tokens; on CUDA the
decode step is captured once as a CUDA graph at a fixed shape and replayed, since
launching a 0.6B model's hundreds of small kernels from Python costs more than running
them. An active LoRA adapter runs as the training pass runs it (lora.folded: folded into
its weights only in fp32, where folding keeps the policy).
"""
import os
from dataclasses import dataclass

import torch

import lora


@dataclass
class Rollout:
    prompt_ids: list
    completion_ids: list  # includes the end-of-text token when the model produced it
    logprobs: list  # log p(token | state) under the model itself (temperature 1), fp32
    text: str  # the decoded completion, cut before the first stop string
    finish_reason: str  # "eos", "stop" or "length" (opd.py: "data" for a gold solution)
    prompt_index: int = 0
    sample_index: int = 0

    @property
    def sequence(self):  # the whole trajectory, prompt then completion: the states lie along it
        return self.prompt_ids + self.completion_ids

    @property
    def start(self):  # where the completion begins in sequence
        return len(self.prompt_ids)


def left_pad(seqs, pad_id, device=None):
    """Token lists -> (ids, mask), both (B, T), padded on the left so that every row's next
    token goes into the same column. The mask, not the pad id, marks the padding."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, T - len(s):] = torch.tensor(s)
            mask[i, T - len(s):] = 1
    return ids.to(device), mask.to(device)


def draw(logits, temperature, uniforms):
    """Each row's next token from fp32 logits (rows, vocab), and its log-prob under the model
    itself (temperature 1). Greedy at temperature 0; otherwise by inverse CDF with each
    row's own U(0, 1) draw, uniforms (rows,), so that a row's randomness is its own."""
    if temperature == 0:
        token = logits.argmax(-1)
    else:
        cdf = (logits / temperature).softmax(-1).cumsum(-1)
        # the first token whose running sum reaches u of the total (u > 0: never a zero weight)
        target = (uniforms.clamp(min=2 ** -24) * cdf[:, -1])[:, None]
        token = torch.searchsorted(cdf, target).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)


def find_stop(text, stop):
    """Index of the earliest stop string in text, or -1."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else -1


def tokens_before_stop(tokenizer, ids, stop):
    """The longest start of a completion's token ids whose text lies before its first stop
    string: what a teacher's continuation teaches, without the opening of a new question."""
    cut = find_stop(tokenizer.decode(ids), stop)
    k = len(ids)
    while cut >= 0 and k and len(tokenizer.decode(ids[:k])) > cut:
        k -= 1
    return list(ids[:k])


def prefill(model, prompt_ids, n, pad_id, max_new_tokens):
    """The KV cache, key mask (R, width) and first fp32 logits of R = len(prompt_ids) * n rows,
    prompt-major, from one prefill of each prompt that no other prompt extends: a prompt's
    n samples, and a prompt that opens a longer one (OPD's cuts of one trajectory), read the
    longer one's cache, with its columns past their own end masked as padding is."""
    device = model.lm_head.weight.device
    hosts = [i for i, p in enumerate(prompt_ids) if not any(  # no longer prompt opens with p,
        len(q) > len(p) and q[:len(p)] == p or (q == p and j < i)  # and no earlier equal one
        for j, q in enumerate(prompt_ids))]
    ids, mask = left_pad([prompt_ids[h] for h in hosts], pad_id, device)
    cache = model.new_cache(len(hosts), ids.shape[1] + max_new_tokens)
    hidden = model(ids, attention_mask=mask, cache=cache, hidden_only=True)
    # each prompt's row, and the column after its last token: its row's end less what lies past
    host = [next(k for k, h in enumerate(hosts) if prompt_ids[h][:len(p)] == p) for p in prompt_ids]
    end = torch.tensor([ids.shape[1] - len(prompt_ids[hosts[k]]) + len(p)
                        for k, p in zip(host, prompt_ids)], device=device)
    host = torch.tensor(host, device=device)
    logits = model.lm_head(hidden[host, end - 1]).float()  # (prompts, vocab): each prompt's once
    if len(hosts) == len(prompt_ids) and n == 1:  # each prompt its own row, as most calls have it
        return cache, mask, logits
    rows = torch.arange(len(prompt_ids), device=device).repeat_interleave(n)  # each sample's prompt
    cache.select_rows(host[rows])
    mask = mask[host[rows]] * (torch.arange(ids.shape[1], device=device) < end[rows, None])
    return cache, mask, logits[rows]


def next_logits(model, ids, mask, cache):
    """fp32 logits (B, vocab) after each row's last token, as the training pass computes them."""
    hidden = model(ids, attention_mask=mask, cache=cache, hidden_only=True)
    return model.lm_head(hidden[:, -1]).float()


class FixedShapeDecoder:
    """The decode loop's model call at one batch size and cache length, its inputs in
    buffers updated in place, so that on CUDA the step is captured once as a CUDA graph and
    replayed for every token (use_graph), or run eagerly at the same fixed shape. Rows are
    never dropped here, as that would change the shapes: finished rows decode on, unread."""

    def __init__(self, model, cache, mask, use_graph):
        R, P = mask.shape
        self.model, self.cache, self.use_graph, self.graph = model, cache, use_graph, None
        self.tokens = torch.zeros(R, 1, dtype=torch.long, device=mask.device)
        self.positions = mask.sum(-1, keepdim=True) - 1  # advanced before each step
        self.key_mask = torch.zeros(R, 1, 1, cache.max_len, dtype=torch.bool, device=mask.device)
        self.key_mask[:, 0, 0, :P] = mask.bool()
        # advanced before each step
        cache.write_pos = torch.full((1,), P - 1, dtype=torch.long, device=mask.device)

    def step(self):
        return self.model.decode_step(self.tokens, self.positions, self.key_mask, self.cache)

    def __call__(self, tokens):
        self.tokens.copy_(tokens[:, None])
        self.positions += 1
        self.cache.write_pos += 1
        self.key_mask.index_fill_(-1, self.cache.write_pos, True)
        if not self.use_graph:
            return self.step()
        if self.graph is None:  # the first step runs eagerly on a side stream, then is captured
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                first = self.step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.step()
            return first
        self.graph.replay()
        return self.logits


@dataclass(frozen=True)
class Sampling:
    """How generate draws: n samples a prompt, at most max_new_tokens each, at temperature (0:
    greedy), cut at the first stop string; with a seed, sample r (prompt r // n) draws from its
    own generator, seed + r, whatever else is in the batch; progress: a bar over the tokens."""
    n: int = 1
    max_new_tokens: int = 256
    temperature: float = 1.0
    stop: tuple = ()
    seed: int | None = None
    progress: bool = False


@torch.no_grad()
def generate(model, tokenizer, prompts, sampling=Sampling(), decode="auto"):
    """Completions of prompts (strings or lists of token ids) drawn as sampling says, a list of
    Rollout, prompt-major. decode picks the loop, each giving the same tokens: "dropping"
    (finished rows leave the batch), "graph" (a captured CUDA graph), "fixed" (the graph's
    fixed-shape step run eagerly), or "auto": $STATES_DECODE, else graph on CUDA, else dropping."""
    cuda = model.lm_head.weight.device.type == "cuda"
    if decode == "auto":
        decode = os.environ.get("STATES_DECODE") or ("graph" if cuda else "dropping")
    if decode not in ("dropping", "fixed", "graph") or (decode == "graph" and not cuda):
        raise ValueError(f"decode={decode!r} (or $STATES_DECODE): use 'auto', 'dropping', 'fixed', "
                         f"or 'graph' on CUDA")
    prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("empty prompt: every prompt needs at least one token")
    if not prompt_ids:
        return []
    with lora.folded(model):
        return decode_loop(model, tokenizer, prompt_ids, sampling, decode)


def decode_loop(model, tokenizer, prompt_ids, sampling, decode):
    n, max_new_tokens, stop = sampling.n, sampling.max_new_tokens, tuple(sampling.stop)
    device = model.lm_head.weight.device
    R = len(prompt_ids) * n
    cache, mask, logits = prefill(model, prompt_ids, n, tokenizer.pad_id, max_new_tokens)
    decoder = (None if decode == "dropping"
               else FixedShapeDecoder(model, cache, mask, decode == "graph"))
    generators = None if sampling.seed is None else [
        torch.Generator().manual_seed(sampling.seed + r) for r in range(R)]
    tail = 4 * max(map(len, stop), default=0) + 4  # enough tokens to hold any stop string
    completions, logprobs, finish = [[] for _ in range(R)], [[] for _ in range(R)], ["length"] * R
    in_batch = list(range(R))  # which sample each row of the batch is
    steps = range(max_new_tokens)
    if sampling.progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc="sampling", leave=False)
    for step in steps:
        if generators is None:
            uniforms = torch.rand(len(in_batch), device=device)
        else:
            uniforms = torch.cat([torch.rand(1, generator=generators[r]) for r in in_batch])
            uniforms = uniforms.to(device)
        tokens, token_logprobs = draw(logits, sampling.temperature, uniforms)
        keep = []  # the rows still sampling after this token
        for row, (r, t, lp) in enumerate(zip(in_batch, tokens.tolist(), token_logprobs.tolist())):
            if finish[r] != "length":  # finished earlier, still in a fixed-shape batch
                continue
            completions[r].append(t)
            logprobs[r].append(lp)
            if t == tokenizer.eos_id:
                finish[r] = "eos"
            elif stop and find_stop(tokenizer.decode(completions[r][-tail:]), stop) >= 0:
                finish[r] = "stop"
            else:
                keep.append(row)
        if not keep or step == max_new_tokens - 1:
            break
        if decoder is not None:
            logits = decoder(tokens)
            continue
        if len(keep) < len(in_batch):  # finished rows leave the batch and its cache
            index = torch.tensor(keep, device=device)
            cache.select_rows(index)
            in_batch, tokens, mask = [in_batch[row] for row in keep], tokens[index], mask[index]
        mask = torch.cat([mask, mask.new_ones(len(in_batch), 1)], 1)
        logits = next_logits(model, tokens[:, None], mask, cache)
    rollouts = []
    for r in range(R):
        text = tokenizer.decode(completions[r])
        cut = find_stop(text, stop) if stop else -1
        rollouts.append(Rollout(prompt_ids[r // n], completions[r], logprobs[r],
                                text[:cut] if cut >= 0 else text, finish[r], prompt_index=r // n,
                                sample_index=r % n))
    return rollouts
