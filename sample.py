"""
Batched sampling with the KV cache: the one place where on-policy states are produced.

A *state* of an autoregressive policy is the prompt plus the prefix generated so far,
s_t = (x, y_<t). SFT trains on states taken from a fixed dataset; RL and OPD train on
states the current learner visits itself, and drift.py compares the states different
models visit. All three get those states from generate() below, so "on-policy" means
exactly one thing in this code base: tokens returned by this function for the current
weights.

Prompts are left-padded into one batch; each prompt is prefilled once and its KV cache
copied to its n samples, and consecutive prompts that open alike (few-shot evaluation's
shots, OPD's cuts of one rollout) run their common tokens once (prefill). On the CPU,
finished rows are dropped from the batch, so a long straggler does not make every other
row pay for its tokens (each dropped row's place is taken by the last row, which alone
moves in the cache: KVCache.select_rows); on CUDA the decode step is captured once as a
CUDA graph at a fixed shape and replayed (FixedShapeDecoder), which matters more there
than the rows saved. A policy's LoRA adapter is folded into a copy of the weights it
adapts for the length of a call (lora.folded_adapter), so sampling from an adapted policy
costs what sampling from the plain model does. In bf16 on the CPU (and in fp32 on AMD
CPUs) the decoder layers' weights and the output layer's are also packed for oneDNN for
the length of a call (model.packed_weights): four stacked products per layer instead of
seven, each streaming its weights faster.
"""
import contextlib
import os
from dataclasses import dataclass, field

import torch

import lora
from model import InputError, PrefixView, SharedColumns, left_pad, packed_weights


@dataclass
class Rollout:
    prompt_ids: list
    completion_ids: list  # includes the end-of-text token when the model produced it
    logprobs: list  # log p(token | state) under the model (temperature 1, no filtering), fp32
    text: str  # decoded completion, cut before the first stop string
    finish_reason: str  # "eos", "stop" or "length"
    prompt_index: int = 0
    sample_index: int = 0
    extra: dict = field(default_factory=dict)


def filter_logits(logits, top_k=0, top_p=1.0):
    """Set to -inf everything outside the top-k tokens and outside the top-p nucleus."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


ARGMAX_BLOCK = 1024


def first_max_index(logits):
    """logits.argmax(-1) for (rows, vocab) logits, the same index (the first of equal
    maxima; the first NaN if any), found in two steps on the CPU: each block of
    ARGMAX_BLOCK columns' maximum, which amax finds with vector instructions, then argmax
    within the first block holding the row's maximum. On the development CPU argmax alone
    over Qwen3's 151,936 columns took ten times amax's time (1.1 ms against 0.1 at 8 rows)."""
    rows, vocab = logits.shape
    blocks = vocab // ARGMAX_BLOCK
    if blocks < 2 or logits.device.type != "cpu" or logits.stride(-1) != 1:
        return logits.argmax(-1)
    whole = blocks * ARGMAX_BLOCK
    block_max = logits[:, :whole].view(rows, blocks, ARGMAX_BLOCK).amax(-1)
    if whole < vocab:  # the last, shorter block
        block_max = torch.cat((block_max, logits[:, whole:].amax(-1, keepdim=True)), -1)
    start = block_max.argmax(-1) * ARGMAX_BLOCK
    # a short last block repeats its last column at the end, after the column itself, so
    # the first maximum found is still a real column
    columns = (start[:, None] + torch.arange(ARGMAX_BLOCK, device=logits.device)).clamp(max=vocab - 1)
    return start + logits.gather(-1, columns).argmax(-1)


def draw(logits, temperature, top_k=0, top_p=1.0, uniforms=None, scratch=None):
    """Next token of each row from fp32 logits (rows, vocab), and its log-prob under the
    model itself (temperature 1, no filtering). Greedy when temperature == 0. Otherwise by
    inverse CDF, with one U(0, 1) draw per row: uniforms (per-row seeds), or from torch's
    global generator when None. scratch, a tensor like logits, is written over in place of
    a new one: a buffer of 64 rows over Qwen3's vocabulary (39 MB) is above the size from
    which the C allocator maps fresh pages from the system for each request, and faulting
    them in cost 12 ms a call on the CPU, ten times the pass that fills it.

    At temperature 1 without filtering, one buffer, exp(logits - max), serves both the
    normaliser and the sampling weights (neither needs them to sum to one) in place of a
    logsumexp, a division by the temperature and a softmax: about half the passes over
    the (rows, 151,936) logits, which at 64 rows cost as much as a tenth of the model's
    step. Its running sum is taken in place. Inverse CDF rather than torch.multinomial:
    over Qwen3's vocabulary on the development CPU multinomial took 4.4 ms a row, this 0.2
    to 0.5 ms, a quarter of a second less per token at 64 rows."""
    top = logits.amax(-1, keepdim=True)
    weights = torch.sub(logits, top, out=scratch).exp_()
    log_z = top.squeeze(-1) + weights.sum(-1).log()
    if temperature == 0:
        next_tok = first_max_index(logits)
    else:
        if temperature != 1 or top_k or top_p < 1:
            tempered = filter_logits(torch.div(logits, temperature, out=weights), top_k, top_p)
            weights = tempered.sub_(tempered.amax(-1, keepdim=True)).exp_()
        if uniforms is None:
            uniforms = torch.rand(len(logits), device=logits.device)
        cdf = weights.cumsum_(-1)
        # the first token whose running sum reaches u of the total. u is at least the
        # smallest value torch.rand gives above 0, so a token of weight zero (filtered out,
        # or underflowed) is never the one found, not even where u = 0 was drawn
        fraction = uniforms.clamp(min=2 ** -24)
        next_tok = torch.searchsorted(cdf, (fraction * cdf[:, -1])[:, None]).squeeze(-1)
        next_tok = next_tok.clamp(max=logits.shape[-1] - 1)  # NaN logits: an index, not an indexing error
    return next_tok, logits.gather(-1, next_tok[:, None]).squeeze(-1) - log_z


def find_stop(text, stop):
    """Index of the earliest stop string in text, or -1."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else -1


class FixedShapeDecoder:
    """The decode loop's model call at one batch size and cache length. Its inputs live in
    buffers updated in place, so on CUDA the step is captured once as a CUDA graph and
    replayed for every token: a 0.6B model's step is hundreds of small kernels, and
    launching them one by one from Python costs more than running them. Rows are never
    dropped here (that would change the shapes); finished rows decode on, unread.
    Without a graph (decode="fixed") the same fixed-shape step runs eagerly."""

    def __init__(self, model, cache, mask, use_graph):
        R, P = mask.shape
        device = mask.device
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(R, 1, dtype=torch.long, device=device)
        self.positions = mask.sum(-1, keepdim=True) - 1  # advanced before each step
        self.key_mask = torch.zeros(R, 1, 1, cache.max_len, dtype=torch.bool, device=device)
        self.key_mask[:, 0, 0, :P] = mask.bool()
        cache.zero_unwritten()  # read, masked, at every step
        cache.write_pos = torch.full((1,), P - 1, dtype=torch.long, device=device)  # advanced before each step
        self.use_graph, self.graph, self.logits = use_graph, None, None

    def _step(self):
        return self.model.decode_step(self.tokens, self.positions, self.key_mask, self.cache)

    def __call__(self, next_tok):
        self.tokens.copy_(next_tok[:, None])
        self.positions += 1
        self.cache.write_pos += 1
        self.key_mask.index_fill_(-1, self.cache.write_pos, True)
        if not self.use_graph:
            return self._step()
        if self.graph is None:
            # the first step runs eagerly on a side stream (kernel selection, workspace
            # allocation), then the same step is captured without running
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                first = self._step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # autocast's weight cache would hold casts made at capture time: turn it off
            with torch.autocast("cuda", enabled=torch.is_autocast_enabled("cuda"),
                                dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
                with torch.cuda.graph(self.graph):
                    self.logits = self._step()
            return first
        self.graph.replay()
        return self.logits


@torch.no_grad()
def generate(model, tokenizer, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, top_k=0,
             stop=(), seed=None, progress=False, decode="auto", fold_adapter=True):
    """Sample n completions for each prompt (strings or lists of token ids).

    Greedy when temperature == 0. With a seed, sample r (prompt i, sample j, r = i*n + j)
    draws its randomness from its own generator seeded with seed + r, so a sample does not
    depend on what else is in the batch. decode picks the decode loop: "dropping" (finished
    rows leave the batch), "fixed" (FixedShapeDecoder run eagerly), "graph" (FixedShapeDecoder
    replaying a CUDA graph) or "auto" ($STATES_DECODE if set, else graph on CUDA and dropping
    elsewhere); all of them return the same tokens. With fold_adapter, an active LoRA adapter
    runs folded into a copy of the weights it adapts for the length of the call
    (lora.folded_adapter): the same policy up to rounding, a decode step up to a fifth
    faster, for one copy of those weights; False runs the adapter's own products, as the
    training forward pass does. In bf16 on the CPU, and in fp32 on AMD CPUs from two rows
    (prompts times n), the (folded) weights are packed too (model.packed_weights), for
    one more copy of them while the call runs (in fp32, also from two rows, where oneDNN
    has no bf16 product: model.packing_dtype); set model.PACK_ON_CPU = False to spare that
    memory. Returns a list of Rollout, prompt-major.
    """
    device = model.lm_head.weight.device
    if decode == "auto":
        # $STATES_DECODE overrides the default for every script at once, e.g. to turn the
        # CUDA graph off without touching code
        decode = os.environ.get("STATES_DECODE") or ("graph" if device.type == "cuda" else "dropping")
    if decode not in ("dropping", "fixed", "graph"):
        raise InputError(f"decode={decode!r} (or $STATES_DECODE): use 'auto', 'dropping', 'fixed' or 'graph'")
    if decode == "graph" and device.type != "cuda":
        raise InputError(f"decode='graph' needs a CUDA device, the model is on {device}; use decode='fixed' or 'auto'")
    if not prompts:  # nothing to sample, as for an empty batch a caller filtered down
        return []
    # packing reads the weights as folded, so it goes inside the fold
    with (lora.folded_adapter(model) if fold_adapter else contextlib.nullcontext(),
          packed_weights(model, rows=len(prompts) * n)):
        return _generate(model, tokenizer, prompts, n, max_new_tokens, temperature, top_p, top_k, stop, seed,
                         progress, decode)


SHARED_PROMPT_MIN = 16  # tokens that consecutive prompts must share to be prefilled once


def common_length(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def prompt_groups(prompt_ids):
    """Consecutive prompts that open with SHARED_PROMPT_MIN or more tokens in common form a
    group, prefilled once: evaluation's few-shot prompts share their shots, and OPD's
    teacher continues each rollout from several cuts, each prompt a prefix of the next.
    Returns (group of each prompt, index of each group's longest prompt: its trunk)."""
    group_of, trunks = [], []
    for i, p in enumerate(prompt_ids):
        if i and common_length(prompt_ids[i - 1], p) >= SHARED_PROMPT_MIN:
            group_of.append(len(trunks) - 1)
            if len(p) > len(prompt_ids[trunks[-1]]):
                trunks[-1] = i
        else:
            group_of.append(len(trunks))
            trunks.append(i)
    return group_of, trunks


def prefill(model, prompt_ids, pad_id, max_new_tokens=0, rows=None, keep_cache=True):
    """Run the prompts into a new KV cache with room for max_new_tokens more and memory for
    `rows` rows. Returns (cache, mask of the cache's real positions, each prompt's last
    final hidden state (B, hidden)). Where consecutive prompts share a prefix
    (prompt_groups), each group's longest prompt runs alone and its cache is copied to the
    group's rows; a row keeps the positions it shares with it, the rest masked out as
    padding is (positions count real tokens only), and then the rest of each prompt, if
    any, runs after them. keep_cache=False, for the last states alone: no cache is
    returned, and the rest reads the group's cache layer by layer (model.PrefixView)."""
    device = model.lm_head.weight.device
    group_of, trunks = prompt_groups(prompt_ids)
    if len(trunks) == len(prompt_ids):
        ids, mask = left_pad(prompt_ids, pad_id, device)
        cache = model.new_cache(len(ids), ids.shape[1] + max_new_tokens, rows=rows) if keep_cache else None
        last = model(ids, attention_mask=mask, cache=cache, hidden_only=True)[:, -1]
        if keep_cache:
            cache.shared = SharedColumns(ids.shape[1], range(len(ids)))  # each prompt's rows, once it has several
        return cache, mask, last
    trunk_ids, trunk_mask = left_pad([prompt_ids[t] for t in trunks], pad_id, device)
    shared = [common_length(p, prompt_ids[trunks[g]]) for p, g in zip(prompt_ids, group_of)]
    ids, rest_mask = left_pad([p[k:] for p, k in zip(prompt_ids, shared)], pad_id, device)
    width = trunk_ids.shape[1]
    cache = model.new_cache(len(trunks), width + ids.shape[1] + max_new_tokens, rows=rows)
    trunk_hidden = model(trunk_ids, attention_mask=trunk_mask, cache=cache, hidden_only=True)
    owner = torch.tensor(group_of, device=device)
    if keep_cache:
        cache.shared = SharedColumns(width, range(len(trunks)))
        cache.select_rows(owner)  # each row takes its group's, at or above it: in place
    columns = torch.arange(width, device=device)
    # the first column of the trunk each row does not share
    ends = width - torch.tensor([len(prompt_ids[trunks[g]]) - k for g, k in zip(group_of, shared)], device=device)
    mask = torch.cat([trunk_mask[owner] * (columns < ends[:, None]), rest_mask], 1)
    last = trunk_hidden[owner, ends - 1]  # the state after the shared tokens: a prompt's last, where no rest follows
    if ids.shape[1]:
        rest_last = model(ids, attention_mask=mask, cache=cache if keep_cache else PrefixView(cache, owner),
                          hidden_only=True)[:, -1]
        last = torch.where(rest_mask.bool().any(1)[:, None], rest_last, last)
    return cache if keep_cache else None, mask, last


def _generate(model, tokenizer, prompts, n, max_new_tokens, temperature, top_p, top_k, stop, seed, progress, decode):
    device = model.lm_head.weight.device
    prompt_ids = [list(p) if not isinstance(p, str) else tokenizer.encode(p) for p in prompts]
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("empty prompt: every prompt needs at least one token")
    B = len(prompt_ids)
    cache, mask, last = prefill(model, prompt_ids, tokenizer.pad_id, max_new_tokens, rows=B * n)
    logits = model.next_token_logits(last[:, None])
    if n > 1:
        cache.select_rows(torch.arange(B, device=device).repeat_interleave(n))
        mask = mask.repeat_interleave(n, dim=0)
        logits = logits.repeat_interleave(n, dim=0)
    R = B * n
    decoder = FixedShapeDecoder(model, cache, mask, use_graph=decode == "graph") if decode != "dropping" else None
    generators = None
    if seed is not None and temperature > 0:
        generators = [torch.Generator().manual_seed(seed + r) for r in range(R)]

    stop = tuple(stop)
    tail_tokens = 4 * max((len(s) for s in stop), default=0) + 4  # enough tokens to contain any stop string
    completions = [[] for _ in range(R)]
    logprobs = [[] for _ in range(R)]
    finish = ["length"] * R
    in_batch = list(range(R))  # original row index of each batch row
    finished = [False] * R
    steps = range(max_new_tokens)
    if progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc="sampling", leave=False)
    # draw's buffer, and the prefill's logits, which the dropping loop's steps convert theirs
    # into; their first rows serve a batch that dropped rows
    scratch, logits_memory = torch.empty_like(logits), logits
    for step in steps:
        uniforms = None
        if generators is not None:
            uniforms = torch.cat([torch.rand(1, generator=generators[r]) for r in in_batch]).to(device)
        next_tok, tok_logprob = draw(logits, temperature, top_k, top_p, uniforms, scratch[:len(logits)])

        keep = []
        for row, (r, t, lp) in enumerate(zip(in_batch, next_tok.tolist(), tok_logprob.tolist())):
            if finished[r]:
                continue
            completions[r].append(t)
            logprobs[r].append(lp)
            if t == tokenizer.eos_id:
                finish[r] = "eos"
            elif stop and find_stop(tokenizer.decode(completions[r][-tail_tokens:]), stop) >= 0:
                finish[r] = "stop"
            else:
                keep.append(row)
                continue
            finished[r] = True
        if not keep or step == max_new_tokens - 1:
            break
        if decoder is not None:
            logits = decoder(next_tok)
            continue
        if len(keep) < len(in_batch):
            # the last rows kept fill the places of the rows left out, so that only they
            # move in the cache (KVCache.select_rows), not every row after the first left out
            later = [row for row in keep if row >= len(keep)]
            kept = set(keep)
            order = [row if row in kept else later.pop() for row in range(len(keep))]
            index = torch.tensor(order, device=device)
            in_batch = [in_batch[row] for row in order]
            next_tok, mask = next_tok[index], mask[index]
            cache.select_rows(index)
        mask = torch.cat([mask, mask.new_ones(len(in_batch), 1)], dim=1)
        # the last step's logits are drawn from already, so their memory takes this step's
        logits = model.next_token_logits(model(next_tok[:, None], attention_mask=mask, cache=cache, hidden_only=True),
                                         out=logits_memory[:len(in_batch)])

    rollouts = []
    for r in range(R):
        text = tokenizer.decode(completions[r])
        cut = find_stop(text, stop) if stop else -1
        rollouts.append(Rollout(prompt_ids[r // n], completions[r], logprobs[r], text[:cut] if cut >= 0 else text,
                                finish[r], prompt_index=r // n, sample_index=r % n))
    return rollouts
