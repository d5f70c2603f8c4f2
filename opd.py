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
               (x, y_<t) for up to --continuation-tokens tokens; the student learns those
               teacher tokens with cross-entropy given that prefix.
  --signal logits: per-token KL between the teacher's and the student's next-token
               distributions at every state of the trajectory (--kl reverse, the usual
               OPD objective, or forward), the one-step variant the paper saw collapse
               (GSM8K 0.040, its section 6).

A teacher is a run folder (the base model + that run's adapter) or a model id. A run-folder
teacher shares the student's frozen base weights in memory: only the active adapter switches.

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
from tqdm import tqdm

import data
import lora
import model as M
from sample import generate


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="run folder (base + its adapter) or a model id / folder")
    p.add_argument("--out", default=None, help="run folder (default: out/opd-<teacher folder name>, + "
                                               "-teacher-states or -data-states for those state sources)")
    p.add_argument("--signal", choices=["continuation", "logits"], default="continuation", help="what the teacher supplies")
    p.add_argument("--kl", choices=["reverse", "forward"], default="reverse", help="KL direction for --signal logits")
    p.add_argument("--state-source", choices=["student", "teacher", "data"], default="student",
                   help="whose trajectories the states are: the student's rollouts (OPD), the teacher's (offline "
                        "distillation) or GSM8K's gold solutions")
    p.add_argument("--steps", type=M.number(int, 1), default=200, help="optimizer steps (the schedule's length)")
    p.add_argument("--prompts-per-step", type=M.number(int, 1), default=8, help="prompts per step (one trajectory each)")
    p.add_argument("--temperature", type=M.number(float, 0), default=1.0, help="sampling temperature of the state trajectories")
    p.add_argument("--max-new-tokens", type=M.number(int, 1), default=256, help="longest state trajectory (gold solutions are cut there)")
    p.add_argument("--cuts", type=M.number(int, 1), default=4, help="cut points per rollout where the teacher continues")
    p.add_argument("--continuation-tokens", type=M.number(int, 1), default=32, help="longest teacher continuation")
    lora.add_training_args(p, lr=1e-4, rank=16, alpha=32)
    args = p.parse_args(argv)
    source = "" if args.state_source == "student" else f"-{args.state_source}-states"
    args.out = args.out or f"out/opd-{os.path.basename(os.path.normpath(args.teacher))}{source}"
    return args


def load_teacher(model, tok, args):
    """Adapter 'teacher' on the shared base, or None when the teacher is the base itself.
    A different model id gets its own copy (it must share the tokenizer)."""
    if os.path.isdir(args.teacher) and os.path.isfile(os.path.join(args.teacher, "adapter_config.json")):
        lora.check_run_folder(args.teacher, args.model)
        try:
            lora.load_adapter(model, args.teacher, name="teacher", activate=False)
        except M.InputError as e:
            raise M.InputError(f"teacher {args.teacher}: {e}") from None
        return model, "teacher"
    if lora.same_model(args.teacher, args.model):  # the base itself, however spelt: no second copy
        return model, None
    if os.path.isdir(args.teacher) and not os.path.isfile(os.path.join(args.teacher, "config.json")):
        raise M.InputError(f"teacher {args.teacher} is neither a run folder (adapter_config.json) nor a model folder (config.json)")
    if not os.path.isdir(args.teacher) and args.teacher.count("/") != 1:
        raise M.InputError(f"teacher {args.teacher} does not exist; pass a run folder such as out/stress or a model id")
    folder = M.model_folder(args.teacher, "--teacher")
    config = M.read_config(folder)
    teacher_tok = M.load_tokenizer(folder, config)  # checked before the weights are read
    # token ids pass between the two models both ways, and their logits are compared row by row
    if (teacher_tok.tok.get_vocab() != tok.tok.get_vocab() or teacher_tok.eos_id != tok.eos_id
            or config.vocab_size != model.config.vocab_size):
        raise M.InputError(f"teacher {args.teacher} has another tokenizer or output vocabulary than --model "
                           f"{args.model}; pick a teacher that shares the student's tokenizer (the same model family)")
    return M.load(folder, model.lm_head.weight.device, model.lm_head.weight.dtype)[0], None


def continuation_loss(student_logp):
    """(loss, metrics): mean cross-entropy over every teacher token of the step."""
    return -student_logp.mean(), dict(tokens=student_logp.numel())


def logit_kl_loss(token_kl):
    """(loss, metrics): mean per-state KL over every student state of the step."""
    return token_kl.mean(), dict(tokens=token_kl.numel())


def main(argv=None):
    args = parse_args(argv)
    print(vars(args))
    device, dtype = M.device_from_args(args)
    model, tok = M.load(args.model, device, dtype)
    teacher, teacher_adapter = load_teacher(model, tok, args)
    run = lora.RunFolder(args.out, args, args.resume)
    torch.manual_seed(args.seed)  # the initial LoRA A matrices
    lora.add_lora(model, args.rank, args.alpha, args.lora_dropout, name="default")  # the student
    model.recompute = args.recompute
    rows = data.load_gsm8k("train", args.data_dir)
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr, weight_decay=args.weight_decay)
    start = run.resume(model, optimizer) if args.resume else 0
    end = min(args.steps, args.max_steps) if args.max_steps else args.steps

    def teacher_states(sequences, starts):  # the teacher's hidden states at the student's states
        training = teacher.training  # eval mode, so no adapter dropout, also amid the student's (shared) training pass
        with torch.no_grad(), lora.use_adapter(teacher.eval(), teacher_adapter), M.autocast(device):
            states = M.sequence_states(teacher, sequences, starts, tok.pad_id)[0]
        teacher.train(training)
        return states

    bar = tqdm(range(start, end), initial=start, total=end, desc=f"opd-{args.signal}")
    with run.stop_between_steps():  # a stop signal ends the run after a whole step, saved
        for step in bar:
            t0 = time.time()
            torch.manual_seed(args.seed * 1_000_003 + step)
            batch = [rows[i] for i in data.batch_indices(len(rows), step, args.prompts_per_step, args.seed)]

            # the state source: the student's own trajectories (or the teacher's, or the dataset's)
            model.eval()
            if args.state_source == "data":
                gold = [data.gsm8k_gold_ids(tok, r) for r in batch]
                answers = [a[:args.max_new_tokens] for _, a in gold]
                sequences = [p + a for (p, _), a in zip(gold, answers)]
                starts = [len(p) for p, _ in gold]
                texts = [tok.decode(a) for a in answers]
            else:
                sampler, adapter = (model, "default") if args.state_source == "student" else (teacher, teacher_adapter)
                with lora.use_adapter(sampler, adapter):  # in eval mode: the model above, a separate teacher always
                    rollouts = generate(sampler, tok, [data.gsm8k_prompt(r["question"]) for r in batch],
                                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        stop=data.GSM8K_STOP, seed=args.seed * 1_000_003 + step)
                sequences = [r.prompt_ids + r.completion_ids for r in rollouts]
                starts = [len(r.prompt_ids) for r in rollouts]
                texts = [r.text for r in rollouts]
            teacher_h = teacher_states(sequences, starts)  # once a step: the logged KL and, for --signal logits, the loss
            with torch.no_grad(), M.autocast(device):  # teacher-student KL on the states, logged for both signals
                student_h, targets, _ = M.sequence_states(model, sequences, starts, tok.pad_id)
                state_kl = model.token_kl(student_h, teacher_h, args.kl, teacher_head=teacher.lm_head.weight).mean().item()
                # on the student's own rollouts this is the sampler's log-prob of its tokens; on the
                # teacher's or the dataset's it says how far from the learner those states lie
                state_nll = -model.token_logprobs(student_h, targets).mean().item()

            if args.signal == "continuation":
                rng = random.Random(args.seed * 1_000_003 + step)
                prefixes = [seq[:start + t] for seq, start in zip(sequences, starts)
                            for t in sorted(rng.sample(range(len(seq) - start), min(args.cuts, len(seq) - start)))]
                with lora.use_adapter(teacher, teacher_adapter):  # the signal: teacher continues each state's prefix
                    conts = generate(teacher, tok, prefixes, max_new_tokens=args.continuation_tokens, temperature=0)
                seqs, seq_starts = [p + c.completion_ids for p, c in zip(prefixes, conts)], [len(p) for p in prefixes]
            else:
                seqs, seq_starts = sequences, starts
            model.train()
            n_tokens = sum(len(s) - st for s, st in zip(seqs, seq_starts))
            micro_batches = lora.micro_batches(seqs, args.grad_accum, args.micro_batch_tokens, device)
            loss_sum = 0.0
            for first, end_seq in micro_batches:
                part, part_starts = seqs[first:end_seq], seq_starts[first:end_seq]
                with M.autocast(device):
                    if args.signal == "continuation":
                        loss, metrics = continuation_loss(M.sequence_logprobs(model, part, part_starts, tok.pad_id)[0])
                    else:
                        student_h = M.sequence_states(model, part, part_starts, tok.pad_id)[0]
                        # a split step runs the teacher on each micro-batch too, in the student's rows: where
                        # the models agree, KL and gradient are then exactly zero, not noise Adam scales up
                        part_teacher_h = teacher_h if len(micro_batches) == 1 else teacher_states(part, part_starts)
                        loss, metrics = logit_kl_loss(model.token_kl(student_h, part_teacher_h, args.kl,
                                                                     teacher_head=teacher.lm_head.weight))
                weight = metrics["tokens"] / n_tokens  # micro-batches add up to the token mean of the whole step
                (loss * weight).backward()
                loss_sum += loss.item() * weight
            run.check_finite(step + 1, loss_sum)
            lr, grad_norm = lora.optimizer_step(optimizer, step, args.steps, args)

            rewards = [float(data.is_correct(text, row["gold"])) for text, row in zip(texts, batch)]
            run.log(dict(step=step + 1, loss=loss_sum, state_kl=state_kl, state_nll=state_nll, reward=statistics.mean(rewards),
                         completion_len=statistics.mean(len(q) - st for q, st in zip(sequences, starts)), lr=lr,
                         grad_norm=grad_norm, tokens=n_tokens, seconds=time.time() - t0))
            bar.set_postfix(loss=f"{loss_sum:.4f}", kl=f"{state_kl:.4f}")
            run.end_step(model, optimizer, step + 1, end)
    run.finish(end)
    print(f"done: adapter in {args.out}")


if __name__ == "__main__":
    M.run_script(main, lora.MEMORY_FIX)
