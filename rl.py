"""
On-policy RL, GRPO-style (Shao et al. 2024, arXiv 2402.03300), in its minimal form.

State source:  the current policy's own rollouts, d^{pi_theta}: each step samples
               --group-size completions for each of --prompts-per-step GSM8K train
               prompts with sample.generate on the learner's current weights.
Signal source: a scalar exact-answer reward (data.is_correct: 1 if the answer equals the
               gold number, else 0), turned into a group-relative advantage
               (r - mean_group) / (std_group + 1e-4) shared by every token of a completion.

Departures from the textbook method: no value function (the group mean is the baseline);
no KL penalty by default (--kl-coef adds the k3 estimator against the base, the adapter
switched off); one gradient step per batch, so the PPO ratio is 1 up to the sampler's
rounding (logged: sampler_gap, its 95th percentile, clip_frac the tokens outside the clip
band) and clipping acts with --ppo-epochs > 1; a token-level mean over all completion
tokens of the batch (end-of-text included, so that it learns to stop).

    python rl.py                       # -> out/rl
    python rl.py --max-steps 20 --out out/rl-short
"""
import argparse
from dataclasses import replace

import torch

import data
import lora
import model as M
import train
from plumbing import cli, processes, runs
from sample import Sampling, generate


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/rl", help="run folder")
    p.add_argument("--steps", type=cli.number(int, 1), default=200, help="the schedule's length")
    p.add_argument("--prompts-per-step", type=cli.number(int, 1), default=8, help="train prompts")
    p.add_argument("--group-size", default=8, help="completions sampled per prompt",
                   type=cli.number(int, 2, why="the advantage compares a prompt's samples"))
    p.add_argument("--temperature", default=1.0, help="sampling temperature of the rollouts",
                   type=cli.number(float, 0, above=True, why="at 0 all samples are one"))
    p.add_argument("--max-new-tokens", type=cli.number(int, 1), default=256, help="longest one")
    p.add_argument("--ppo-epochs", type=cli.number(int, 1), default=1, help="1: on-policy")
    p.add_argument("--clip", type=cli.number(float, 0, above=True), default=0.2, help="PPO clip")
    p.add_argument("--kl-coef", type=cli.number(float, 0), default=0.0, help="k3 KL's weight")
    cli.add_training_args(p, lr=2e-5, rank=16, alpha=32, warmup=0.0)
    return p.parse_args(argv)


def group_advantages(rewards, group_size):
    """(r - mean) / (std + 1e-4) within each group of samples of one prompt (population std)."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group_size)
    std = r.std(1, unbiased=False, keepdim=True)
    return ((r - r.mean(1, keepdim=True)) / (std + 1e-4)).flatten()


def policy_loss(logp, old_logp, advantages, clip, ref_logp=None, kl_coef=0.0):
    """Clipped policy-gradient loss plus an optional k3 KL term, per token, (N,) each. Returns
    (loss, metrics), each summed over the tokens given (train.backward divides by the step's)
    but gaps, each token's |log pi - log pi_old|, whose tail measures the sampler's rounding."""
    ratio = (logp - old_logp).exp()
    pg = -torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    # on the first epoch logp and old_logp are one policy computed twice (trainer, sampler):
    # their gap is float rounding, the measure of how on-policy the step is
    gaps = (logp - old_logp).detach().abs()
    metrics = dict(clip_frac=((ratio - 1).abs() > clip).sum().item(),
                   sampler_gap=gaps.sum().item(), gaps=gaps.cpu())
    if ref_logp is not None and kl_coef > 0:
        # k3 estimator of KL(pi || ref): unbiased, never below 0 (Schulman 2020, "Approximating KL")
        log_r = ref_logp - logp
        kl = log_r.exp() - log_r - 1
        pg = pg + kl_coef * kl
        metrics["kl"] = kl.sum().item()
    return pg.sum(), metrics


def exact_answer_reward(rollout, row):
    return 1.0 if data.is_correct(rollout.text, row["gold"]) else 0.0


def main(argv=None, reward_fn=exact_answer_reward):
    args = parse_args(argv)
    device, dtype = cli.resolve(args)
    run = runs.RunFolder(args.out, vars(args), lora)
    model, tok = M.load(args.model, device, dtype)
    optimizer = train.adapter_and_optimizer(model, args.rank, args.alpha, args.lora_dropout,
                                            args.lr, args.weight_decay, args.seed, args.recompute)
    rows = data.load_gsm8k("train", args.data_dir)
    passes = train.Passes(args.grad_accum, args.micro_batch_tokens)
    sampling = Sampling(n=args.group_size, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, stop=data.GSM8K_STOP)  # seeded each step

    def loss_of(sequences, starts, old_logp, advantages, ref_logp):  # a pass's share of each
        logp, _ = train.sequence_logprobs(model, sequences, starts, tok.pad_id)
        return policy_loss(logp, old_logp, advantages, args.clip, ref_logp, args.kl_coef)

    for step in run.steps(model, optimizer, args.steps, "rl"):
        picked = data.batch_indices(len(rows), step, args.prompts_per_step, args.seed)
        first, last = processes.split(len(picked), "--prompts-per-step")  # torchrun's share
        batch = [rows[i] for i in picked[first:last]]

        # the state source: the current policy samples its own trajectories
        model.eval()
        sampling = replace(sampling, seed=run.step_seed(step) + first * args.group_size)
        rollouts = generate(model, tok, [data.gsm8k_prompt(r["question"]) for r in batch], sampling)
        sequences, starts = [r.sequence for r in rollouts], [r.start for r in rollouts]
        # the signal: each sample's reward against its prompt's others, on each of its tokens
        rewards = [reward_fn(r, batch[r.prompt_index]) for r in rollouts]
        advantages = [torch.full((len(r.completion_ids),), a, device=device) for r, a in
                      zip(rollouts, group_advantages(rewards, args.group_size).tolist())]
        sampler_logp = [torch.tensor(r.logprobs, device=device) for r in rollouts]  # "old"
        base_logp = train.base_logprobs(model, sequences, starts, tok.pad_id, passes)  # KL's ref

        model.train()
        for _ in range(args.ppo_epochs):  # at 1 epoch, on policy: the ratio is 1, no clip acts
            loss, metrics, n_tokens = train.backward(
                loss_of, sequences, starts, passes, old_logp=sampler_logp, advantages=advantages,
                ref_logp=base_logp)
            run.check_finite(step + 1, loss)
            lr, grad_norm = train.optimizer_step(optimizer, step, args.steps, args.lr, args.warmup,
                                                 args.grad_clip)
            norm = lora.cap_update_norm(model, args.max_update_norm)  # None: no cap

        # each token's |trainer - sampler| log-prob gap (the last epoch's): its tail shows bf16's
        p95 = torch.tensor(processes.joined(metrics.pop("gaps").tolist())).quantile(0.95).item()
        groups = torch.tensor(rewards).view(-1, args.group_size)
        n_sampled = sum(map(len, sampler_logp))
        # the states RL trains on are the policy's own: their NLL is that of its samples
        run.log(dict(step=step + 1, loss=loss, lr=lr, grad_norm=grad_norm, tokens=n_tokens,
                     update_norm=norm, sampler_gap_p95=p95, **metrics),
                reward=(sum(rewards), len(rewards)),
                no_signal_frac=((groups.std(1) == 0).sum().item(), len(groups)),
                completion_len=(n_sampled, len(rollouts)),
                state_nll=(-sum(sum(r.logprobs) for r in rollouts), n_sampled),
                state_nll_base=train.base_nll(base_logp))
    print(f"done: adapter in {args.out}")


if __name__ == "__main__":
    cli.run_script(main, cli.MEMORY_FIX)
