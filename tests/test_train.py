import json
import os
import subprocess
import sys

import pytest
import torch

import data
import lora
import model as M
import opd
import rl
import runs
import sft
from conftest import DEVICES, ROOT, hold_in_another_process, randomize_adapter, save_hf_model
from sample import find_stop, left_pad, tokens_before_stop

LOG_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens", "seconds", "state_nll"}
# a random model's completions are never right: rl.py's runs in these tests reward each prompt's
# first sample, so that every group has an advantage to learn from
MAINS = {"sft": sft.main, "rl": lambda argv: rl.main(argv, reward_fn=lambda rollout, row: float(rollout.sample_index == 0)),
         "opd": opd.main}


def common(tiny_model, data_dir, out, *extra):
    return ["--model", tiny_model, "--data-dir", str(data_dir), "--out", str(out), *map(str, extra)]


def read_log(folder):
    return [json.loads(l) for l in open(os.path.join(folder, "log.jsonl"))]


def adapter_tensors(folder):
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "adapter_model.safetensors"))


def write_fixed_answer_data(source, folder, answer, n=24):
    """GSM8K-format data whose every answer is the same string."""
    rows = data.load_gsm8k("train", source)[:n]
    os.makedirs(os.path.join(folder, "gsm8k"), exist_ok=True)
    for split in ("train", "test"):
        with open(os.path.join(folder, "gsm8k", f"{split}.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps({"question": r["question"], "answer": answer}) + "\n")
    return folder


@pytest.mark.parametrize("script,extra", [
    ("sft.py", ["--train-limit", 16, "--batch-size", 4, "--max-steps", 2]),
    ("rl.py", ["--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 8, "--max-steps", 2, "--kl-coef", 0.1]),
    ("opd.py", ["--teacher", "BASE", "--prompts-per-step", 2, "--max-new-tokens", 8, "--max-steps", 2]),
    ("opd.py", ["--teacher", "BASE", "--signal", "logits", "--prompts-per-step", 2, "--max-new-tokens", 8,
                "--max-steps", 2]),
])
@pytest.mark.parametrize("device", DEVICES)  # on CUDA: bf16 weights, the captured decode step
def test_scripts_run_from_the_command_line(tiny_model, data_dir, tmp_path, script, extra, device):
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM
    out = tmp_path / "run"
    extra = [tiny_model if e == "BASE" else e for e in extra]
    subprocess.run([sys.executable, os.path.join(ROOT, script), *common(tiny_model, data_dir, out, *extra),
                    "--device", device], check=True, capture_output=True, text=True)
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2] and all(LOG_FIELDS <= set(r) for r in log)
    run = json.loads((out / "run.json").read_text())
    assert run["model"] == tiny_model and "git_commit" in run
    ours, tok = M.load(tiny_model)
    lora.load_adapter(ours, str(out))
    ref = PeftModel.from_pretrained(Qwen3ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), str(out)).eval()
    ids = torch.tensor([tok.encode("Question: 1 + 1?\nAnswer:")])
    with torch.no_grad():
        assert (ours(ids) - ref(input_ids=ids).logits).abs().max() < 1e-5


def answer_nll(tiny_model, adapter, examples):
    m, tok = M.load(tiny_model)
    if adapter:
        lora.load_adapter(m, adapter)
    with torch.no_grad():
        seqs = [tok.encode(p) for p, _ in examples]
        full = [tok.encode(p + " " + a) + [tok.eos_id] for p, a in examples]
        logp, _ = runs.sequence_logprobs(m, full, [len(s) for s in seqs])
    return -logp.mean().item()


def test_sft_learns_its_four_examples(tiny_model, data_dir, tmp_path):
    out = tmp_path / "sft"
    sft.main(common(tiny_model, data_dir, out, "--train-limit", 4, "--batch-size", 4, "--epochs", 100,
                    "--lr", 2e-2, "--rank", 16, "--alpha", 32, "--lora-dropout", 0, "--warmup", 0))
    rows = data.load_gsm8k("train", data_dir)[:4]
    examples = [(data.gsm8k_prompt(r["question"]), r["answer"]) for r in rows]
    before, after = answer_nll(tiny_model, None, examples), answer_nll(tiny_model, str(out), examples)
    assert after < 0.2 * before, (before, after)
    log = read_log(out)
    assert log[-1]["loss"] < 0.2 * log[0]["loss"]


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


def test_rl_kl_penalty_holds_the_policy_near_the_base_model(tiny_model, data_dir, tmp_path):
    before, free, _ = rewarded_token_run(tiny_model, data_dir, tmp_path / "free")
    same, held, log = rewarded_token_run(tiny_model, data_dir, tmp_path / "held", "--kl-coef", 3)
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
    assert abs(metrics["kl"] - exact) < 0.02 * exact, (metrics["kl"], exact)
    assert loss.item() == pytest.approx(metrics["kl"], rel=1e-6)  # zero advantages: the KL term alone
    loss.backward()
    # d/dlogp of exp(ref - logp) - (ref - logp) - 1, over the token mean
    expected = (1 - (reference[tokens] - logp.detach()).exp()) / len(tokens)
    assert torch.allclose(logp.grad, expected, rtol=1e-5, atol=1e-12)
    assert rl.policy_loss(logp, logp.detach(), zeros, 0.2, logp.detach(), kl_coef=1.0)[1]["kl"] == 0.0


def test_opd_student_learns_the_teachers_fixed_answer(tiny_model, data_dir, tmp_path):
    answer = "The answer is 7.\n#### 7"
    fixed = write_fixed_answer_data(data_dir, str(tmp_path / "data"), answer)
    teacher = tmp_path / "teacher"
    sft.main(common(tiny_model, fixed, teacher, "--batch-size", 8, "--epochs", 30, "--lr", 1e-2, "--rank", 8,
                    "--alpha", 16, "--lora-dropout", 0, "--warmup", 0))
    m, tok = M.load(tiny_model)
    prompts = [data.gsm8k_prompt(r["question"]) for r in data.load_gsm8k("train", fixed)[:6]]
    from sample import generate
    lora.load_adapter(m, str(teacher))
    assert all(r.text == " " + answer for r in generate(m, tok, prompts, max_new_tokens=16, temperature=0))
    lora.set_adapter(m, None)
    assert not any(r.text == " " + answer for r in generate(m, tok, prompts, max_new_tokens=16, temperature=0))

    student = tmp_path / "student"
    opd.main(common(tiny_model, fixed, student, "--teacher", teacher, "--prompts-per-step", 8, "--max-new-tokens", 20,
                    "--continuation-tokens", 20, "--lr", 1e-2, "--rank", 8, "--alpha", 16, "--steps", 80))
    s, _ = M.load(tiny_model)
    lora.load_adapter(s, str(student))
    # the teacher's answer first (what follows it depends on the teacher's continuations of the
    # student's early, random states, where this teacher repeats its last line)
    texts = [r.text for r in generate(s, tok, prompts, max_new_tokens=16, temperature=0)]
    assert all(t.startswith(" " + answer) for t in texts), texts


def test_opd_resumed_after_its_teacher_was_trained_further_stops(tiny_model, data_dir, tmp_path):
    """The student's second half would learn from another teacher than its first, unseen."""
    import hashlib
    teacher, student = tmp_path / "teacher", tmp_path / "student"
    train_teacher = common(tiny_model, data_dir, teacher, "--train-limit", 8, "--batch-size", 4, "--lr", 1e-2)
    sft.main([*train_teacher, "--max-steps", "1"])
    distil = common(tiny_model, data_dir, student, "--teacher", teacher, "--prompts-per-step", 1, "--max-new-tokens", 4,
                    "--continuation-tokens", 2, "--steps", 3, "--save-every", 1)
    opd.main([*distil, "--max-steps", "1"])
    recorded = json.loads((student / "run.json").read_text())["teacher_sha256"]
    assert recorded == hashlib.sha256((teacher / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert not runs.teacher_changed(str(student))
    opd.main([*distil, "--max-steps", "2", "--resume"])  # the same teacher: resumes
    sft.main([*train_teacher, "--max-steps", "2", "--resume"])
    assert runs.teacher_changed(str(student))
    with pytest.raises(M.InputError, match=f"{student} was distilled from another adapter than {teacher} holds now"):
        opd.main([*distil, "--resume"])
    assert len(read_log(student)) == 2
    # a teacher given as a model folder has no adapter to change
    base_taught = tmp_path / "base-taught"
    opd.main(common(tiny_model, data_dir, base_taught, "--teacher", tiny_model, "--prompts-per-step", 1,
                    "--max-new-tokens", 4, "--continuation-tokens", 2, "--max-steps", 1))
    assert json.loads((base_taught / "run.json").read_text())["teacher_sha256"] is None
    assert not runs.teacher_changed(str(base_taught))


def test_a_run_in_use_elsewhere_is_not_read_as_a_teacher_nor_evaluated_nor_measured(tiny_model, data_dir, tmp_path):
    """Its adapter changes under the reader: a student would learn from two teachers, an
    evaluation or a drift would score one adapter of many, half way through the run."""
    import drift
    import evaluate
    teacher = tmp_path / "teacher"
    sft.main(common(tiny_model, data_dir, teacher, "--train-limit", 4, "--batch-size", 4, "--max-steps", 1))
    holder = hold_in_another_process(str(teacher))  # as sft.py --resume would, training it further
    still = rf"^{teacher} is in use by another process \(pid {holder.pid}\), which trains or evaluates it; wait for it to end$"
    try:
        with pytest.raises(M.InputError, match=still):
            opd.main(common(tiny_model, data_dir, tmp_path / "student", "--teacher", teacher, "--max-steps", 1))
        assert not (tmp_path / "student").exists()
        with pytest.raises(M.InputError, match=still):
            evaluate.main([str(teacher), "--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path)])
        with pytest.raises(M.InputError, match=still):
            drift.main([str(teacher), "--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path)])
        assert not (teacher / "eval.json").exists() and not (teacher / "drift.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert runs.held_elsewhere(str(teacher)) is None
    # an evaluation holds what it writes: the base's --out and each run, for as long as it runs
    holder = hold_in_another_process(str(tmp_path / "out"))
    try:
        with pytest.raises(M.InputError, match=rf"^{tmp_path / 'out'} is in use by another process \(pid {holder.pid}\); "
                                               rf"wait for it to end$"):
            evaluate.main(["base", "--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path / "out")])
    finally:
        holder.kill()
        holder.wait()
    evaluate.main([str(teacher), "--model", tiny_model, "--data-dir", str(data_dir), "--out", str(tmp_path / "out"),
                   "--gsm8k-limit", "2", "--max-new-tokens", "4", "--mmlu-limit", "2", "--truthfulqa-limit", "2"])
    assert (teacher / "eval.json").exists()
    holder = hold_in_another_process(str(teacher))  # let go once written
    holder.kill()
    holder.wait()


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_opd_token_kl_and_its_gradient_equal_the_plain_formula(tiny_model, direction):
    student, _ = M.load(tiny_model)
    g = torch.Generator().manual_seed(0)
    hidden, vocab = student.config.hidden_size, student.config.vocab_size
    student_h, teacher_h = torch.randn(7, hidden, generator=g), torch.randn(7, hidden, generator=g)
    teacher_head = student.lm_head.weight + 0.5 * torch.randn(student.lm_head.weight.shape, generator=g)
    h1, h2 = student_h.clone().requires_grad_(True), student_h.clone().requires_grad_(True)
    got = opd.token_kl(student, h1, teacher_h, teacher_head, direction, chunk_logits=3 * vocab)  # uneven chunks
    log_s, log_t = student.lm_head(h2).log_softmax(-1), (teacher_h @ teacher_head.T).log_softmax(-1)
    p, log_p, log_q = (log_t.exp(), log_t, log_s) if direction == "forward" else (log_s.exp(), log_s, log_t)
    expected = (p * (log_p - log_q)).sum(-1)  # KL(p || q) as autograd differentiates it
    assert expected.min() > 0.01 and torch.allclose(got, expected, atol=1e-6)
    weights = torch.linspace(-1.0, 2.0, 7)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-6)


@pytest.mark.parametrize("split", [[], ["--micro-batch-tokens", 1]])  # one pass a step, a pass a sequence
def test_opd_logit_kl_is_zero_when_the_teacher_is_the_student(tiny_model, data_dir, tmp_path, split):
    out = tmp_path / "opd"
    opd.main(common(tiny_model, data_dir, out, "--teacher", tiny_model, "--signal", "logits", "--prompts-per-step", 2,
                    "--max-new-tokens", 8, "--max-steps", 3, *split))
    log = read_log(out)
    assert all(r["loss"] == 0.0 and r["state_kl"] == 0.0 and r["grad_norm"] == 0.0 for r in log)
    assert all(t.abs().max() == 0 for k, t in adapter_tensors(out).items() if "lora_B" in k)


def test_a_teacher_that_is_the_base_model_however_spelt_shares_the_students_copy(tiny_model, tmp_path):
    import argparse
    model, tok = M.load(tiny_model)
    relative = os.path.relpath(tiny_model)
    for spelt in (tiny_model, tiny_model + "/", relative, os.path.join(relative, ".")):
        assert opd.load_teacher(model, tok, argparse.Namespace(teacher=spelt, model=tiny_model)) == (model, None), spelt
    os.symlink(tiny_model, tmp_path / "linked")
    assert opd.load_teacher(model, tok, argparse.Namespace(teacher=str(tmp_path / "linked"), model=tiny_model))[0] is model


def test_opd_logit_kl_reads_a_separate_teachers_logits_from_its_own_output_layer(tiny_model, data_dir, tmp_path):
    # the teacher: the student's base with an output layer of its own. At the first step the
    # student is that base, so the two models' states are the same and only the output
    # layers tell the two distributions apart
    from safetensors.torch import load_file, save_file
    import shutil
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model, teacher)
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=False)))
    weights = load_file(str(teacher / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    weights["lm_head.weight"] = torch.randn(weights["model.embed_tokens.weight"].shape, generator=g) * 0.5
    save_file(weights, str(teacher / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "opd"
    opd.main(common(tiny_model, data_dir, out, "--teacher", teacher, "--signal", "logits", "--prompts-per-step", 2,
                    "--max-new-tokens", 8, "--max-steps", 1))
    (first,) = read_log(out)
    assert first["state_kl"] > 0.1 and first["loss"] == pytest.approx(first["state_kl"], rel=1e-5)
    assert any(t.abs().max() > 0 for k, t in adapter_tensors(out).items() if "lora_B" in k)


def test_a_split_logit_kl_step_reads_a_run_folder_teacher_without_its_dropout(tiny_model, data_dir, tmp_path):
    # a teacher trained with LoRA dropout keeps it in its adapter_config.json; a split step
    # runs the teacher again amid the student's training pass, on the shared base, and must
    # still run it as in evaluation, as the unsplit step does
    m, _ = M.load(tiny_model)
    lora.add_lora(m, rank=2, alpha=4, dropout=0.5)
    randomize_adapter(m, seed=3, scale=0.3)
    lora.save_adapter(m, str(tmp_path / "teacher"), base_model=tiny_model)
    assert json.loads((tmp_path / "teacher" / "adapter_config.json").read_text())["lora_dropout"] == 0.5
    logs = []
    for name, split in (("one", []), ("split", ["--micro-batch-tokens", 1])):
        opd.main(common(tiny_model, data_dir, tmp_path / name, "--teacher", tmp_path / "teacher", "--signal", "logits",
                        "--prompts-per-step", 3, "--max-new-tokens", 6, "--max-steps", 1, *split))
        logs.append(read_log(tmp_path / name)[0])
    assert logs[0]["loss"] > 0.01 and logs[1]["loss"] == pytest.approx(logs[0]["loss"], rel=1e-5)
    assert logs[1]["grad_norm"] == pytest.approx(logs[0]["grad_norm"], rel=1e-5)


def test_opd_on_gold_states_logs_the_reward_of_gold_answers(tiny_model, data_dir, tmp_path):
    # --state-source data: the states are GSM8K's own solutions, each right by definition when
    # none is cut short, so the logged reward of the states is 1 at every step
    out = tmp_path / "opd"
    opd.main(common(tiny_model, data_dir, out, "--teacher", tiny_model, "--state-source", "data", "--prompts-per-step", 3,
                    "--max-new-tokens", 2000, "--continuation-tokens", 2, "--max-steps", 2))
    assert [r["reward"] for r in read_log(out)] == [1.0, 1.0]


def split_at_starts(calls):
    """{(state, target)} of every training pass recorded as (sequences, starts)."""
    return {(tuple(s[:st]), tuple(s[st:])) for seqs, starts in calls for s, st in zip(seqs, starts)}


def teacher_signal(tok, prefixes, continuations):
    """{(prefix, what the teacher continued it with, up to a stop string)} that OPD trains on."""
    import data
    pairs = {(tuple(p), tuple(tokens_before_stop(tok, c.completion_ids, data.GSM8K_STOP)))
             for p, c in zip(prefixes, continuations)}
    return {pair for pair in pairs if pair[1]}


def test_state_sources_are_what_the_docstrings_say(tiny_model, data_dir, tmp_path, monkeypatch):
    trained, sampled = [], []  # (sequences, starts) of every training pass; every generate call's rollouts
    real_logprobs, real_generate = runs.sequence_logprobs, rl.generate

    def record_logprobs(model, sequences, starts, pad_id=0):
        if torch.is_grad_enabled():
            trained.append((sequences, starts))
        return real_logprobs(model, sequences, starts, pad_id)

    def record_generate(model, tok, prompts, *a, **k):
        out = real_generate(model, tok, prompts, *a, **k)
        sampled.append((lora.active_adapter(model), prompts, k.get("stop"), out))
        return out

    monkeypatch.setattr(runs, "sequence_logprobs", record_logprobs)
    # SFT: every training state's prompt is a dataset prompt and the rest is dataset text
    sft.main(common(tiny_model, data_dir, tmp_path / "sft", "--train-limit", 8, "--batch-size", 4, "--max-steps", 1))
    _, tok = M.load(tiny_model)
    rows = data.load_gsm8k("train", data_dir)[:8]
    gold = {tuple(p + a) for p, a in (data.gsm8k_gold_ids(tok, r) for r in rows)}
    (seqs, starts), = trained
    assert len(seqs) == 4 and all(tuple(s) in gold for s in seqs)
    assert all(tok.decode(s[:st]) in {data.gsm8k_prompt(r["question"]) for r in rows} for s, st in zip(seqs, starts))

    # RL: the sequences trained on are exactly prompt + completion tokens the sampler returned this step
    monkeypatch.setattr(rl, "generate", record_generate)
    trained.clear()
    rl.main(common(tiny_model, data_dir, tmp_path / "rl", "--prompts-per-step", 2, "--group-size", 3,
                   "--max-new-tokens", 6, "--max-steps", 2))
    assert len(trained) == 2 and len(sampled) == 2
    for (seqs, starts), (adapter, _, _, rollouts) in zip(trained, sampled):
        assert adapter == "default"
        assert split_at_starts([(seqs, starts)]) == {(tuple(r.prompt_ids), tuple(r.completion_ids)) for r in rollouts}

    # OPD: the student samples the states (its adapter active) and the teacher continues them, stopping
    # where a rollout stops; the student trains on exactly the teacher's tokens after each prefix
    trained.clear(), sampled.clear()
    monkeypatch.setattr(opd, "generate", record_generate)
    opd.main(common(tiny_model, data_dir, tmp_path / "opd", "--teacher", tmp_path / "sft", "--prompts-per-step", 2,
                    "--max-new-tokens", 6, "--max-steps", 1))
    (student, _, _, rollouts), (teacher, prefixes, stop, continuations) = sampled
    assert (student, teacher, stop) == ("default", "teacher", data.GSM8K_STOP)
    states = [r.prompt_ids + r.completion_ids for r in rollouts]
    assert all(any(s[:len(p)] == p for s in states) for p in prefixes)
    assert split_at_starts(trained) == teacher_signal(tok, prefixes, continuations)


def test_opd_targets_end_before_a_stop_string(tiny_model, data_dir, tmp_path, monkeypatch):
    # a teacher that goes on into a new question: what it writes after its answer is not taught
    real_generate = opd.generate
    _, tok = M.load(tiny_model)
    answer, beyond = tok.encode(" 3 + 4 = 7.\n#### 7"), tok.encode("\n\nQuestion: Tom has 5 pens.")
    assert find_stop(tok.decode(answer + beyond), data.GSM8K_STOP) >= 0

    def teacher_runs_on(model, tok, prompts, *a, **k):
        out = real_generate(model, tok, prompts, *a, **k)
        if lora.active_adapter(model) is None:  # the teacher, the base model here
            assert k["stop"] == data.GSM8K_STOP
            for r in out:
                r.completion_ids = answer + beyond
        return out
    monkeypatch.setattr(opd, "generate", teacher_runs_on)
    trained = []
    real_logprobs = runs.sequence_logprobs
    monkeypatch.setattr(runs, "sequence_logprobs", lambda m, seqs, st, pad_id=0: (
        trained.extend(s[t:] for s, t in zip(seqs, st)) if torch.is_grad_enabled() else None)
        or real_logprobs(m, seqs, st, pad_id))
    opd.main(common(tiny_model, data_dir, tmp_path / "opd", "--teacher", tiny_model, "--prompts-per-step", 2,
                    "--max-new-tokens", 6, "--max-steps", 1))
    assert trained and all(t == tokens_before_stop(tok, answer + beyond, data.GSM8K_STOP) for t in trained)
    assert all(find_stop(tok.decode(t), data.GSM8K_STOP) == -1 and len(t) >= len(answer) for t in trained)


def test_opd_state_source_changes_only_where_the_states_come_from(tiny_model, data_dir, tmp_path, monkeypatch):
    sft.main(common(tiny_model, data_dir, tmp_path / "sft", "--train-limit", 8, "--batch-size", 4, "--max-steps", 2,
                    "--lr", 1e-2))
    calls = []  # (active adapter, prompts, rollouts) of every generate call opd makes
    real_generate = opd.generate

    def record_generate(model, tok, prompts, *a, **k):
        out = real_generate(model, tok, prompts, *a, **k)
        calls.append((lora.active_adapter(model), prompts, out))
        return out

    monkeypatch.setattr(opd, "generate", record_generate)
    trained = []
    real_logprobs = runs.sequence_logprobs
    monkeypatch.setattr(runs, "sequence_logprobs", lambda m, seqs, st, pad_id=0: (
        trained.append((seqs, st)) if torch.is_grad_enabled() else None) or real_logprobs(m, seqs, st, pad_id))
    _, tok = M.load(tiny_model)

    def run(source, *extra):
        calls.clear(), trained.clear()
        out = tmp_path / (source + "".join(map(str, extra)))
        opd.main(common(tiny_model, data_dir, out, "--teacher", tmp_path / "sft", "--state-source", source,
                        "--prompts-per-step", 2, "--max-new-tokens", 6, "--continuation-tokens", 4, "--max-steps", 1,
                        *extra))
        return read_log(out)[0]

    def check_trained_on(states):
        _, prefixes, conts = calls[-1]  # the teacher's continuations, the signal
        assert all(any(s[:len(p)] == p for s in states) for p in prefixes)
        assert split_at_starts(trained) == teacher_signal(tok, prefixes, conts)

    # the student's rollouts: sampled with the student adapter; the logged state NLL is the
    # sampler's own log-probs of those tokens
    log = run("student")
    assert [c[0] for c in calls] == ["default", "teacher"]
    rollouts = calls[0][2]
    check_trained_on([r.prompt_ids + r.completion_ids for r in rollouts])
    sampled_nll = -sum(lp for r in rollouts for lp in r.logprobs) / sum(len(r.logprobs) for r in rollouts)
    assert abs(log["state_nll"] - sampled_nll) < 1e-4

    # the teacher's rollouts: the states are sampled with the teacher adapter too
    log = run("teacher")
    assert [c[0] for c in calls] == ["teacher", "teacher"]
    rollouts = calls[0][2]
    check_trained_on([r.prompt_ids + r.completion_ids for r in rollouts])
    assert log["completion_len"] == sum(len(r.completion_ids) for r in rollouts) / 2

    # the dataset's gold solutions: nothing is sampled but the teacher's continuations, and the
    # states are prefixes of the batch's gold trajectories (cut at --max-new-tokens)
    log = run("data")
    assert [c[0] for c in calls] == ["teacher"]
    rows = data.load_gsm8k("train", data_dir)
    batch = [rows[i] for i in data.batch_indices(len(rows), 0, 2, 0)]
    gold = [p + a[:6] for p, a in (data.gsm8k_gold_ids(tok, r) for r in batch)]
    check_trained_on(gold)
    assert log["completion_len"] == 6  # the reward is that of the cut solutions, not of the whole ones
    cut_texts = [tok.decode(data.gsm8k_gold_ids(tok, r)[1][:6]) for r in batch]
    assert log["reward"] == sum(data.is_correct(t, r["gold"]) for t, r in zip(cut_texts, batch)) / 2 < 1
    # with the teacher's logits as the signal nothing at all is sampled
    log = run("data", "--signal", "logits")
    assert calls == [] and log["loss"] > 0 and log["completion_len"] == 6


def short_run(script, tiny_model):
    """Flags for a four-step run of script that trains visibly (LoRA dropout on in sft)."""
    return {"sft": ["--train-limit", 12, "--batch-size", 4, "--lora-dropout", 0.1, "--epochs", 2],
            "rl": ["--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 6, "--steps", 4, "--lr", 1e-3],
            "opd": ["--teacher", tiny_model, "--prompts-per-step", 2, "--max-new-tokens", 6, "--steps", 4,
                    "--continuation-tokens", 4, "--lr", 1e-3]}[script]


@pytest.mark.parametrize("script", ["sft", "rl", "opd"])
def test_resume_matches_an_uninterrupted_run(tiny_model, data_dir, tmp_path, script, capsys):
    main, extra = MAINS[script], short_run(script, tiny_model)
    main(common(tiny_model, data_dir, tmp_path / "full", *extra, "--max-steps", 4, "--save-every", 2))
    main(common(tiny_model, data_dir, tmp_path / "cut", *extra, "--max-steps", 2, "--save-every", 2))
    with pytest.raises(M.InputError, match="already holds a trained run"):
        main(common(tiny_model, data_dir, tmp_path / "cut", *extra, "--max-steps", 4))
    with pytest.raises(M.InputError, match="has no checkpoint to resume from; drop --resume to start the run"):
        main(common(tiny_model, data_dir, tmp_path / "never", *extra, "--resume"))
    with pytest.raises(M.InputError, match=f"--out {tiny_model} is a model folder \\(config.json\\); pass a folder of"):
        main(common(tiny_model, data_dir, tiny_model, *extra, "--max-steps", 1))
    assert not os.path.isfile(os.path.join(tiny_model, "run.json"))
    import shutil
    kept = tmp_path / "kept"  # a finished run whose checkpoint was deleted to save room: its adapter is not trained over
    shutil.copytree(tmp_path / "cut", kept)
    shutil.rmtree(kept / "checkpoint")
    adapter = (kept / "adapter_model.safetensors").read_bytes()
    with pytest.raises(M.InputError, match="kept already holds a trained adapter \\(and no checkpoint to continue it "
                                           "from\\); pass --out for a new folder, or delete"):
        main(common(tiny_model, data_dir, kept, *extra, "--max-steps", 1))
    assert (kept / "adapter_model.safetensors").read_bytes() == adapter
    stale = tmp_path / "stale"  # what a run that died before its first checkpoint leaves: a log, no checkpoint
    stale.mkdir()
    (stale / "log.jsonl").write_text('{"step": 1, "loss": 99.0}\n')
    main(common(tiny_model, data_dir, stale, *extra, "--max-steps", 1))
    assert [r["loss"] for r in read_log(stale)] == [r["loss"] for r in read_log(tmp_path / "full")[:1]]
    capsys.readouterr()
    with open(tmp_path / "cut" / "log.jsonl", "a") as f:  # a run killed while it wrote step 3's line
        f.write('{"step": 3, "loss": 0.')
    main(common(tiny_model, data_dir, tmp_path / "cut", *extra, "--max-steps", 4, "--save-every", 2, "--resume"))
    assert f"note: resuming {tmp_path / 'cut'} with changed settings: --max-steps 2 -> 4\n" in capsys.readouterr().out
    a, b = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "cut")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)  # it did train
    assert [r["step"] for r in read_log(tmp_path / "cut")] == [1, 2, 3, 4]


def test_a_resume_that_would_not_continue_the_run_stops_and_leaves_its_run_json(tiny_model, tokenizer_path, data_dir,
                                                                                  tmp_path):
    run = tmp_path / "run"
    sft.main(common(tiny_model, data_dir, run, *short_run("sft", tiny_model), "--max-steps", 1))
    recorded = (run / "run.json").read_text()
    resume = lambda model, *extra: sft.main(common(model, data_dir, run, *short_run("sft", tiny_model), "--max-steps", 2,
                                                   "--resume", *extra))
    # the same shapes and tokenizer, other weights: the checkpoint's adapter would load without a word
    other = save_hf_model(str(tmp_path / "other-base"), tokenizer_path, seed=1)
    with pytest.raises(M.InputError, match=f"run was trained on base {tiny_model}, but --model is {other}; "
                                           f"pass --model {tiny_model}"):
        resume(other)
    # another rank stopped with "trained on another base model"; another alpha rescaled the adapter unseen
    with pytest.raises(M.InputError, match=r"run's adapter was trained with other LoRA settings \(--rank 16 -> 8\); "
                                           r"resume with its own"):
        resume(tiny_model, "--rank", 8)
    with pytest.raises(M.InputError, match=r"other LoRA settings \(--alpha 32 -> 64.0\)"):
        resume(tiny_model, "--alpha", 64)
    # a checkpoint that fails to load: the settings of the resume that failed are not recorded as the run's
    from safetensors.torch import load_file, save_file
    weights = run / "checkpoint" / "adapter_model.safetensors"
    save_file(dict(list(load_file(weights).items())[1:]), weights)
    with pytest.raises(M.InputError, match="some LoRA tensors are missing"):
        resume(tiny_model, "--lr", 0.5)
    assert (run / "run.json").read_text() == recorded and len(read_log(run)) == 1


@pytest.mark.parametrize("script,signal_name", [("sft", "SIGINT"), ("rl", "SIGTERM"), ("opd", "SIGINT")])
def test_a_stop_signal_ends_the_run_after_its_step_with_a_checkpoint(tiny_model, data_dir, tmp_path, script,
                                                                     signal_name, monkeypatch, capsys):
    import signal
    main, extra = MAINS[script], short_run(script, tiny_model)
    main(common(tiny_model, data_dir, tmp_path / "full", *extra, "--max-steps", 4))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    batch_indices = data.batch_indices

    def signal_during(steps, times=1):
        def batch_indices_then_signal(n, step, *args):
            if step in steps:  # amid the step: as a user's Ctrl-C or a scheduler's SIGTERM comes
                for _ in range(times):
                    os.kill(os.getpid(), getattr(signal, signal_name))
            return batch_indices(n, step, *args)
        monkeypatch.setattr(data, "batch_indices", batch_indices_then_signal)

    signal_during({1})  # the second step; no checkpoint is due before the fourth
    args = common(tiny_model, data_dir, tmp_path / "cut", *extra, "--max-steps", 4, "--save-every", 4)
    with pytest.raises(SystemExit, match=f"stopped by {signal_name} after step 2 of 4, its checkpoint written to"):
        main(args)
    assert torch.load(tmp_path / "cut" / "checkpoint" / "trainer.pt", weights_only=True)["step"] == 2
    assert [r["step"] for r in read_log(tmp_path / "cut")] == [1, 2] and not runs.run_finished(tmp_path / "cut")
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # Python's own handlers are back
    # a second signal stops at once, back at the last checkpoint
    signal_during({2}, times=2)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--resume"])
    assert torch.load(tmp_path / "cut" / "checkpoint" / "trainer.pt", weights_only=True)["step"] == 2
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    # during the last step: the run completes, and the stop is not forgotten (reproduce.py would go on)
    signal_during({3})
    with pytest.raises(SystemExit, match=f"stopped by {signal_name} at the run's last step; .*cut is complete"):
        main([*args, "--resume"])
    a, b = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "cut")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6  # the stop lost nothing
    assert [r["step"] for r in read_log(tmp_path / "cut")] == [1, 2, 3, 4] and runs.run_finished(tmp_path / "cut")
    assert {s: signal.getsignal(s) for s in handlers} == handlers


@pytest.mark.parametrize("script", ["sft", "rl", "opd"])
def test_snapshots_hold_each_steps_adapter_as_a_run_folder(tiny_model, data_dir, tmp_path, script):
    main, extra = MAINS[script], short_run(script, tiny_model)
    main(common(tiny_model, data_dir, tmp_path / "run", *extra, "--max-steps", 3, "--snapshot-every", 1))
    main(common(tiny_model, data_dir, tmp_path / "one-step", *extra, "--max-steps", 1))
    snapshots = tmp_path / "run" / "snapshots"
    assert sorted(os.listdir(snapshots)) == ["step-000001", "step-000002", "step-000003"]
    first, last = adapter_tensors(snapshots / "step-000001"), adapter_tensors(snapshots / "step-000003")
    after_one, final = adapter_tensors(tmp_path / "one-step"), adapter_tensors(tmp_path / "run")
    assert all(torch.equal(first[k], after_one[k]) and torch.equal(last[k], final[k]) for k in final)
    assert any(not torch.equal(first[k], last[k]) for k in final)  # they are different steps' adapters
    # each a finished run folder of its own, with the log up to its step, for evaluate.py and drift.py
    runs.check_run_folder(str(snapshots / "step-000002"), tiny_model)
    assert json.loads((snapshots / "step-000002" / "run.json").read_text())["finished_steps"] == 2
    assert [r["step"] for r in read_log(snapshots / "step-000002")] == [1, 2]
    # a resume forgets snapshots past its checkpoint and half-written ones, as it forgets their log lines
    (snapshots / "step-000007").mkdir()
    (snapshots / "step-000002.tmp").mkdir()
    (snapshots / "results.md").write_text("a table the user made\n")
    main(common(tiny_model, data_dir, tmp_path / "run", *extra, "--max-steps", 3, "--snapshot-every", 1, "--resume"))
    assert sorted(os.listdir(snapshots)) == ["results.md", "step-000001", "step-000002", "step-000003"]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_model, data_dir, tmp_path, monkeypatch, capsys):
    args = common(tiny_model, data_dir, tmp_path / "nan", "--train-limit", 12, "--batch-size", 4, "--save-every", 2,
                  "--epochs", 2)
    calls = {"n": 0}
    real = sft.sft_loss

    def poisoned(logp):
        calls["n"] += 1
        loss, m = real(logp)
        return (loss * float("nan"), m) if calls["n"] == 3 else (loss, m)

    monkeypatch.setattr(sft, "sft_loss", poisoned)
    with pytest.raises(SystemExit, match=r"step 3: loss is nan; stopped.*checkpoint.*intact") as e:
        sft.main(args + ["--max-steps", "4"])
    assert "\n" not in str(e.value)
    monkeypatch.setattr(sft, "sft_loss", real)
    sft.main(common(tiny_model, data_dir, tmp_path / "clean", "--train-limit", 12, "--batch-size", 4, "--epochs", 2,
                    "--max-steps", 2))
    kept = torch.load(tmp_path / "nan" / "checkpoint" / "trainer.pt", weights_only=True)
    assert kept["step"] == 2
    a, b = adapter_tensors(tmp_path / "nan" / "checkpoint"), adapter_tensors(tmp_path / "clean")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    capsys.readouterr()
    for run, unfinished in (("nan", True), ("clean", False)):  # a stopped run's adapter is used with a note
        runs.check_run_folder(str(tmp_path / run), tiny_model)
        assert ("has not finished" in capsys.readouterr().out) == unfinished


def test_a_full_disk_stops_the_run_in_one_line_and_loses_no_checkpoint(tiny_model, data_dir, tmp_path, monkeypatch):
    extra = ["--train-limit", 12, "--batch-size", 4, "--epochs", 2, "--save-every", 1]
    sft.main(common(tiny_model, data_dir, tmp_path / "whole", *extra, "--max-steps", 3))
    save = torch.save

    def disk_fills_at_step_2(state, path, *a, **k):
        if state["step"] == 2:
            raise OSError(28, "No space left on device")
        return save(state, path, *a, **k)

    monkeypatch.setattr(torch, "save", disk_fills_at_step_2)
    args = common(tiny_model, data_dir, tmp_path / "full", *extra, "--max-steps", 3)
    with pytest.raises(M.InputError, match=r"could not write step 2's adapter to .*full \(No space left on device\); "
                                           r"the last checkpoint written is intact: make room, then continue with --resume"):
        sft.main(args)
    assert torch.load(tmp_path / "full" / "checkpoint" / "trainer.pt", weights_only=True)["step"] == 1
    monkeypatch.setattr(torch, "save", save)
    sft.main([*args, "--resume"])
    a, b = adapter_tensors(tmp_path / "whole"), adapter_tensors(tmp_path / "full")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(M.InputError, match="no checkpoint was written before it: make room, then start the run again"):
        sft.main(common(tiny_model, data_dir, tmp_path / "at-once", *extra, "--max-steps", 3))


def test_bad_teacher_is_a_one_line_error(tiny_models, data_dir, tmp_path, monkeypatch):
    def run(teacher, model):
        # the script's own entry point, in this process (a subprocess per case cost seconds
        # of imports; test_a_missing_model_or_data_folder_is_one_line_from_a_script runs one)
        monkeypatch.setattr(sys, "argv", ["opd.py", "--teacher", str(teacher),
                                          *common(model, data_dir, tmp_path / "o", "--max-steps", 1)])
        with pytest.raises(SystemExit) as e:
            runs.run_script(opd.main)
        return str(e.value.code).strip().splitlines()

    lines = run("does/not/exist", tiny_models["tied"])
    assert len(lines) == 1 and "--teacher 'does/not/exist' is neither a local folder nor a hub id" in lines[0], lines
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    lines = run("out/stres", tiny_models["tied"])  # a mistyped run folder reads as a hub id
    assert len(lines) == 1 and "no local folder of that name" in lines[0] and lines[0].endswith("with --teacher"), lines
    other = tmp_path / "other"
    m, _ = M.load(tiny_models["untied"])
    lora.add_lora(m, rank=2, alpha=4)
    lora.save_adapter(m, str(other))  # no run.json: only the shapes can tell
    lines = run(other, tiny_models["tied"])
    assert len(lines) == 1 and "another base model" in lines[0]
    with open(other / "run.json", "w") as f:
        json.dump({"model": tiny_models["untied"]}, f)
    lines = run(other, tiny_models["tied"])
    assert len(lines) == 1 and f"pass --model {tiny_models['untied']}" in lines[0]
    # a model folder as the teacher, of another tokenizer: the same shapes, so only the vocabulary tells
    import shutil
    import toy
    retokenized = tmp_path / "retokenized"
    shutil.copytree(tiny_models["tied"], retokenized)
    toy.train_tokenizer(["Question: how many apples?\nAnswer: 12 apples."] * 20, str(retokenized / "tokenizer.json"),
                        vocab_size=300)
    lines = run(retokenized, tiny_models["tied"])
    assert len(lines) == 1 and "has another tokenizer or vocabulary than --model" in lines[0], lines
    wider = tmp_path / "wider"  # the same tokenizer, but an output layer of more rows: logits would not line up
    shutil.copytree(tiny_models["tied"], wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps(dict(config, vocab_size=config["vocab_size"] + 8)))
    lines = run(wider, tiny_models["tied"])
    assert len(lines) == 1 and "has another tokenizer or vocabulary than --model" in lines[0], lines
    shutil.copytree(tiny_models["tied"], tmp_path / "copy")  # loaded on its own, and its tokenizer is the same
    opd.main(common(tiny_models["tied"], data_dir, tmp_path / "same", "--teacher", tmp_path / "copy", "--max-steps", 1,
                    "--prompts-per-step", 1, "--max-new-tokens", 4))
    assert len(read_log(tmp_path / "same")) == 1


def test_a_missing_model_or_data_folder_is_one_line_from_a_script(tiny_model, data_dir, tmp_path):
    for script, model, data_folder, message in (
            ("sft.py", str(tmp_path / "no-model"), data_dir, "no-model' is neither a local folder nor a hub id"),
            ("rl.py", tiny_model, tmp_path / "no-data", "no-data does not exist; pass --data-dir")):
        r = subprocess.run([sys.executable, os.path.join(ROOT, script), *common(model, data_folder, tmp_path / script)],
                           capture_output=True, text=True)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    # a folder named by $STATES_DATA is that variable's to fix
    r = subprocess.run([sys.executable, os.path.join(ROOT, "sft.py"), "--model", tiny_model, "--out", str(tmp_path / "env")],
                       capture_output=True, text=True, env={**os.environ, "STATES_DATA": str(tmp_path / "gone")})
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"error: data folder {tmp_path / 'gone'} does not exist; point $STATES_DATA at the dataset files, or unset it "
        f"to fetch them into ~/.cache/states"], r.stderr


@pytest.mark.parametrize("script,argv,message", [
    ("rl", ["--group-size", "1"], "argument --group-size: must be at least 2, got 1: the advantage compares"),
    ("rl", ["--temperature", "0"], "argument --temperature: must be above 0, got 0"),
    ("opd", ["--teacher", "out/stress", "--cuts", "0"], "argument --cuts: must be at least 1, got 0"),
    ("sft", ["--lr", "-0.001"], "argument --lr: must be above 0, got -0.001"),
    ("sft", ["--lora-dropout", "1"], "argument --lora-dropout: must be at least 0 and below 1, got 1"),
])
def test_bad_flags_are_named_before_anything_runs(script, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        MAINS[script](argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_sft_max_length_cuts_each_example_and_leaves_out_those_it_cuts_before_the_answer(tiny_model, data_dir,
                                                                                        tmp_path, monkeypatch):
    _, tok = M.load(tiny_model)
    gold = [data.gsm8k_gold_ids(tok, r) for r in data.load_gsm8k("train", data_dir)[:8]]
    prompt_lengths = sorted(len(p) for p, _ in gold)
    limit = prompt_lengths[4] + 3  # the longest prompts fill it: their examples have nothing left to learn
    trained = []
    plain_states = runs.sequence_states

    def recorded_states(model, sequences, starts, *rest):
        trained.extend(zip(map(tuple, sequences), starts))
        return plain_states(model, sequences, starts, *rest)
    monkeypatch.setattr(runs, "sequence_states", recorded_states)
    sft.main(common(tiny_model, data_dir, tmp_path / "sft", "--train-limit", 8, "--batch-size", 8, "--max-length", limit,
                    "--max-steps", 1))
    expected = {(tuple((p + a)[:limit]), len(p)) for p, a in gold if len(p) < limit}
    assert set(trained) == expected and 0 < len(expected) < 8
    assert max(len(s) for s, _ in trained) == limit


def test_sft_max_length_that_cuts_every_answer_is_an_input_error(tiny_model, data_dir, tmp_path):
    with pytest.raises(M.InputError, match="--max-length 4 cuts every example before its answer"):
        sft.main(common(tiny_model, data_dir, tmp_path / "sft", "--max-length", 4, "--max-steps", 1))


@pytest.mark.parametrize("split", [["--grad-accum", 2], ["--micro-batch-tokens", 1]])
@pytest.mark.parametrize("script", ["sft", "rl", "opd", "opd-logits"])
def test_micro_batches_train_the_same_adapter_as_one_batch(tiny_models, data_dir, tmp_path, script, split, monkeypatch):
    tiny_model, main = tiny_models["tied"], MAINS[script.split("-")[0]]
    opd_flags = ["--prompts-per-step", 3, "--max-new-tokens", 6, "--max-steps", 2, "--continuation-tokens", 4, "--lr", 1e-3]
    extra = {"sft": ["--train-limit", 8, "--batch-size", 4, "--lora-dropout", 0, "--max-steps", 2],
             "rl": ["--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 6, "--max-steps", 2, "--lr", 1e-3],
             "opd": ["--teacher", tiny_model, *opd_flags],
             # another model as the teacher: with the student's own base the KL is zero, and nothing trains
             "opd-logits": ["--teacher", tiny_models["untied"], *opd_flags, "--signal", "logits"]}[script]
    if script != "sft":
        # a random model writes to the token limit every time; cut its completions to unequal
        # lengths, so that micro-batches hold unequal numbers of the step's tokens
        module, plain_generate = (rl, rl.generate) if script == "rl" else (opd, opd.generate)

        def uneven(*args, **kwargs):
            rollouts = plain_generate(*args, **kwargs)
            for i, r in enumerate(rollouts):
                keep = 1 + i % len(r.completion_ids)
                r.completion_ids, r.logprobs = r.completion_ids[:keep], r.logprobs[:keep]
            return rollouts
        monkeypatch.setattr(module, "generate", uneven)
    passes = []  # how many sequences each training pass (a pass with a gradient) runs
    plain_states = runs.sequence_states

    def counted_states(model, sequences, *rest):
        if torch.is_grad_enabled():
            passes.append(len(sequences))
        return plain_states(model, sequences, *rest)
    monkeypatch.setattr(runs, "sequence_states", counted_states)
    main(common(tiny_model, data_dir, tmp_path / "one", *extra))
    assert len(passes) == 2  # one pass a step: the default bound does not split these small batches
    whole = passes[0]
    passes.clear()
    main(common(tiny_model, data_dir, tmp_path / "split", *extra, *split))
    if split[0] == "--grad-accum":
        assert len(passes) == 4 and max(passes) == -(-whole // 2)
    else:  # a bound below every sequence's length: each sequence in a pass of its own
        assert set(passes) == {1} and len(passes) == 2 * whole
    # the same loss and gradient, each micro-batch weighed by its share of the step's tokens
    la, lb = read_log(tmp_path / "one"), read_log(tmp_path / "split")
    assert len(la) == len(lb) == 2
    assert all(x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7) for x, y in zip(la, lb)), (la, lb)
    assert all(x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5, abs=1e-7) for x, y in zip(la, lb)), (la, lb)
    # Adam moves a parameter by lr g / (|g| + 1e-8): by the whole lr (1e-3) whatever the rounding
    # of g, except where g is within a few hundred times 1e-8, and there rounding shows (in rl's
    # uneven split about 1e-5: a gradient near 8e-8, a sum of nearly cancelling terms rounded
    # otherwise, moved its entry by 0.88 lr)
    a, b = adapter_tensors(tmp_path / "one"), adapter_tensors(tmp_path / "split")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)


@pytest.mark.parametrize("script", ["sft", "rl", "opd"])
def test_recompute_trains_the_same_adapter(tiny_model, data_dir, tmp_path, script, monkeypatch):
    main = MAINS[script]
    recomputed_layers = []
    plain_checkpoint = M.checkpoint
    monkeypatch.setattr(M, "checkpoint", lambda fn, *a, **k: (
        recomputed_layers.append(fn) if isinstance(fn, M.DecoderLayer) else None) or plain_checkpoint(fn, *a, **k))
    extra = [*short_run(script, tiny_model), "--max-steps", 2]
    main(common(tiny_model, data_dir, tmp_path / "plain", *extra))
    assert not recomputed_layers
    main(common(tiny_model, data_dir, tmp_path / "recompute", *extra, "--recompute"))
    assert recomputed_layers  # the flag reached the model's training passes
    a, b = adapter_tensors(tmp_path / "plain"), adapter_tensors(tmp_path / "recompute")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)
    assert json.loads((tmp_path / "recompute" / "run.json").read_text())["recompute"] is True
