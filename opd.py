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

A teacher is a run folder (its adapter on the student's frozen base, one copy in memory; the
student takes its --model and --data-dir and runs beside it), a model folder or a hub id.

    python opd.py --teacher out/stress              # -> out/opd-stress
    python opd.py --teacher out/mild --signal logits --out out/opd-logits-mild
    python opd.py --teacher out/stress --state-source teacher --out out/kd-stress
"""
import argparse
import os
from dataclasses import dataclass, replace

import data
import lora
import model as M
import rl
import train
from plumbing import cli, processes, provenance, runs
from plumbing.files import InputError
from sample import Rollout, Sampling, generate, tokens_before_stop


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
    return p.parse_args(argv)


@dataclass(frozen=True)
class Teacher:
    """--teacher as open_teacher found it: a run folder, or a model's (a hub id's download)."""
    name: str  # as given
    folder: str
    is_run: bool = False
    run: dict | None = None  # a run folder's run.json (None: a peft adapter without one)
    sha256: str | None = None  # a run folder's adapter digest, kept in the student's run.json


def open_teacher(name):
    """--teacher classified, checked and fingerprinted once, before any model loads: a run
    folder (its run.json read, its adapter hashed), a model folder, or a hub id (fetched)."""
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        run = runs.check_run_folder(name, None, also=", or a model folder (config.json)")
        return Teacher(name, name, True, run, provenance.adapter_sha256(name))
    return Teacher(name, M.model_folder(name, "--teacher"))


def student_folder(args, teacher):
    """--out where not given: opd-<teacher>[-<source>-states], beside a run-folder teacher
    (out/toy/stress -> out/toy/opd-stress), else in out/."""
    source = "" if args.state_source == "student" else f"-{args.state_source}-states"
    folder = os.path.normpath(teacher.name)
    beside = os.path.dirname(folder) if teacher.is_run else "out"
    return os.path.join(beside, f"opd-{os.path.basename(folder)}{source}")


def load_teacher(model, tok, teacher, base):
    """(teacher model, its adapter): adapter 'teacher' on the student's shared base, the base
    itself (adapter None), or another model of the same tokenizer in a copy of its own."""
    if teacher.is_run:
        lora.load_adapter(model, teacher.folder, "teacher", activate=False, sha256=teacher.sha256)
        return model, "teacher"
    if provenance.same_model(teacher.name, base):  # the base itself, however spelt: no copy
        return model, None
    # token ids pass between the two models both ways, and their logits meet column by column
    mismatch = InputError(f"--teacher {teacher.name} has another tokenizer or vocabulary than "
                          f"--model {base}; pick a teacher of the student's model family")
    if M.read_config(teacher.folder).vocab_size != model.config.vocab_size:
        raise mismatch
    net, teacher_tok = M.load(teacher.folder, model.lm_head.weight.device,
                              model.lm_head.weight.dtype)
    if teacher_tok.tok.get_vocab() != tok.tok.get_vocab():
        raise mismatch
    return net, None


def state_sources(source_mix, n, rng_key):
    """Each of n prompts' state source, prompt i's drawn by source_mix from item_rng(rng_key, i)."""
    names = sorted(source_mix)
    return [data.item_rng(rng_key, i).choices(names, [source_mix[s] for s in names])[0]
            for i in range(n)]


def draw_states(source, model, teacher, tok, batch, sampling):
    """The step's state trajectories, a Rollout a prompt. student: the student's own rollouts
    (OPD), with its sampler's log-probs; teacher: the teacher's (offline distillation); data:
    the gold solutions (SFT's states). Trajectories the student did not draw have no log-probs."""
    if source == "data":
        gold = [data.gsm8k_gold_ids(tok, r) for r in batch]
        cut = sampling.max_new_tokens
        return [Rollout(p, a[:cut], None, tok.decode(a[:cut]), "data", i)
                for i, (p, a) in enumerate(gold)]
    sampler, adapter = (model, "default") if source == "student" else teacher
    with lora.use_adapter(sampler, adapter):
        rollouts = generate(sampler, tok, [data.gsm8k_prompt(r["question"]) for r in batch],
                            sampling)
    return rollouts if source == "student" else [replace(r, logprobs=None) for r in rollouts]


def teacher_continuations(teacher, tok, states, cuts, max_tokens, rng_key):
    """The teacher's greedy continuations, cut before a stop string, at `cuts` points of each
    trajectory before its own stop string (not inside a "\n\nQuestion:"), trajectory i's drawn
    from (seed, step, first + i) = rng_key + i: (sequences, starts) of prefix + teacher tokens."""
    prefixes = []
    for i, r in enumerate(states):  # a cut at 0 (the prompt alone) at the least
        n = max(1, len(tokens_before_stop(tok, r.completion_ids, data.GSM8K_STOP)))
        at = sorted(data.item_rng(rng_key, i).sample(range(n), min(cuts, n)))
        prefixes += [r.sequence[:r.start + t] for t in at]
    net, adapter = teacher
    with lora.use_adapter(net, adapter):
        conts = generate(net, tok, prefixes, Sampling(max_new_tokens=max_tokens, temperature=0,
                                                      stop=data.GSM8K_STOP))
    targets = [tokens_before_stop(tok, c.completion_ids, data.GSM8K_STOP) for c in conts]
    kept = [i for i, t in enumerate(targets) if t]  # one that stops at once teaches nothing
    return [prefixes[i] + targets[i] for i in kept], [len(prefixes[i]) for i in kept]


def main(argv=None):
    args = parse_args(argv)
    source_mix = cli.mixture(args.state_source, ("student", "teacher", "data"), "--state-source")
    opened = open_teacher(args.teacher)  # before any model loads: a mistyped path is said first
    args.out = args.out or student_folder(args, opened)
    device, dtype = cli.resolve(args, opened.run)
    if opened.run is not None:
        provenance.check_same_base(opened.folder, args.model, opened.run)
    run = runs.RunFolder(args.out, vars(args), lora, pinned={"teacher_sha256": opened.sha256})
    model, tok = M.load(args.model, device, dtype)
    teacher = load_teacher(model, tok, opened, args.model)  # (model, adapter)
    optimizer = train.adapter_and_optimizer(model, args.rank, args.alpha, args.lora_dropout,
                                            args.lr, args.weight_decay, args.seed, args.recompute)
    rows = data.load_gsm8k("train", args.data_dir)
    passes = train.Passes(args.grad_accum, args.micro_batch_tokens)
    state_kl = args.kl if args.log_state_kl and args.signal != "logits" else None

    def loss_of(sequences, starts):  # the teacher's signal on one pass's sequences
        return signal_loss(model, teacher, sequences, starts, args.signal, args.kl, tok.pad_id)

    for step in run.steps(model, optimizer, args.steps, f"opd-{args.signal}"):
        picked = data.batch_indices(len(rows), step, args.prompts_per_step, args.seed)
        first, last = processes.split(len(picked), "--prompts-per-step")  # torchrun's share
        batch, rng_key = [rows[i] for i in picked[first:last]], (args.seed, step, first)

        # the state source: the student's own trajectories (or the teacher's, or the dataset's)
        model.eval()
        sources = state_sources(source_mix, len(batch), rng_key)
        sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            stop=data.GSM8K_STOP, seed=run.step_seed(step) + first)
        drawn = {s: draw_states(s, model, teacher, tok, batch, sampling)
                 for s in set(sources)}  # each source every prompt: its own stream, mixed or not
        states = [drawn[s][i] for i, s in enumerate(sources)]  # each prompt's from its source
        sequences, starts = [r.sequence for r in states], [r.start for r in states]

        # the signal: the teacher's continuations at the cut points, or its distributions
        if args.signal == "continuation":
            sequences, starts = teacher_continuations(teacher, tok, states, args.cuts,
                                                      args.continuation_tokens, rng_key)
        measures = where_states_lie(model, teacher, states, (sequences, starts), tok.pad_id,
                                    passes, state_kl)
        model.train()
        loss, _, n_tokens = train.backward(loss_of, sequences, starts, passes)
        run.check_finite(step + 1, loss)
        lr, grad_norm = train.optimizer_step(optimizer, step, args.steps, args.lr, args.warmup,
                                             args.grad_clip)
        norm = lora.cap_update_norm(model, args.max_update_norm)  # None: no --max-update-norm

        record = dict(step=step + 1, loss=loss, lr=lr, grad_norm=grad_norm, tokens=n_tokens,
                      update_norm=norm, state_kl=loss if args.signal == "logits" else None)
        rewards = [float(data.is_correct(r.text, row["gold"])) for r, row in zip(states, batch)]
        means = dict(reward=(sum(rewards), len(rewards)))
        if len(source_mix) > 1:  # a mixture: the share of the states each source drew
            means.update({f"share_{s}": (sources.count(s), len(sources)) for s in source_mix})
        means["completion_len"] = (sum(len(r.completion_ids) for r in states), len(states))
        run.log(record, **means, **measures)
    print(f"done: adapter in {args.out}")


def where_states_lie(model, teacher, states, trained, pad_id, passes, kl=None):
    """run.log's means of where the states lie: the learner's NLL of the trajectories, the base's
    of the tokens the loss is computed on (trained), and given kl the teacher-student KL."""
    sequences, starts = [r.sequence for r in states], [r.start for r in states]
    out = dict(state_nll=train.learner_nll(model, sequences, starts,
                                           [r.logprobs for r in states], pad_id))
    out["state_nll_base"] = train.base_nll(train.base_logprobs(model, *trained, pad_id, passes))
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
