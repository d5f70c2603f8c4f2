"""rl.py: the policy's own rollouts, a group-relative reward, PPO's clipped objective."""

import pytest
import torch

import data
import lora
import model as M
import rl
from conftest import adapter_tensors, common, read_log
from sample import left_pad


def rewarded_token_run(tiny_model, data_dir, out, *extra):
    """rl.py rewarding one plausible but not dominant first token; that token's probability
    (averaged over prompts) under the base model and under the trained adapter, and the log."""
    m, tok = M.load(tiny_model)
    prompts = [data.gsm8k_prompt(r["question"]) for r in data.load_gsm8k("train", data_dir)[:4]]

    def first_token_probs(model):
        with torch.no_grad():
            ids, mask = left_pad([tok.encode(p) for p in prompts], tok.pad_id)
            return model(ids, attention_mask=mask)[:, -1].softmax(-1).mean(0)

    base_probs = first_token_probs(m)
    target = int(base_probs.argsort(descending=True)[5])
    reward = lambda rollout, row: float(target in rollout.completion_ids[:1])
    rl.main(common(tiny_model, data_dir, out, "--prompts-per-step", 4, "--group-size", 16, "--max-new-tokens", 1,
                   "--lr", 3e-2, "--rank", 4, "--alpha", 8, "--steps", 12, "--seed", 1, *extra),
            reward_fn=reward)
    lora.load_adapter(m, str(out))
    return base_probs[target].item(), first_token_probs(m)[target].item(), read_log(out)


def test_rl_raises_the_probability_of_the_rewarded_token(tiny_model, data_dir, tmp_path):
    before, after, log = rewarded_token_run(tiny_model, data_dir, tmp_path / "rl")
    # prompts are drawn from the whole train set, so this also checks it generalises over prompts
    assert after > 2 * before, (before, after)
    assert log[0]["reward"] < log[-1]["reward"]
    # in fp32 the trainer computes the sampler's log-probs up to rounding, in the tail too
    assert all(0 <= r["sampler_gap_p95"] < 1e-4 for r in log)
    assert all(r["clip_frac"] == 0 for r in log)  # no token outside the clip band
    # before its first update the policy is the base: the base's NLL of the step's rollouts is
    # the sampler's own; trained on them, the policy is another model
    assert abs(log[0]["state_nll_base"] - log[0]["state_nll"]) < 1e-4
    assert abs(log[-1]["state_nll_base"] - log[-1]["state_nll"]) > 0.1


def test_rl_kl_penalty_holds_the_policy_near_the_base_model(tiny_model, data_dir, tmp_path):
    before, free, _ = rewarded_token_run(tiny_model, data_dir, tmp_path / "free")
    same, held, log = rewarded_token_run(tiny_model, data_dir, tmp_path / "held", "--kl-coef", 1)
    assert same == before
    # the reference is the base model (the adapter switched off), which the policy equals
    # before its first update (LoRA's B starts at zero); later the policy has moved from it
    assert abs(log[0]["kl"]) < 1e-6 and log[-1]["kl"] > 1e-3, [r["kl"] for r in log]
    assert before < held and held - before < 0.5 * (free - before), (before, held, free)


def test_rl_group_advantages_are_rewards_standardised_within_each_prompts_group():
    adv = rl.group_advantages([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1], 4)
    # group one: mean 1/4, population std sqrt(3)/4; group two: mean 1/2, std 1/2
    std = 3 ** 0.5 / 4
    expected = [0.75 / (std + 1e-4), *[-0.25 / (std + 1e-4)] * 3, *[0.5 / 0.5001] * 2, *[-0.5 / 0.5001] * 2]
    assert adv[:8].tolist() == pytest.approx(expected, rel=1e-6)
    assert adv[8:].tolist() == [0.0] * 4  # every sample alike: nothing to learn from this prompt
    assert adv[:4].sum().item() == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("advantage,ratio,loss,clipped", [
    (1.0, 1.5, -1.2, True),    # a good token already made likelier than the clip allows: no further push
    (1.0, 0.5, -0.5, False),   # a good token made less likely: pushed back up
    (-1.0, 1.5, 1.5, False),   # a bad token made likelier: pushed back down
    (-1.0, 0.5, 0.8, True),    # a bad token already made unlikelier than the clip allows: left alone
    (1.0, 1.1, -1.1, False),   # inside the clip range the plain ratio times the advantage
])
def test_rl_policy_loss_is_ppos_pessimistic_clipped_objective(advantage, ratio, loss, clipped):
    old = torch.tensor([-2.0])
    logp = (old + torch.tensor([ratio]).log()).requires_grad_(True)
    value, metrics = rl.policy_loss(logp, old, torch.tensor([advantage]), clip=0.2)
    assert value.item() == pytest.approx(loss, rel=1e-6)
    value.backward()
    # the gradient of -ratio * A with respect to logp is -ratio * A, or zero where clipped
    assert logp.grad.item() == pytest.approx(0.0 if clipped else -ratio * advantage, rel=1e-6)
    assert metrics["clip_frac"] == (1.0 if abs(ratio - 1) > 0.2 else 0.0)


def test_rl_step_whose_every_group_got_one_reward_learns_nothing(tiny_model, data_dir, tmp_path):
    # every sample of a prompt rewarded alike: no advantage, so no gradient, however high the reward
    out = tmp_path / "rl"
    rl.main(common(tiny_model, data_dir, out, "--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 4,
                   "--max-steps", 2), reward_fn=lambda rollout, row: 1.0)
    log = read_log(out)
    assert [r["no_signal_frac"] for r in log] == [1.0, 1.0] and [r["reward"] for r in log] == [1.0, 1.0]
    assert all(r["loss"] == 0.0 and r["grad_norm"] == 0.0 for r in log)
    assert all(t.abs().max() == 0 for k, t in adapter_tensors(out).items() if "lora_B" in k)


def test_rl_k3_estimates_the_policys_kl_from_the_reference():
    """rl.policy_loss's KL term at tokens sampled from the policy averages to KL(policy || reference),
    and its gradient pulls each sampled token's log-prob towards the reference's."""
    g = torch.Generator().manual_seed(0)
    policy, reference = torch.randn(50, generator=g).log_softmax(0), torch.randn(50, generator=g).log_softmax(0)
    tokens = torch.multinomial(policy.exp(), 200_000, replacement=True, generator=g)
    logp = policy[tokens].clone().requires_grad_(True)
    zeros = torch.zeros_like(logp)
    loss, metrics = rl.policy_loss(logp, logp.detach(), zeros, 0.2, reference[tokens], kl_coef=1.0)
    exact = (policy.exp() * (policy - reference)).sum().item()  # KL(policy || reference)
    kl = metrics["kl"] / len(tokens)  # summed over the tokens, as train.backward weighs it
    assert abs(kl - exact) < 0.02 * exact, (kl, exact)
    assert loss.item() == pytest.approx(metrics["kl"], rel=1e-5)  # zero advantages: the KL term alone
    loss.backward()
    # d/dlogp of exp(ref - logp) - (ref - logp) - 1, summed over the tokens
    expected = 1 - (reference[tokens] - logp.detach()).exp()
    assert torch.allclose(logp.grad, expected, rtol=1e-5, atol=1e-12)
    assert rl.policy_loss(logp, logp.detach(), zeros, 0.2, logp.detach(), kl_coef=1.0)[1]["kl"] == 0.0


def test_every_sample_of_every_step_draws_from_a_stream_of_its_own(tiny_model, data_dir, tmp_path, monkeypatch):
    """Sample r of a step draws from a generator seeded with the step's seed + r: steps whose seeds
    lay next to each other would replay each other's samples, shifted by one."""
    streams, real_generate = [], rl.generate

    def record(model, tok, prompts, sampling, **k):
        streams.append({sampling.seed + r for r in range(len(prompts) * sampling.n)})
        return real_generate(model, tok, prompts, sampling, **k)
    monkeypatch.setattr(rl, "generate", record)
    rl.main(common(tiny_model, data_dir, tmp_path / "rl", "--prompts-per-step", 2, "--group-size", 3,
                   "--max-new-tokens", 2, "--max-steps", 3))
    assert len(streams) == 3 and all(len(s) == 6 for s in streams)
    assert not streams[0] & streams[1] and not streams[1] & streams[2] and not streams[0] & streams[2]
