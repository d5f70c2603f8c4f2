"""
On-policy RL, GRPO-style (Shao et al. 2024, arXiv 2402.03300), in its minimal form.

State source:  the current policy's own rollouts, d^{pi_theta}: each step samples
               --group-size completions for each of --prompts-per-step GSM8K train
               prompts with sample.generate on the learner's current weights.
Signal source: a scalar exact-answer reward (data.is_correct: 1 if the answer equals the
               gold number, else 0), turned into a group-relative advantage
               (r - mean_group) / (std_group + 1e-4) shared by every token of a completion.

Departures from the textbook method: no value function (the group mean is the baseline);
no KL penalty by default (--kl-coef adds the k3 estimator against the base model, computed
by switching the adapter off, not with a second model copy); one gradient step per batch,
so the PPO ratio is exactly 1 and clipping only acts with --ppo-epochs > 1; the loss is a
token-level mean over all completion tokens of the batch (end-of-text included, so the
policy also learns when to stop) rather than a per-sequence mean.

    python rl.py                       # -> out/rl
    python rl.py --max-steps 20 --out out/rl-short
"""
import argparse
import time

import torch
from tqdm import tqdm

import data
import lora
import model as M
import runs
from sample import generate


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/rl", help="run folder")
    p.add_argument("--steps", type=runs.number(int, 1), default=200, help="optimizer steps (the schedule's length)")
    p.add_argument("--prompts-per-step", type=runs.number(int, 1), default=8, help="GSM8K train prompts per step")
    p.add_argument("--group-size", default=8, help="completions sampled per prompt",
                   type=runs.number(int, 2, why="the advantage compares each sample with the others of its prompt"))
    p.add_argument("--temperature", default=1.0, help="sampling temperature of the rollouts",
                   type=runs.number(float, 0, above=True, why="at 0 a prompt's samples are all the same: no advantage"))
    p.add_argument("--max-new-tokens", type=runs.number(int, 1), default=256, help="longest completion")
    p.add_argument("--ppo-epochs", type=runs.number(int, 1), default=1,
                   help="gradient steps per batch of rollouts (1 = on-policy)")
    p.add_argument("--clip", type=runs.number(float, 0, above=True), default=0.2,
                   help="PPO ratio clip, used when --ppo-epochs > 1")
    p.add_argument("--kl-coef", type=runs.number(float, 0), default=0.0,
                   help="weight of the k3 KL estimate against the base model")
    runs.add_training_args(p, lr=2e-5, rank=16, alpha=32, warmup=0.0)
    return p.parse_args(argv)


def group_advantages(rewards, group_size):
    """(r - mean) / (std + 1e-4) within each group of samples of one prompt (population std)."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-4)).flatten()


def policy_loss(logp, old_logp, advantages, clip, ref_logp=None, kl_coef=0.0):
    """Clipped policy-gradient loss plus an optional k3 KL term, all per token, (N,) each.
    Returns (loss, metrics); the mean divides by the number of completion tokens given."""
    ratio = (logp - old_logp).exp()
    pg = -torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    # on the first epoch logp and old_logp are one policy computed twice (trainer, sampler):
    # their gap is float rounding, the measure of how on-policy the step is
    metrics = dict(clip_frac=((ratio - 1).abs() > clip).float().mean().item(),
                   sampler_gap=(logp - old_logp).abs().mean().item())
    if ref_logp is not None and kl_coef > 0:
        # k3 estimator of KL(pi || ref), unbiased and always >= 0 (Schulman 2020, "Approximating KL divergence")
        log_r = ref_logp - logp
        kl = log_r.exp() - log_r - 1
        pg = pg + kl_coef * kl
        metrics["kl"] = kl.mean().item()
    return pg.mean(), metrics


def exact_answer_reward(rollout, row):
    return 1.0 if data.is_correct(rollout.text, row["gold"]) else 0.0


def main(argv=None, reward_fn=exact_answer_reward):
    args = parse_args(argv)
    runs.model_and_data_from(args, args.out if args.resume else None)
    print(vars(args))
    device, dtype = runs.device_from_args(args)
    run = runs.RunFolder(args.out, args)
    model, tok = M.load(args.model, device, dtype)
    torch.manual_seed(args.seed)  # the initial LoRA A matrices
    lora.add_lora(model, args.rank, args.alpha, args.lora_dropout)
    model.recompute = args.recompute
    rows = data.load_gsm8k("train", args.data_dir)
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr, weight_decay=args.weight_decay)
    start = run.resume(model, optimizer) if args.resume else 0
    end = min(args.steps, args.max_steps) if args.max_steps else args.steps
    bar = tqdm(range(start, end), initial=start, total=end, desc="rl", disable=runs.RANK > 0)
    with run.stop_between_steps():  # a stop signal ends the run after a whole step, saved
        for step in bar:
            t0 = time.time()
            torch.manual_seed(args.seed * 1_000_003 + step)
            batch = [rows[i] for i in data.batch_indices(len(rows), step, args.prompts_per_step, args.seed)]
            first, last = runs.split(len(batch), "--prompts-per-step")  # under torchrun, this process's prompts
            batch = batch[first:last]

            # the state source: the current policy samples its own trajectories
            model.eval()
            rollouts = generate(model, tok, [data.gsm8k_prompt(r["question"]) for r in batch], n=args.group_size,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                stop=data.GSM8K_STOP, seed=args.seed * 1_000_003 + step + first * args.group_size)
            rewards = [reward_fn(r, batch[r.prompt_index]) for r in rollouts]
            advantages = group_advantages(rewards, args.group_size).to(device)
            sequences = [r.prompt_ids + r.completion_ids for r in rollouts]
            starts = [len(r.prompt_ids) for r in rollouts]
            n_tokens, logp_sum = runs.summed(sum(len(r.completion_ids) for r in rollouts),
                                             sum(map(sum, (r.logprobs for r in rollouts))))  # over the processes

            model.train()
            parts = runs.micro_batches(list(map(len, sequences)), args.grad_accum, args.micro_batch_tokens)
            olds = [torch.tensor([lp for i in part for lp in rollouts[i].logprobs], device=device) for part in parts]
            refs = [None] * len(parts)
            if args.kl_coef > 0:
                with torch.no_grad(), lora.use_adapter(model, None):
                    refs = [runs.sequence_logprobs(model, [sequences[i] for i in part], [starts[i] for i in part],
                                                tok.pad_id)[0] for part in parts]
            for _ in range(args.ppo_epochs):
                loss_sum, metrics = 0.0, {}
                for part, old_logp, ref_logp in zip(parts, olds, refs):
                    logp, seq = runs.sequence_logprobs(model, [sequences[i] for i in part], [starts[i] for i in part],
                                                    tok.pad_id)
                    loss, part_metrics = policy_loss(logp, old_logp, advantages[part][seq], args.clip, ref_logp,
                                                     args.kl_coef)
                    weight = logp.numel() / n_tokens  # micro-batches add up to the token mean of the whole batch
                    (loss * weight).backward()
                    loss_sum += loss.item() * weight
                    for k, v in part_metrics.items():
                        metrics[k] = metrics.get(k, 0.0) + v * weight
                loss_sum, *values = runs.summed(loss_sum, *metrics.values())
                metrics = dict(zip(metrics, values))
                run.check_finite(step + 1, loss_sum)
                lr, grad_norm = runs.optimizer_step(optimizer, step, args.steps, args)

            rewards = runs.joined(rewards)
            groups = torch.tensor(rewards).view(-1, args.group_size)
            record = dict(step=step + 1, loss=loss_sum, reward=sum(rewards) / len(rewards),
                          no_signal_frac=(groups.std(1, unbiased=False) == 0).float().mean().item(),
                          completion_len=n_tokens / len(rewards),
                          # the states RL trains on are the policy's own: their NLL is that of its samples
                          state_nll=-logp_sum / n_tokens, lr=lr,
                          grad_norm=grad_norm, tokens=n_tokens, seconds=time.time() - t0, **metrics)
            run.log(record)
            bar.set_postfix(reward=f"{record['reward']:.3f}", loss=f"{record['loss']:.4f}")
            run.end_step(model, optimizer, step + 1, end)
    run.finish(end)
    print(f"done: adapter in {args.out}")


if __name__ == "__main__":
    runs.run_script(main, runs.MEMORY_FIX)
