"""sft.py: dataset states, gold tokens."""

import pytest
import torch

import data
import lora
import model as M
import sft
import train
from conftest import common, read_log
from plumbing.files import InputError
from sample import Sampling, generate, tokens_before_stop


def answer_nll(tiny_model, adapter, examples):
    m, tok = M.load(tiny_model)
    if adapter:
        lora.load_adapter(m, adapter)
    with torch.no_grad():
        seqs = [tok.encode(p) for p, _ in examples]
        full = [tok.encode(p + " " + a) + [tok.eos_id] for p, a in examples]
        logp, _ = train.sequence_logprobs(m, full, [len(s) for s in seqs])
    return -logp.mean().item()


def test_sft_learns_its_four_examples(tiny_model, data_dir, tmp_path, monkeypatch):
    out = tmp_path / "sft"
    measured = []  # the base's NLL of a gold answer never changes: each example is measured once
    plain = train.base_logprobs
    monkeypatch.setattr(train, "base_logprobs", lambda model, seqs, *rest: measured.extend(map(tuple, seqs)) or plain(
        model, seqs, *rest))
    sft.main(common(tiny_model, data_dir, out, "--train-limit", 4, "--batch-size", 4, "--epochs", 100,
                    "--lr", 2e-2, "--rank", 16, "--alpha", 32, "--lora-dropout", 0, "--warmup", 0))
    rows = data.load_gsm8k("train", data_dir)[:4]
    examples = [(data.gsm8k_prompt(r["question"]), r["answer"]) for r in rows]
    before, after = answer_nll(tiny_model, None, examples), answer_nll(tiny_model, str(out), examples)
    assert after < 0.2 * before, (before, after)
    log = read_log(out)
    assert log[-1]["loss"] < 0.2 * log[0]["loss"]
    # where the states lie under the base: at step 1, with LoRA's B still zero, the loss itself;
    # at the end the learner has moved and its loss is far below the base's NLL of the same answers
    assert abs(log[0]["state_nll_base"] - log[0]["loss"]) < 1e-5
    assert log[-1]["loss"] < 0.5 * log[-1]["state_nll_base"]
    assert len(measured) == len(set(measured)) == 4 and {x["state_nll_base"] for x in log} == {log[0]["state_nll_base"]}


def recorded_states(monkeypatch):
    """A list that gathers every (sequence, start) that a forward pass of train computes states of."""
    trained, plain_states = [], train.sequence_states

    def recording(model, sequences, starts, *rest):
        trained.extend(zip(map(tuple, sequences), starts))
        return plain_states(model, sequences, starts, *rest)
    monkeypatch.setattr(train, "sequence_states", recording)
    return trained


def test_sft_max_length_cuts_each_example_and_leaves_out_those_it_cuts_before_the_answer(tiny_model, data_dir,
                                                                                        tmp_path, monkeypatch):
    _, tok = M.load(tiny_model)
    gold = [data.gsm8k_gold_ids(tok, r) for r in data.load_gsm8k("train", data_dir)[:8]]
    prompt_lengths = sorted(len(p) for p, _ in gold)
    limit = prompt_lengths[4] + 3  # the longest prompts fill it: their examples have nothing left to learn
    trained = recorded_states(monkeypatch)
    sft.main(common(tiny_model, data_dir, tmp_path / "sft", "--train-limit", 8, "--batch-size", 8, "--max-length", limit,
                    "--max-steps", 1))
    expected = {(tuple((p + a)[:limit]), len(p)) for p, a in gold if len(p) < limit}
    assert set(trained) == expected and 0 < len(expected) < 8
    assert max(len(s) for s, _ in trained) == limit


def test_sft_max_length_that_cuts_every_answer_is_an_input_error(tiny_model, data_dir, tmp_path):
    with pytest.raises(InputError, match="--max-length 4 cuts every example before its answer"):
        sft.main(common(tiny_model, data_dir, tmp_path / "sft", "--max-length", 4, "--max-steps", 1))


def test_sft_on_the_bases_own_right_samples_trains_on_those_alone(tiny_model, data_dir, tmp_path, monkeypatch):
    """--answers samples: only the base's samples the reward marks right become training data,
    cut before a stop string and ended with end-of-text; the loss is SFT's on them, so at step
    1 (the adapter still zero) it equals their state_nll_base, the base's NLL of its own samples."""
    model, tok = M.load(tiny_model)
    rows = data.load_gsm8k("train", data_dir)[:4]
    drawn = generate(model, tok, [data.gsm8k_prompt(r["question"]) for r in rows], Sampling(n=3, max_new_tokens=12, temperature=1.0, stop=data.GSM8K_STOP, seed=0))
    monkeypatch.setattr(data, "is_correct", lambda text, gold: len(text) % 3 == 0)  # a reward that picks some
    right = [r for r in drawn if len(r.text) % 3 == 0]
    assert 0 < len(right) < len(drawn)
    answers = [[t for t in tokens_before_stop(tok, r.completion_ids, data.GSM8K_STOP) if t != tok.eos_id] + [tok.eos_id]
               for r in right]
    expected = {(tuple(r.prompt_ids + a), len(r.prompt_ids)) for r, a in zip(right, answers)}
    trained = recorded_states(monkeypatch)
    out = tmp_path / "sft"
    sft.main(common(tiny_model, data_dir, out, "--answers", "samples", "--samples-per-prompt", 3, "--max-new-tokens",
                    12, "--train-limit", 4, "--batch-size", 64, "--max-steps", 1, "--lora-dropout", 0))
    assert set(trained) == expected
    logp, _ = train.sequence_logprobs(model, [list(s) for s, _ in expected], [st for _, st in expected])
    own_nll = -logp.mean().item()
    step = read_log(out)[0]
    assert step["state_nll_base"] == pytest.approx(own_nll, abs=1e-5) and step["loss"] == pytest.approx(own_nll, abs=1e-5)


def test_sft_on_samples_none_of_which_is_right_is_an_input_error(tiny_model, data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "is_correct", lambda text, gold: False)
    with pytest.raises(InputError, match="no sample of the base is right; raise --samples-per-prompt"):
        sft.main(common(tiny_model, data_dir, tmp_path / "sft", "--answers", "samples", "--train-limit", 2,
                        "--samples-per-prompt", 2, "--max-new-tokens", 4, "--max-steps", 1))


def test_wrong_answers_change_the_final_number_of_that_share_of_gold_answers_alone(tiny_model, data_dir, tmp_path,
                                                                                    monkeypatch):
    """P3's degraded teacher: the worked steps stay, the number after '####' is wrong in a share of them."""
    rows = data.load_gsm8k("train", data_dir)
    assert data.with_wrong_answers(rows, 0.0, seed=3) == rows
    wrong = data.with_wrong_answers(rows, 0.75, seed=3)
    assert wrong == data.with_wrong_answers(rows, 0.75, seed=3) != data.with_wrong_answers(rows, 0.75, seed=4)
    changed = [(r, w) for r, w in zip(rows, wrong) if w != r]
    assert abs(len(changed) / len(rows) - 0.75) < 0.1
    assert all(w["gold"] != r["gold"] for r, w in zip(rows, data.with_wrong_answers(rows, 1, seed=3)))  # every one
    for r, w in changed:
        steps, number = w["answer"].rsplit("#### ", 1)
        assert steps == r["answer"].rsplit("#### ", 1)[0] and number == w["gold"] == data.extract_answer(w["answer"], "strict")
        assert 0 < abs(int(number) - round(float(r["gold"]))) <= 9 and int(number) >= min(0, round(float(r["gold"])))
    # sft.py trains on them: every state it learns is a prefix of a wrong-answer gold solution
    _, tok = M.load(tiny_model)
    trained = recorded_states(monkeypatch)
    sft.main(common(tiny_model, data_dir, tmp_path / "degraded", "--train-limit", 8, "--batch-size", 8,
                    "--wrong-answers", 0.75, "--max-steps", 1))
    expected = {(tuple(p + a), len(p)) for p, a in (data.gsm8k_gold_ids(tok, r) for r in
                                                     data.with_wrong_answers(rows[:8], 0.75, seed=0))}
    assert set(trained) == expected and expected != {(tuple(p + a), len(p)) for p, a in
                                                     (data.gsm8k_gold_ids(tok, r) for r in rows[:8])}
