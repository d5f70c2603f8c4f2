"""
The training pass: from the states a step trains on to one optimizer step. The trainer's
counterpart of sample.py, which produces the states; sft.py, rl.py and opd.py differ only
in where their states come from and what loss they put on them.

A training sequence is a token list and a start: the states seq[:t] for t in [start,
len(seq)) are trained on, each with its next token seq[t] as the target. One step:

  sequence_logprobs / sequence_states   the learner's log p(seq[t] | seq[:t]) (or its final
                                        hidden states) at every trained state, with common
                                        prefixes laid out once (shared_rows)
  base_logprobs, base_nll               the same tokens under the frozen base: state_nll_base
  learner_nll                           ... under the learner, from the sampler where it drew them
  token_nll, token_kl                   losses at those states: cross-entropy on given
                                        tokens, the per-state KL to a teacher
  backward                              micro-batches under a token bound, each loss weighed
                                        by its share of the step's tokens, summed over
                                        torchrun's processes: any split, one update
  optimizer_step                        the learning-rate schedule, clipping, AdamW
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import lora
from plumbing import processes

# tokens a sequence must share with a row to be laid out in it beyond the longest's length
SHARED_MIN = 16


# -----------------------------------------------------------------------------
# states to log-probs: each common prefix computed once

def common_length(a, b):
    """How many tokens two token lists share at their start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def walk(trie, s):
    """The columns of the longest start of s that a row already holds (trie: (parent column,
    token) -> column, the root's parent -1)."""
    path = []
    while len(path) < len(s) and (path[-1] if path else -1, s[len(path)]) in trie:
        path.append(trie[path[-1] if path else -1, s[len(path)]])
    return path


def shared_rows(sequences):
    """How a training pass lays token lists out: in rows of prefix trees, each token computed
    once for every sequence that opens with the tokens before it (RL's samples of one prompt,
    OPD's continuations of one rollout's cuts), short sequences side by side in a row up to
    the longest's length, longest first. Returns (rows of token ids, each row's parent
    column of every token, -1 at a tree's root, the row and columns of each sequence)."""
    cap = max(map(len, sequences))
    rows, parents, tries, placed = [], [], [], [None] * len(sequences)
    for b in sorted(range(len(sequences)), key=lambda i: -len(sequences[i])):
        s, best = sequences[b], None
        # the row sharing most of s, of those with room for its rest
        for r, trie in enumerate(tries):
            path = walk(trie, s)
            if (len(rows[r]) + len(s) - len(path) <= cap or len(path) >= SHARED_MIN) and (
                    best is None or len(path) > len(best[1])):
                best = (r, path)
        if best is None:
            rows.append([]), parents.append([]), tries.append({})
            best = (len(rows) - 1, [])
        r, columns = best[0], list(best[1])
        for token in s[len(columns):]:
            parent = columns[-1] if columns else -1
            tries[r][parent, token] = len(rows[r])
            columns.append(len(rows[r]))
            rows[r].append(token), parents[r].append(parent)
        placed[b] = (r, columns)
    return rows, parents, placed


def sequence_states(model, sequences, starts, pad_id=0):
    """The final hidden state at every state seq[:t] whose next token seq[t] is trained on,
    for t in [start, len(seq)) of each token list. Returns (states (N, hidden), targets
    (N,), the sequence of each (N,)), sequence by sequence. Rows are laid out by
    shared_rows and right-padded; a token attends to the tokens on its path from its
    tree's root and counts its position from there, so each sequence computes what it
    would alone. Where every row holds one sequence, causal attention alone does that."""
    device = model.lm_head.weight.device
    for b, (s, start) in enumerate(zip(sequences, starts)):
        if not 1 <= start <= len(s):
            raise ValueError(f"sequence {b}: start {start} outside [1, {len(s)}]")
    rows, parents, placed = shared_rows(sequences)
    R, T = len(rows), max(map(len, rows))
    ids = torch.full((R, T), pad_id, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
    ids = ids.to(device)
    if R == len(sequences):  # no common prefix, no two side by side
        hidden = model(ids, hidden_only=True)
    else:
        positions = torch.zeros(R, T, dtype=torch.long)
        visible = torch.eye(T, dtype=torch.bool).repeat(R, 1, 1)
        for r, row_parents in enumerate(parents):
            for c, p in enumerate(row_parents):
                if p >= 0:  # what its parent sees, and itself
                    visible[r, c] |= visible[r, p]
                    positions[r, c] = positions[r, p] + 1
        hidden = model.body(ids, positions.to(device), visible[:, None].to(device), None)
    trained = [(r, columns[t - 1], columns[t], b)
               for b, ((r, columns), start) in enumerate(zip(placed, starts))
               for t in range(start, len(columns))]
    row, state, target, which = torch.tensor(trained, dtype=torch.long, device=device).view(-1, 4).T
    # one state can serve several sequences (a prompt's last token, each of its samples'):
    # index_select's backward adds their gradients in one order on any number of CPU threads,
    # where hidden[row, state]'s adds them in whichever order its threads finish
    states = hidden.flatten(0, 1).index_select(0, row * T + state)
    return states, ids[row, target], which


def sequence_logprobs(model, sequences, starts, pad_id=0):
    """log p(seq[t] | seq[:t]) in fp32 for t in [start, len(seq)), flat (N,), and the index of
    each one's sequence (N,): the training pass's view of the policy that sample.py samples."""
    states, targets, which = sequence_states(model, sequences, starts, pad_id)
    return model.token_logprobs(states, targets), which


@torch.no_grad()
def frozen_states(net, adapter, sequences, starts, pad_id=0):
    """sequence_states of a model with `adapter` active (None: the base), in eval mode (no
    adapter dropout, also amid a training pass on the shared base), without a gradient."""
    training = net.training
    with lora.use_adapter(net.eval(), adapter):
        out = sequence_states(net, sequences, starts, pad_id)
    net.train(training)
    return out


@torch.no_grad()
def base_logprobs(model, sequences, starts, pad_id=0, passes=None):
    """Each sequence's log-probs of its trained tokens under the frozen base model (the adapter
    off), (len(seq) - start,) each, in the passes backward runs (Passes)."""
    out, passes = [None] * len(sequences), passes or Passes()
    with lora.use_adapter(model, None):
        for part in micro_batches(list(map(len, sequences)), passes.grad_accum, passes.max_tokens):
            seqs, sts = [sequences[i] for i in part], [starts[i] for i in part]
            logp, _ = sequence_logprobs(model, seqs, sts, pad_id)
            for i, values in zip(part, logp.split([len(sequences[i]) - starts[i] for i in part])):
                out[i] = values
    return out


def base_nll(logprobs):
    """(summed NLL, tokens) of base_logprobs' output: state_nll_base, where a step's states lie,
    measured the same way in every script (SFT's gold answers, RL's and OPD's rollouts)."""
    return -sum(lp.sum().item() for lp in logprobs), sum(map(len, logprobs))


@torch.no_grad()
def learner_nll(model, sequences, starts, sampled, pad_id=0):
    """(summed NLL, tokens) of the trajectories under the learner (adapter 'default', eval
    mode): a trajectory the learner drew itself brings its sampler's log-probs (the same
    policy, sample.py), one it did not (None) is read by a forward: state_nll."""
    rest = [i for i, lp in enumerate(sampled) if lp is None]
    drawn = [lp for lp in sampled if lp is not None]
    nll, n = -sum(sum(lp) for lp in drawn), sum(len(lp) for lp in drawn)
    if rest:
        seqs, sts = [sequences[i] for i in rest], [starts[i] for i in rest]
        h, targets, _ = frozen_states(model, "default", seqs, sts, pad_id)
        nll, n = nll - model.token_logprobs(h, targets).sum().item(), n + len(targets)
    return nll, n


def token_nll(logp):
    """(loss, metrics) of cross-entropy on the given target tokens: their summed NLL
    (backward divides by the step's tokens). SFT's gold tokens, OPD's teacher tokens."""
    return -logp.sum(), {}


def token_kl(student, student_h, teacher_h, teacher_head, direction="forward",
             chunk_logits=2 ** 24):
    """Per-state KL between the next-token distributions of student states (N, hidden), under
    the student's output layer, and teacher states, under teacher_head (the teacher's lm_head
    weight): (N,) in fp32, chunk_logits logits at a time (chunked), as model.token_logprobs.
    forward: KL(teacher || student); reverse: KL(student || teacher). Only the student's
    states get a gradient, formed in closed form: identical distributions then give exactly
    zero, not float noise that Adam would scale up into a full-size step."""
    def chunk(hs, ht):
        z = student.lm_head(hs).float()
        log_s = z.log_softmax(-1)
        log_t = F.linear(ht, teacher_head.detach()).float().log_softmax(-1)
        p_s, p_t = log_s.exp(), log_t.exp()
        if direction == "forward":  # KL(t || s) = sum p_t (log p_t - log p_s); d/dz = p_s - p_t
            kl, grad = (p_t * (log_t - log_s)).sum(-1), p_s - p_t
        else:  # KL(s || t) = sum p_s (log p_s - log p_t); d/dz = p_s (log p_s - log p_t - KL)
            kl = (p_s * (log_s - log_t)).sum(-1)
            grad = p_s * (log_s - log_t - kl[:, None])
        surrogate = (grad.detach() * z).sum(-1)  # its gradient with respect to z is grad
        return kl.detach() + surrogate - surrogate.detach()
    rows = max(1, chunk_logits // student.config.vocab_size)
    return chunked(chunk, rows, student_h, teacher_h.detach())


def chunked(fn, chunk_size, *tensors):
    """torch.cat of fn over chunks of rows of the tensors; with a gradient, each chunk runs
    under checkpoint, which keeps only its inputs and recomputes the rest in backward."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    parts = [checkpoint(fn, *xs, use_reentrant=False) if grad else fn(*xs)
             for xs in zip(*(t.split(chunk_size) for t in tensors))]
    return torch.cat(parts) if parts else tensors[0].new_zeros(0, dtype=torch.float32)


# -----------------------------------------------------------------------------
# one step: micro-batches, the backward pass, the optimizer

@dataclass(frozen=True)
class Passes:
    """How a step's sequences split into forward-backward passes (micro_batches): at least
    grad_accum of them, each at most max_tokens tokens, padding included (0: no bound)."""
    grad_accum: int = 1
    max_tokens: int = 0


def micro_batches(lengths, grad_accum=1, max_tokens=0):
    """Index lists splitting a step's sequences (of these lengths) into forward and backward
    passes: at least grad_accum of them (where there are as many sequences), longest first
    so that sequences of like length pad together, each at most max_tokens tokens padding
    included (0: no bound); a sequence longer than the bound runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n, parts = len(order), min(grad_accum, len(order))
    passes = []
    for k in range(parts):
        first = len(passes)  # where this part's passes start
        for i in order[k * n // parts:(k + 1) * n // parts]:
            last = passes[-1] if len(passes) > first else None
            if last and (not max_tokens or (len(last) + 1) * lengths[last[0]] <= max_tokens):
                last.append(i)  # its first is its longest: rows x that length is the padded size
            else:
                passes.append([i])
    return passes


def backward(loss_of, sequences, starts, passes=None, **per_sequence):
    """One step's backward pass over the trained tokens of sequences (seq[start:] of each), in
    the forward-backward passes `passes` says (Passes; default one). per_sequence: lists of
    one tensor a sequence, a value a trained token (the sampler's log-probs, the advantages);
    each pass gets its share, joined, under the same name.
    loss_of(sequences, starts, **shares) returns (loss, metrics) summed over the pass's tokens
    (a metric that is a tensor, a value a token, is joined instead). Each pass's loss is divided
    by the step's tokens over every process, so the gradients add up to the token mean of the
    whole step whatever the split and the number of processes. Returns (the loss's token mean,
    each metric's token mean or joined tensor, the step's tokens)."""
    n_tokens = processes.summed(sum(len(s) - start for s, start in zip(sequences, starts)))[0]
    loss_sum, sums, parts = 0.0, {}, {}
    passes = passes or Passes()
    for part in micro_batches(list(map(len, sequences)), passes.grad_accum, passes.max_tokens):
        shares = {k: torch.cat([v[i] for i in part]) for k, v in per_sequence.items()}
        loss, metrics = loss_of([sequences[i] for i in part], [starts[i] for i in part], **shares)
        (loss / n_tokens).backward()
        loss_sum += loss.item()
        for k, v in metrics.items():
            if torch.is_tensor(v):
                parts.setdefault(k, []).append(v)
            else:
                sums[k] = sums.get(k, 0.0) + float(v)
    loss_sum, *values = processes.summed(loss_sum, *sums.values())  # every process's share
    means = {k: v / n_tokens for k, v in zip(sums, values)}
    joined = {k: torch.cat(v) for k, v in parts.items()}
    return loss_sum / n_tokens, {**means, **joined}, n_tokens


def lr_at(step, total_steps, peak_lr, warmup_frac):
    """Linear warmup over the first warmup_frac of the steps, then cosine decay to zero."""
    warmup = max(1, round(warmup_frac * total_steps)) if warmup_frac > 0 else 0
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak_lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def optimizer_step(optimizer, step, total_steps, peak_lr, warmup=0.0, grad_clip=0.0):
    """Scheduled learning rate (lr_at), the global gradient norm clipped to grad_clip (0: not
    clipped), one optimizer step; returns (lr, the norm before clipping)."""
    lr = lr_at(step, total_steps, peak_lr, warmup)
    for group in optimizer.param_groups:
        group["lr"] = lr
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # each process divided its loss by the whole step's tokens: the sum is the step's gradient
    if processes.WORLD > 1:
        for p in params:
            p.grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(p.grad)
    bound = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, bound).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, grad_norm


def adapter_and_optimizer(model, rank, alpha, dropout, lr, weight_decay, seed, recompute):
    """The adapter a run trains: a fresh LoRA 'default' on model, its A matrices drawn from
    seed, and AdamW over its parameters; recompute: keep only each layer's input for the
    backward pass."""
    torch.manual_seed(seed)
    lora.add_lora(model, rank, alpha, dropout)
    model.recompute = recompute
    return torch.optim.AdamW(lora.lora_parameters(model), lr=lr, weight_decay=weight_decay)
