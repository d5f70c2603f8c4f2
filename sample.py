"""
Batched sampling with the KV cache: the one place where on-policy states are produced.

A *state* of an autoregressive policy is the prompt plus the prefix generated so far,
s_t = (x, y_<t). SFT trains on states taken from a fixed dataset; RL and OPD train on
states the current learner visits itself, and drift.py compares the states different
models visit. All three get those states from generate() below, so "on-policy" means
exactly one thing in this code base: tokens returned by this function for the current
weights.

Prompts are left-padded into one batch; each prompt is prefilled once and its KV cache
copied to its n samples. Finished rows are dropped from the batch, so a long straggler
does not make every other row pay for its tokens.
"""
from dataclasses import dataclass, field

import torch

from model import left_pad


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


def find_stop(text, stop):
    """Index of the earliest stop string in text, or -1."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else -1


@torch.no_grad()
def generate(model, tokenizer, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, top_k=0,
             stop=(), seed=None, progress=False):
    """Sample n completions for each prompt (strings or lists of token ids).

    Greedy when temperature == 0. With a seed, sample r (prompt i, sample j, r = i*n + j)
    draws its randomness from its own generator seeded with seed + r, so a sample does not
    depend on what else is in the batch. Returns a list of Rollout, prompt-major.
    """
    device = model.lm_head.weight.device
    prompt_ids = [list(p) if not isinstance(p, str) else tokenizer.encode(p) for p in prompts]
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("empty prompt: every prompt needs at least one token")
    ids, mask = left_pad(prompt_ids, tokenizer.pad_id, device)
    B, P = ids.shape

    cache = model.new_cache(B, P + max_new_tokens)
    logits = model(ids, attention_mask=mask, cache=cache, hidden_only=True)[:, -1:]
    logits = model.lm_head(logits)[:, -1].float()  # (B, vocab): only the last position is needed
    if n > 1:
        cache.select_rows(torch.arange(B, device=device).repeat_interleave(n))
        mask = mask.repeat_interleave(n, dim=0)
        logits = logits.repeat_interleave(n, dim=0)
    R = B * n
    generators = None
    if seed is not None and temperature > 0:
        generators = [torch.Generator().manual_seed(seed + r) for r in range(R)]

    stop = tuple(stop)
    tail_tokens = 4 * max((len(s) for s in stop), default=0) + 4  # enough tokens to contain any stop string
    completions = [[] for _ in range(R)]
    logprobs = [[] for _ in range(R)]
    finish = ["length"] * R
    alive = torch.arange(R, device=device)  # original row index of each row still in the batch
    steps = range(max_new_tokens)
    if progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc="sampling", leave=False)
    for step in steps:
        logprob_all = logits.log_softmax(-1)
        if temperature == 0:
            next_tok = logits.argmax(-1)
        else:
            probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
            if generators is None:
                next_tok = torch.multinomial(probs, 1).squeeze(-1)
            else:
                # inverse-CDF sampling with one uniform per row from that row's own generator
                u = torch.cat([torch.rand(1, generator=generators[r]) for r in alive.tolist()]).to(device)
                cdf = probs.cumsum(-1)
                next_tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=probs.shape[-1] - 1)
        tok_logprob = logprob_all.gather(-1, next_tok[:, None]).squeeze(-1)

        keep = []
        for row, (r, t, lp) in enumerate(zip(alive.tolist(), next_tok.tolist(), tok_logprob.tolist())):
            completions[r].append(t)
            logprobs[r].append(lp)
            if t == tokenizer.eos_id:
                finish[r] = "eos"
            elif stop and find_stop(tokenizer.decode(completions[r][-tail_tokens:]), stop) >= 0:
                finish[r] = "stop"
            else:
                keep.append(row)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(alive):
            index = torch.tensor(keep, device=device)
            alive, next_tok, mask = alive[index], next_tok[index], mask[index]
            cache.select_rows(index)
        mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
        logits = model(next_tok[:, None], attention_mask=mask, cache=cache)[:, -1].float()

    rollouts = []
    for r in range(R):
        text = tokenizer.decode(completions[r])
        cut = find_stop(text, stop) if stop else -1
        rollouts.append(Rollout(prompt_ids[r // n], completions[r], logprobs[r], text[:cut] if cut >= 0 else text,
                                finish[r], prompt_index=r // n, sample_index=r % n))
    return rollouts
