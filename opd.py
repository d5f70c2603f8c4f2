"""
On-policy distillation (OPD): the student's states, the teacher's signal.

State source:  the student's own rollouts, d^{pi_S}: each step the student (base + its
               adapter) samples one completion per GSM8K train prompt with sample.generate.
  --state-source teacher: the teacher samples them instead, d^{pi_T}: offline (sequence-
               level) distillation, whose states do not depend on the learner, as SFT's
               do not. --state-source data: GSM8K's gold solutions, d_data, SFT's states.
               Only the state source changes; the signal and everything else stay, so a
               run against the default isolates the paper's variable from the loss; a
               mixture, student=0.25,data=0.75, draws each prompt's own: a dial.
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
  --signal sampled, the OPD most used today (the tinker cookbook's, TRL's, verl's): the
               advantage A_t = log pi_T(y_t|s_t) - log pi_S(y_t|s_t) at the drawn token,
               detached, through RL's clipped policy loss; on the student's states, a
               one-sample estimate of the gradient of --signal logits --kl reverse.

A teacher is a run folder (the base model + that run's adapter) or a model id. A run-folder
teacher shares the student's frozen base weights in memory: only the active adapter
switches. --model and --data-dir default to the teacher run's own.

    python opd.py --teacher out/stress              # -> out/opd-stress
    python opd.py --teacher out/mild --signal logits --out out/opd-logits-mild
    python opd.py --teacher out/stress --state-source teacher --out out/kd-stress
"""
import argparse
import os
from dataclasses import replace

import cli
import data
import lora
import model as M
import provenance
import rl
import runs
import train
from sample import Rollout, generate, tokens_before_stop


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="run folder (base + its adapter) or a model id / folder")
    p.add_argument("--out", default=None, help="run folder (default: out/opd-<teacher folder>[-<source>-states])")
    p.add_argument("--signal", choices=["continuation", "logits", "sampled"], default="continuation", help="(above)")
    p.add_argument("--kl", choices=["forward", "reverse"], default="forward", help="--signal logits: forward is eq. 7's")
    p.add_argument("--state-source", default="student", help="student, teacher, data, or weights of them (above)")
    p.add_argument("--steps", type=cli.number(int, 1), default=200, help="optimizer steps (the schedule's length)")
    p.add_argument("--prompts-per-step", type=cli.number(int, 1), default=8, help="prompts per step, one trajectory each")
    p.add_argument("--temperature", type=cli.number(float, 0), default=1.0, help="sampling temperature of the states")
    p.add_argument("--max-new-tokens", type=cli.number(int, 1), default=256, help="longest state trajectory (or gold one)")
    p.add_argument("--cuts", type=cli.number(int, 1), default=4, help="cut points per trajectory the teacher continues")
    p.add_argument("--continuation-tokens", type=cli.number(int, 1), default=32, help="longest teacher continuation")
    p.add_argument("--log-state-kl", action="store_true", help="also log state_kl, the teacher-student KL at the states")
    cli.add_training_args(p, lr=1e-4, rank=16, alpha=32)
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
    if provenance.same_model(args.teacher, args.model):  # the base itself, however spelt: no second copy
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


def draw_states(source, model, teacher, tok, batch, args, seed):
    """The step's state trajectories, a Rollout a prompt. student: the student's own rollouts
    (OPD), with its sampler's log-probs; teacher: the teacher's (offline distillation); data:
    the gold solutions (SFT's states). Trajectories the student did not draw have no log-probs."""
    if source == "data":
        return [Rollout(p, a[:args.max_new_tokens], None, tok.decode(a[:args.max_new_tokens]), "data", i)
                for i, (p, a) in enumerate(data.gsm8k_gold_ids(tok, r) for r in batch)]
    sampler, adapter = (model, "default") if source == "student" else teacher
    with lora.use_adapter(sampler, adapter):
        rollouts = generate(sampler, tok, [data.gsm8k_prompt(r["question"]) for r in batch], seed=seed,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop=data.GSM8K_STOP)
    return rollouts if source == "student" else [replace(r, logprobs=None) for r in rollouts]


def teacher_continuations(teacher, tok, sequences, starts, args, key):
    """The teacher's greedy continuations, cut before a stop string, at --cuts points of each
    trajectory before its own stop string (not inside a "\n\nQuestion:"), trajectory i's drawn
    from (seed, step, first + i) = key + i: (sequences, starts) of prefix + teacher tokens."""
    prefixes = []
    for i, (seq, start) in enumerate(zip(sequences, starts)):
        rng = data.item_rng(key, i)
        n = max(1, len(tokens_before_stop(tok, seq[start:], data.GSM8K_STOP)))  # the prompt alone at the least
        prefixes += [seq[:start + t] for t in sorted(rng.sample(range(n), min(args.cuts, n)))]
    net, adapter = teacher
    with lora.use_adapter(net, adapter):
        conts = generate(net, tok, prefixes, max_new_tokens=args.continuation_tokens, temperature=0,
                         stop=data.GSM8K_STOP)
    targets = [tokens_before_stop(tok, c.completion_ids, data.GSM8K_STOP) for c in conts]
    kept = [i for i, t in enumerate(targets) if t]  # a continuation that stops at once teaches nothing
    return [prefixes[i] + targets[i] for i in kept], [len(prefixes[i]) for i in kept]


def where_states_lie(model, teacher, sequences, starts, sampled, args, pad_id):
    """run.log's means of where the step's states lie: the learner's and the base's NLL of the
    trajectories and, with --log-state-kl, the teacher-student KL (--signal logits: the loss)."""
    out = dict(state_nll=train.learner_nll(model, sequences, starts, sampled, pad_id),
               state_nll_base=train.base_nll(train.base_logprobs(model, sequences, starts, pad_id, args.grad_accum,
                                                                 args.micro_batch_tokens)))
    if args.log_state_kl and args.signal != "logits":
        student_h = train.frozen_states(model, "default", sequences, starts, pad_id)[0]
        teacher_h = train.frozen_states(*teacher, sequences, starts, pad_id)[0]
        kl = train.token_kl(model, student_h, teacher_h, teacher[0].lm_head.weight, args.kl)
        out["state_kl"] = (kl.sum().item(), len(kl))
    return out


def main(argv=None):
    args = parse_args(argv)
    weights = data.state_mixture(args.state_source)
    device, dtype = cli.resolve(args, args.out if args.resume else None, args.teacher)
    model, tok = M.load(args.model, device, dtype)
    teacher = load_teacher(model, tok, args)  # (model, adapter): on the student's base where it can be
    run = runs.RunFolder(args.out, vars(args))
    optimizer = train.adapter_and_optimizer(model, args)
    rows = data.load_gsm8k("train", args.data_dir)
    end = min(args.steps, args.max_steps) if args.max_steps else args.steps

    for step in run.steps(model, optimizer, end, f"opd-{args.signal}"):
        batch = [rows[i] for i in data.batch_indices(len(rows), step, args.prompts_per_step, args.seed)]
        first, last = cli.split(len(batch), "--prompts-per-step")  # under torchrun, this process's prompts
        batch = batch[first:last]

        # the state source: the student's own trajectories (or the teacher's, or the dataset's)
        model.eval()
        sources = data.state_sources(weights, len(batch), (args.seed, step, first))
        drawn = {s: draw_states(s, model, teacher, tok, batch, args, run.step_seed(step) + first)
                 for s in set(sources)}  # each source every prompt: its own stream, mixed or not
        states = [drawn[s][i] for i, s in enumerate(sources)]  # each prompt's from its source
        sequences, starts = [r.sequence for r in states], [r.start for r in states]
        measures = where_states_lie(model, teacher, sequences, starts, [r.logprobs for r in states], args, tok.pad_id)

        # the signal: the teacher's continuations of the states at the cut points, or its next-token distribution
        if args.signal == "continuation":
            sequences, starts = teacher_continuations(teacher, tok, sequences, starts, args, (args.seed, step, first))
        model.train()
        loss, _, n_tokens = train.backward(lambda seqs, sts: signal_loss(model, teacher, seqs, sts, args, tok.pad_id),
                                           sequences, starts, args.grad_accum, args.micro_batch_tokens)
        run.check_finite(step + 1, loss)
        lr, grad_norm = train.optimizer_step(optimizer, step, args.steps, args.lr, args.warmup, args.grad_clip)

        rewards = [float(data.is_correct(r.text, row["gold"])) for r, row in zip(states, batch)]
        run.log(dict(step=step + 1, loss=loss, lr=lr, grad_norm=grad_norm, tokens=n_tokens,
                     **({"state_kl": loss} if args.signal == "logits" else {})), reward=(sum(rewards), len(rewards)),
                completion_len=(measures["state_nll"][1], len(rewards)), **measures,
                **{f"share_{s}": (sources.count(s), len(sources)) for s in weights if len(weights) > 1})
    print(f"done: adapter in {args.out}")


def signal_loss(model, teacher, sequences, starts, args, pad_id):
    """(loss, metrics) of one micro-batch, summed over its trained tokens: cross-entropy on
    the teacher's continuation tokens, the per-state KL to the teacher, or the sampled signal."""
    if args.signal == "continuation":
        return train.token_nll(train.sequence_logprobs(model, sequences, starts, pad_id)[0])
    student_h, targets, _ = train.sequence_states(model, sequences, starts, pad_id)
    # the teacher runs on the pass's own batch: where the models agree, KL and gradient are
    # then exactly zero, not the noise of two batch shapes that Adam would scale up
    teacher_h = train.frozen_states(*teacher, sequences, starts, pad_id)[0]
    if args.signal == "sampled":
        return sampled_token_loss(model.token_logprobs(student_h, targets), teacher[0].token_logprobs(teacher_h, targets))
    return train.token_kl(model, student_h, teacher_h, teacher[0].lm_head.weight, args.kl).sum(), {}


def sampled_token_loss(logp, teacher_logp, clip=0.2):
    """--signal sampled on tokens (N,): A = log pi_T - log pi_S, detached, through rl.policy_loss (ratio 1:
    one step a batch). Its gradient -A grad log pi_S(y) averages over y ~ pi_S to that of KL(pi_S || pi_T)."""
    return rl.policy_loss(logp, logp.detach(), (teacher_logp - logp).detach(), clip)


if __name__ == "__main__":
    cli.run_script(main, cli.MEMORY_FIX)
