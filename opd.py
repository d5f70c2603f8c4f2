"""
On-policy distillation (OPD): the student's states, the teacher's signal.

State source:  the student's own rollouts, d^{pi_S}: each step the student (base + its
               adapter) samples one completion per GSM8K train prompt with sample.generate.
  --state-source teacher: the teacher's rollouts, d^{pi_T}: offline (sequence-level)
               distillation, states that do not depend on the learner, as SFT's do not.
  --state-source data: GSM8K's gold solutions, d_data, SFT's states. Only the source
               changes, so a run against the default isolates the paper's variable; a
               mixture, student=0.25,data=0.75, draws each prompt's own: a dial.
Signal source: the teacher, queried at those states.
  --signal continuation (default, the paper's working variant, DAgger-like): at --cuts
               points t of each trajectory the teacher greedily continues (x, y_<t) for up
               to --continuation-tokens tokens; the student learns them by cross-entropy.
  --signal logits: per-token KL of the teacher's and the student's next-token distributions
               at every state, the one-step variant the paper saw collapse (GSM8K 0.040,
               its section 6); --kl forward is its eq. 7, KL(teacher || student), reverse
               the usual OPD objective.
  --signal sampled, the OPD most used today (the tinker cookbook's, TRL's, verl's): the
               advantage A_t = log pi_T(y_t|s_t) - log pi_S(y_t|s_t) at the drawn token,
               detached, through RL's clipped loss: a one-sample estimate of the gradient
               of --signal logits --kl reverse.

A teacher is a run folder (the base + its adapter, sharing the student's frozen weights in
memory; the student takes its --model and --data-dir and runs beside it) or a model id.

    python opd.py --teacher out/stress              # -> out/opd-stress
    python opd.py --teacher out/mild --signal logits --out out/opd-logits-mild
    python opd.py --teacher out/stress --state-source teacher --out out/kd-stress
"""
import argparse
import os
from dataclasses import replace

import data
import lora
import model as M
import rl
import train
from plumbing import cli, processes, runs
from sample import Rollout, generate, tokens_before_stop


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="run folder, model id or model folder")
    p.add_argument("--out", default=None, help="default: opd-<teacher>[-<source>-states] (above)")
    p.add_argument("--signal", choices=["continuation", "logits", "sampled"],
                   default="continuation", help="(above)")
    p.add_argument("--kl", choices=["forward", "reverse"], default="forward", help="(above)")
    p.add_argument("--state-source", default="student", help="(above)")
    p.add_argument("--steps", type=cli.number(int, 1), default=200, help="the schedule's length")
    p.add_argument("--prompts-per-step", type=cli.number(int, 1), default=8, help="a path each")
    p.add_argument("--temperature", type=cli.number(float, 0), default=1.0, help="of the states")
    p.add_argument("--max-new-tokens", type=cli.number(int, 1), default=256, help="longest path")
    p.add_argument("--cuts", type=cli.number(int, 1), default=4, help="(above)")
    p.add_argument("--continuation-tokens", type=cli.number(int, 1), default=32, help="(above)")
    p.add_argument("--log-state-kl", action="store_true", help="log the KL at the states too")
    cli.add_training_args(p, lr=1e-4, rank=16, alpha=32)
    args = p.parse_args(argv)
    source = "" if args.state_source == "student" else f"-{args.state_source}-states"
    folder = os.path.normpath(args.teacher)
    beside = os.path.dirname(folder) if os.path.isfile(os.path.join(folder, "run.json")) else "out"
    args.out = args.out or os.path.join(beside, f"opd-{os.path.basename(folder)}{source}")
    return args


def state_sources(weights, n, key):
    """The state source of each of n prompts of a step, prompt i drawn from item_rng(key, i)."""
    names = sorted(weights)
    return [data.item_rng(key, i).choices(names, [weights[s] for s in names])[0]
            for i in range(n)]


def draw_states(source, model, teacher, tok, batch, max_new_tokens, temperature, seed):
    """The step's state trajectories, a Rollout a prompt. student: the student's own rollouts
    (OPD), with its sampler's log-probs; teacher: the teacher's (offline distillation); data:
    the gold solutions (SFT's states). Trajectories the student did not draw have no log-probs."""
    if source == "data":
        gold = [data.gsm8k_gold_ids(tok, r) for r in batch]
        return [Rollout(p, a[:max_new_tokens], None, tok.decode(a[:max_new_tokens]), "data", i)
                for i, (p, a) in enumerate(gold)]
    sampler, adapter = (model, "default") if source == "student" else teacher
    with lora.use_adapter(sampler, adapter):
        rollouts = generate(sampler, tok, [data.gsm8k_prompt(r["question"]) for r in batch],
                            seed=seed, max_new_tokens=max_new_tokens, temperature=temperature,
                            stop=data.GSM8K_STOP)
    return rollouts if source == "student" else [replace(r, logprobs=None) for r in rollouts]


def teacher_continuations(teacher, tok, states, cuts, max_tokens, key):
    """The teacher's greedy continuations, cut before a stop string, at `cuts` points of each
    trajectory before its own stop string (not inside a "\n\nQuestion:"), trajectory i's drawn
    from (seed, step, first + i) = key + i: (sequences, starts) of prefix + teacher tokens."""
    prefixes = []
    for i, r in enumerate(states):  # a cut at 0 (the prompt alone) at the least
        n = max(1, len(tokens_before_stop(tok, r.completion_ids, data.GSM8K_STOP)))
        at = sorted(data.item_rng(key, i).sample(range(n), min(cuts, n)))
        prefixes += [r.sequence[:r.start + t] for t in at]
    net, adapter = teacher
    with lora.use_adapter(net, adapter):
        conts = generate(net, tok, prefixes, max_new_tokens=max_tokens, temperature=0,
                         stop=data.GSM8K_STOP)
    targets = [tokens_before_stop(tok, c.completion_ids, data.GSM8K_STOP) for c in conts]
    kept = [i for i, t in enumerate(targets) if t]  # one that stops at once teaches nothing
    return [prefixes[i] + targets[i] for i in kept], [len(prefixes[i]) for i in kept]


def main(argv=None):
    args = parse_args(argv)
    weights = cli.mixture(args.state_source, ("student", "teacher", "data"), "--state-source")
    device, dtype = cli.resolve(args, args.out if args.resume else None, args.teacher)
    runs.check_teacher(args.teacher, args.model)  # before any model loads
    model, tok = M.load(args.model, device, dtype)
    teacher = runs.load_teacher(model, tok, args.teacher, args.model)  # (model, adapter)
    run = runs.RunFolder(args.out, vars(args))
    optimizer = train.adapter_and_optimizer(model, args.rank, args.alpha, args.lora_dropout,
                                            args.lr, args.weight_decay, args.seed, args.recompute)
    rows = data.load_gsm8k("train", args.data_dir)
    end = min(args.steps, args.max_steps) if args.max_steps else args.steps
    passes = args.grad_accum, args.micro_batch_tokens  # a step's forward-backward passes
    state_kl = args.kl if args.log_state_kl and args.signal != "logits" else None

    for step in run.steps(model, optimizer, end, f"opd-{args.signal}"):
        picked = data.batch_indices(len(rows), step, args.prompts_per_step, args.seed)
        first, last = processes.split(len(picked), "--prompts-per-step")  # torchrun: this process's
        batch, key = [rows[i] for i in picked[first:last]], (args.seed, step, first)

        # the state source: the student's own trajectories (or the teacher's, or the dataset's)
        model.eval()
        sources = state_sources(weights, len(batch), key)
        drawn = {s: draw_states(s, model, teacher, tok, batch, args.max_new_tokens,
                                args.temperature, run.step_seed(step) + first)
                 for s in set(sources)}  # each source every prompt: its own stream, mixed or not
        states = [drawn[s][i] for i, s in enumerate(sources)]  # each prompt's from its source
        sequences, starts = [r.sequence for r in states], [r.start for r in states]
        measures = where_states_lie(model, teacher, states, tok.pad_id, passes, state_kl)

        # the signal: the teacher's continuations at the cut points, or its distributions
        if args.signal == "continuation":
            sequences, starts = teacher_continuations(teacher, tok, states, args.cuts,
                                                      args.continuation_tokens, key)
        model.train()
        loss, _, n_tokens = train.backward(lambda seqs, sts: signal_loss(
            model, teacher, seqs, sts, args.signal, args.kl, tok.pad_id), sequences, starts,
            *passes)
        run.check_finite(step + 1, loss)
        lr, grad_norm = train.optimizer_step(optimizer, step, args.steps, args.lr, args.warmup,
                                             args.grad_clip)

        rewards = [float(data.is_correct(r.text, row["gold"])) for r, row in zip(states, batch)]
        shares = {f"share_{s}": (sources.count(s), len(sources)) for s in weights}
        run.log(dict(step=step + 1, loss=loss, lr=lr, grad_norm=grad_norm, tokens=n_tokens,
                     **({"state_kl": loss} if args.signal == "logits" else {})),
                reward=(sum(rewards), len(rewards)), **(shares if len(weights) > 1 else {}),
                completion_len=(measures["state_nll"][1], len(rewards)), **measures)
    print(f"done: adapter in {args.out}")


def where_states_lie(model, teacher, states, pad_id, passes, kl=None):
    """run.log's means of where the step's states lie: the learner's and the base's NLL of the
    trajectories and, given kl (--log-state-kl), the teacher-student KL there."""
    sequences, starts = [r.sequence for r in states], [r.start for r in states]
    out = dict(state_nll=train.learner_nll(model, sequences, starts,
                                           [r.logprobs for r in states], pad_id))
    out["state_nll_base"] = train.base_nll(train.base_logprobs(model, sequences, starts, pad_id,
                                                               *passes))
    if kl is not None:
        student_h = train.frozen_states(model, "default", sequences, starts, pad_id)[0]
        teacher_h = train.frozen_states(*teacher, sequences, starts, pad_id)[0]
        token_kl = train.token_kl(model, student_h, teacher_h, teacher[0].lm_head.weight, kl)
        out["state_kl"] = (token_kl.sum().item(), len(token_kl))
    return out


def signal_loss(model, teacher, sequences, starts, signal, kl, pad_id):
    """(loss, metrics) of one micro-batch, summed over its trained tokens: cross-entropy on
    the teacher's continuation tokens, the per-state KL to the teacher, or the sampled signal."""
    if signal == "continuation":
        return train.token_nll(train.sequence_logprobs(model, sequences, starts, pad_id)[0])
    student_h, targets, _ = train.sequence_states(model, sequences, starts, pad_id)
    # the teacher runs on the pass's own batch: where the models agree, KL and gradient are
    # then exactly zero, not the noise of two batch shapes that Adam would scale up
    teacher_h = train.frozen_states(*teacher, sequences, starts, pad_id)[0]
    if signal == "sampled":
        return sampled_token_loss(model.token_logprobs(student_h, targets),
                                  teacher[0].token_logprobs(teacher_h, targets))
    return train.token_kl(model, student_h, teacher_h, teacher[0].lm_head.weight, kl).sum(), {}


def sampled_token_loss(logp, teacher_logp, clip=0.2):
    """--signal sampled on tokens (N,): A = log pi_T - log pi_S, detached, through rl.policy_loss
    (ratio 1); its gradient -A grad log pi_S(y) averages over y ~ pi_S to KL(pi_S || pi_T)'s."""
    return rl.policy_loss(logp, logp.detach(), (teacher_logp - logp).detach(), clip)


if __name__ == "__main__":
    cli.run_script(main, cli.MEMORY_FIX)
