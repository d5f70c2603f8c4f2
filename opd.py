"""
On-policy distillation (OPD): the student's states, the teacher's signal.

State source:  the student's own rollouts, d^{pi_S}: each step the student (base + its
               adapter) samples one completion per GSM8K train prompt with sample.generate.
  --state-source teacher: the teacher samples them instead, d^{pi_T}: offline (sequence-
               level) distillation, whose states do not depend on the learner, as SFT's
               do not. --state-source data: GSM8K's gold solutions, d_data, SFT's states.
               Only the state source changes; the signal and everything else stay, so a
               run against the default isolates the paper's variable from the loss.
Signal source: the teacher, queried at those states.
  --signal continuation (default, the paper's working variant, DAgger-like): at --cuts
               points t of each trajectory the teacher greedily continues the prefix
               (x, y_<t) for up to --continuation-tokens tokens, stopping where a rollout
               would stop; the student learns those teacher tokens with cross-entropy
               given that prefix.
  --signal logits: per-token KL between the teacher's and the student's next-token
               distributions at every state of the trajectory, the one-step variant the
               paper saw collapse (GSM8K 0.040, its section 6). --kl forward is its eq. 7,
               KL(teacher || student); --kl reverse is the usual OPD objective.

A teacher is a run folder (the base model + that run's adapter) or a model id. A run-folder
teacher shares the student's frozen base weights in memory: only the active adapter
switches. --model and --data-dir default to the teacher run's own.

    python opd.py --teacher out/stress              # -> out/opd-stress
    python opd.py --teacher out/mild --signal logits --out out/opd-logits-mild
    python opd.py --teacher out/stress --state-source teacher --out out/kd-stress
"""
import argparse
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import data
import lora
import model as M
import runs
from sample import generate, tokens_before_stop


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="run folder (base + its adapter) or a model id / folder")
    p.add_argument("--out", default=None, help="run folder (default: out/opd-<teacher folder name>, + "
                                               "-teacher-states or -data-states for those state sources)")
    p.add_argument("--signal", choices=["continuation", "logits"], default="continuation", help="what the teacher supplies")
    p.add_argument("--kl", choices=["forward", "reverse"], default="forward",
                   help="KL direction for --signal logits: forward KL(teacher || student), the paper's eq. 7, or reverse")
    p.add_argument("--state-source", choices=["student", "teacher", "data"], default="student",
                   help="whose trajectories the states are: the student's rollouts (OPD), the teacher's (offline "
                        "distillation) or GSM8K's gold solutions")
    p.add_argument("--steps", type=runs.number(int, 1), default=200, help="optimizer steps (the schedule's length)")
    p.add_argument("--prompts-per-step", type=runs.number(int, 1), default=8, help="prompts per step, one trajectory each")
    p.add_argument("--temperature", type=runs.number(float, 0), default=1.0, help="sampling temperature of the states")
    p.add_argument("--max-new-tokens", type=runs.number(int, 1), default=256,
                   help="longest state trajectory (gold solutions are cut there)")
    p.add_argument("--cuts", type=runs.number(int, 1), default=4, help="cut points per trajectory the teacher continues")
    p.add_argument("--continuation-tokens", type=runs.number(int, 1), default=32, help="longest teacher continuation")
    runs.add_training_args(p, lr=1e-4, rank=16, alpha=32)
    args = p.parse_args(argv)
    source = "" if args.state_source == "student" else f"-{args.state_source}-states"
    args.out = args.out or f"out/opd-{os.path.basename(os.path.normpath(args.teacher))}{source}"
    return args


def load_teacher(model, tok, args):
    """(teacher model, its adapter): adapter 'teacher' on the student's shared base, the base
    itself (adapter None), or another model of the same tokenizer in a copy of its own."""
    if os.path.isdir(args.teacher) and not os.path.isfile(os.path.join(args.teacher, "config.json")):
        runs.check_run_folder(args.teacher, args.model, also=", or a model folder (config.json)")
        lora.load_adapter(model, args.teacher, name="teacher", activate=False)
        return model, "teacher"
    if runs.same_model(args.teacher, args.model):  # the base itself, however spelt: no second copy
        return model, None
    folder = M.model_folder(args.teacher, "--teacher")
    # token ids pass between the two models both ways, and their logits are compared column by column
    mismatch = M.InputError(f"--teacher {args.teacher} has another tokenizer or vocabulary than --model {args.model}; "
                            f"pick a teacher of the student's model family")
    if M.read_config(folder).vocab_size != model.config.vocab_size:
        raise mismatch
    teacher, teacher_tok = M.load(folder, model.lm_head.weight.device, model.lm_head.weight.dtype)
    if teacher_tok.tok.get_vocab() != tok.tok.get_vocab():
        raise mismatch
    return teacher, None


def continuation_loss(student_logp):
    """(loss, metrics): mean cross-entropy over the teacher tokens given."""
    return -student_logp.mean(), dict(tokens=student_logp.numel())


def token_kl(student, student_h, teacher_h, teacher_head, direction="forward", chunk_logits=2 ** 24):
    """Per-state KL between the next-token distributions of student states (N, hidden), under
    the student's output layer, and teacher states, under teacher_head (the teacher's lm_head
    weight): (N,) in fp32, chunk_logits logits at a time (chunked), as model.token_logprobs.
    forward: KL(teacher || student); reverse: KL(student || teacher). Only the student's
    states get a gradient, formed in closed form: identical distributions then give exactly
    zero, not float noise that Adam would scale up into a full-size step."""
    def chunk(hs, ht):
        z = student.lm_head(hs).float()
        log_s, log_t = z.log_softmax(-1), F.linear(ht, teacher_head.detach()).float().log_softmax(-1)
        p_s, p_t = log_s.exp(), log_t.exp()
        if direction == "forward":  # KL(t || s) = sum p_t (log p_t - log p_s); d/dz = p_s - p_t
            kl, grad = (p_t * (log_t - log_s)).sum(-1), p_s - p_t
        else:  # KL(s || t) = sum p_s (log p_s - log p_t); d/dz = p_s (log p_s - log p_t - KL)
            kl = (p_s * (log_s - log_t)).sum(-1)
            grad = p_s * (log_s - log_t - kl[:, None])
        surrogate = (grad.detach() * z).sum(-1)  # its gradient with respect to z is grad
        return kl.detach() + surrogate - surrogate.detach()
    return chunked(chunk, max(1, chunk_logits // student.config.vocab_size), student_h, teacher_h.detach())


def chunked(fn, chunk_size, *tensors):
    """torch.cat of fn over chunks of rows of the tensors; with a gradient, each chunk runs
    under checkpoint, which keeps only its inputs and recomputes the rest in backward."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    parts = [checkpoint(fn, *xs, use_reentrant=False) if grad else fn(*xs)
             for xs in zip(*(t.split(chunk_size) for t in tensors))]
    return torch.cat(parts) if parts else tensors[0].new_zeros(0, dtype=torch.float32)


def logit_kl_loss(token_kl):
    """(loss, metrics): mean per-state KL over the student states given."""
    return token_kl.mean(), dict(tokens=token_kl.numel())


def main(argv=None):
    args = parse_args(argv)
    runs.model_and_data_from(args, args.out if args.resume else None, args.teacher)
    print(vars(args))
    device, dtype = runs.device_from_args(args)
    model, tok = M.load(args.model, device, dtype)
    teacher, teacher_adapter = load_teacher(model, tok, args)
    run = runs.RunFolder(args.out, args)
    torch.manual_seed(args.seed)  # the initial LoRA A matrices
    lora.add_lora(model, args.rank, args.alpha, args.lora_dropout, name="default")  # the student
    model.recompute = args.recompute
    rows = data.load_gsm8k("train", args.data_dir)
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr, weight_decay=args.weight_decay)
    start = run.resume(model, optimizer) if args.resume else 0
    end = min(args.steps, args.max_steps) if args.max_steps else args.steps

    def states(net, adapter, sequences, starts):  # a model's final hidden states at the trained states
        training = net.training  # eval mode, so no adapter dropout, also amid the student's (shared) training pass
        with lora.use_adapter(net.eval(), adapter):
            out = runs.sequence_states(net, sequences, starts, tok.pad_id)
        net.train(training)
        return out

    bar = tqdm(range(start, end), initial=start, total=end, desc=f"opd-{args.signal}", disable=runs.RANK > 0)
    with run.stop_between_steps():  # a stop signal ends the run after a whole step, saved
        for step in bar:
            t0 = time.time()
            torch.manual_seed(args.seed * 1_000_003 + step)
            batch = [rows[i] for i in data.batch_indices(len(rows), step, args.prompts_per_step, args.seed)]
            first, last = runs.split(len(batch), "--prompts-per-step")  # under torchrun, this process's prompts
            batch = batch[first:last]

            # the state source: the student's own trajectories (or the teacher's, or the dataset's)
            model.eval()
            if args.state_source == "data":
                gold = [data.gsm8k_gold_ids(tok, r) for r in batch]
                sequences = [p + a[:args.max_new_tokens] for p, a in gold]
                starts = [len(p) for p, _ in gold]
                texts = [tok.decode(s[st:]) for s, st in zip(sequences, starts)]
            else:
                sampler, adapter = (model, "default") if args.state_source == "student" else (teacher, teacher_adapter)
                with lora.use_adapter(sampler, adapter):
                    rollouts = generate(sampler, tok, [data.gsm8k_prompt(r["question"]) for r in batch],
                                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        stop=data.GSM8K_STOP, seed=args.seed * 1_000_003 + step + first)
                sequences = [r.prompt_ids + r.completion_ids for r in rollouts]
                starts = [len(r.prompt_ids) for r in rollouts]
                texts = [r.text for r in rollouts]
            with torch.no_grad():  # where the states lie: the learner's NLL there and (below) the teacher-student KL
                student_h, targets, _ = states(model, "default", sequences, starts)
                # on the student's own rollouts this is the sampler's log-prob of its tokens
                state_nll, state_kl = -model.token_logprobs(student_h, targets).sum().item(), 0.0
                if args.signal == "continuation":  # with --signal logits the loss is this KL itself
                    teacher_h = states(teacher, teacher_adapter, sequences, starts)[0]
                    state_kl = token_kl(model, student_h, teacher_h, teacher.lm_head.weight, args.kl).sum().item()
                state_nll, state_kl, n_states = runs.summed(state_nll, state_kl, len(targets))  # over the processes

            if args.signal == "continuation":  # the signal: the teacher continues each cut's prefix
                rng = random.Random(args.seed * 1_000_003 + step)  # drawn for the whole step, kept for its share
                cuts = [sorted(rng.sample(range(n), min(args.cuts, n)))
                        for n in runs.joined([len(seq) - start for seq, start in zip(sequences, starts)])][first:last]
                prefixes = [seq[:start + t] for seq, start, ts in zip(sequences, starts, cuts) for t in ts]
                with lora.use_adapter(teacher, teacher_adapter):
                    conts = generate(teacher, tok, prefixes, max_new_tokens=args.continuation_tokens, temperature=0,
                                     stop=data.GSM8K_STOP)
                targets = [tokens_before_stop(tok, c.completion_ids, data.GSM8K_STOP) for c in conts]
                kept = [i for i, t in enumerate(targets) if t]  # a continuation that stops at once teaches nothing
                seqs, seq_starts = [prefixes[i] + targets[i] for i in kept], [len(prefixes[i]) for i in kept]
            else:
                seqs, seq_starts = sequences, starts
            model.train()
            n_tokens = runs.summed(sum(len(s) - st for s, st in zip(seqs, seq_starts)))[0]
            parts = runs.micro_batches(list(map(len, seqs)), args.grad_accum, args.micro_batch_tokens)
            loss_sum = 0.0
            for part in parts:
                part_seqs, part_starts = [seqs[i] for i in part], [seq_starts[i] for i in part]
                if args.signal == "continuation":
                    logp = runs.sequence_logprobs(model, part_seqs, part_starts, tok.pad_id)[0]
                    loss, metrics = continuation_loss(logp)
                else:
                    student_h = runs.sequence_states(model, part_seqs, part_starts, tok.pad_id)[0]
                    # the teacher runs again on the pass's own batch: where the models agree, KL and gradient
                    # are then exactly zero, not the noise of two batch shapes that Adam would scale up
                    with torch.no_grad():
                        part_teacher_h = states(teacher, teacher_adapter, part_seqs, part_starts)[0]
                    loss, metrics = logit_kl_loss(token_kl(model, student_h, part_teacher_h, teacher.lm_head.weight,
                                                           args.kl))
                weight = metrics["tokens"] / n_tokens  # micro-batches add up to the token mean of the whole step
                (loss * weight).backward()
                loss_sum += loss.item() * weight
            loss_sum = runs.summed(loss_sum)[0]
            run.check_finite(step + 1, loss_sum)
            lr, grad_norm = runs.optimizer_step(optimizer, step, args.steps, args)
            state_kl = state_kl / n_states if args.signal == "continuation" else loss_sum  # the mean KL over the states

            rewards = runs.joined(float(data.is_correct(text, row["gold"])) for text, row in zip(texts, batch))
            run.log(dict(step=step + 1, loss=loss_sum, state_kl=state_kl, state_nll=state_nll / n_states,
                         reward=statistics.mean(rewards), completion_len=n_states / len(rewards), lr=lr,
                         grad_norm=grad_norm, tokens=n_tokens, seconds=time.time() - t0))
            bar.set_postfix(loss=f"{loss_sum:.4f}", kl=f"{state_kl:.4f}")
            run.end_step(model, optimizer, step + 1, end)
    run.finish(end)
    print(f"done: adapter in {args.out}")


if __name__ == "__main__":
    runs.run_script(main, runs.MEMORY_FIX)
