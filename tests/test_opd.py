"""opd.py: the student's states (or the teacher's, or the data's), the teacher's signal; and
the state sources of every script, as their docstrings name them."""
import json
import os
import sys

import pytest
import torch

import data
import lora
import model as M
import opd
import rl
import sft
import train
from conftest import adapter_tensors, common, randomize_adapter, read_log, write_fixed_answer_data
from plumbing import cli, provenance
from plumbing.files import InputError
from sample import find_stop, tokens_before_stop
from study import organism


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
    real_logprobs, real_generate = train.sequence_logprobs, rl.generate

    def record_logprobs(model, sequences, starts, pad_id=0):
        if torch.is_grad_enabled():
            trained.append((sequences, starts))
        return real_logprobs(model, sequences, starts, pad_id)

    def record_generate(model, tok, prompts, sampling, **k):
        out = real_generate(model, tok, prompts, sampling, **k)
        sampled.append((lora.active_adapter(model), prompts, sampling.stop, out))
        return out

    monkeypatch.setattr(train, "sequence_logprobs", record_logprobs)
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


def test_opd_student_learns_the_teachers_fixed_answer(tiny_model, data_dir, tmp_path):
    answer = "The answer is 7.\n#### 7"
    fixed = write_fixed_answer_data(data_dir, str(tmp_path / "data"), answer)
    teacher = tmp_path / "teacher"
    sft.main(common(tiny_model, fixed, teacher, "--batch-size", 8, "--epochs", 30, "--lr", 1e-2, "--rank", 8,
                    "--alpha", 16, "--lora-dropout", 0, "--warmup", 0))
    m, tok = M.load(tiny_model)
    prompts = [data.gsm8k_prompt(r["question"]) for r in data.load_gsm8k("train", fixed)[:6]]
    from sample import Sampling, generate
    lora.load_adapter(m, str(teacher))
    assert all(r.text == " " + answer for r in generate(m, tok, prompts, Sampling(max_new_tokens=16, temperature=0)))
    lora.set_adapter(m, None)
    assert not any(r.text == " " + answer for r in generate(m, tok, prompts, Sampling(max_new_tokens=16, temperature=0)))

    student = tmp_path / "student"
    opd.main(common(tiny_model, fixed, student, "--teacher", teacher, "--prompts-per-step", 8, "--max-new-tokens", 20,
                    "--continuation-tokens", 20, "--lr", 1e-2, "--rank", 8, "--alpha", 16, "--steps", 120))
    s, _ = M.load(tiny_model)
    lora.load_adapter(s, str(student))
    # the teacher's answer first (what follows it depends on the teacher's continuations of the
    # student's early, random states, where this teacher repeats its last line)
    texts = [r.text for r in generate(s, tok, prompts, Sampling(max_new_tokens=16, temperature=0))]
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
    assert not provenance.teacher_changed(str(student))
    opd.main([*distil, "--max-steps", "2", "--resume"])  # the same teacher: resumes
    sft.main([*train_teacher, "--max-steps", "2", "--resume"])
    assert provenance.teacher_changed(str(student))
    with pytest.raises(InputError, match=f"{student} was trained with teacher_sha256 {recorded}, which is "):
        opd.main([*distil, "--resume"])
    assert len(read_log(student)) == 2
    # a teacher given as a model folder has no adapter to change
    base_taught = tmp_path / "base-taught"
    opd.main(common(tiny_model, data_dir, base_taught, "--teacher", tiny_model, "--prompts-per-step", 1,
                    "--max-new-tokens", 4, "--continuation-tokens", 2, "--max-steps", 1))
    assert json.loads((base_taught / "run.json").read_text())["teacher_sha256"] is None
    assert not provenance.teacher_changed(str(base_taught))


@pytest.mark.parametrize("split", [[], ["--micro-batch-tokens", 1]])  # one pass a step, a pass a sequence
def test_opd_logit_kl_is_zero_when_the_teacher_is_the_student(tiny_model, data_dir, tmp_path, split):
    out = tmp_path / "opd"
    opd.main(common(tiny_model, data_dir, out, "--teacher", tiny_model, "--signal", "logits", "--prompts-per-step", 2,
                    "--max-new-tokens", 8, "--max-steps", 3, *split))
    log = read_log(out)
    assert all(r["loss"] == 0.0 and r["state_kl"] == 0.0 and r["grad_norm"] == 0.0 for r in log)
    assert all(t.abs().max() == 0 for k, t in adapter_tensors(out).items() if "lora_B" in k)


def test_a_teacher_that_is_the_base_model_however_spelt_shares_the_students_copy(tiny_model, tmp_path):
    model, tok = M.load(tiny_model)
    relative = os.path.relpath(tiny_model)
    for spelt in (tiny_model, tiny_model + "/", relative, os.path.join(relative, ".")):
        assert opd.load_teacher(model, tok, opd.open_teacher(spelt), tiny_model) == (model, None), spelt
    os.symlink(tiny_model, tmp_path / "linked")
    assert opd.load_teacher(model, tok, opd.open_teacher(str(tmp_path / "linked")), tiny_model)[0] is model


def test_a_students_run_folder_lies_beside_its_teacher_run_and_a_model_ids_in_out(tmp_path):
    teacher = tmp_path / "toy" / "stress"
    teacher.mkdir(parents=True)
    (teacher / "run.json").write_text('{"model": "m"}')
    (teacher / "adapter_config.json").write_text("{}")
    opened = opd.open_teacher(f"{teacher}/")  # a run folder: its run.json read, its adapter hashed
    assert opened.is_run and opened.run == {"model": "m"} and opened.sha256 is None
    assert opd.student_folder(opd.parse_args(["--teacher", f"{teacher}/"]), opened) == str(
        tmp_path / "toy" / "opd-stress")
    assert opd.student_folder(opd.parse_args(["--teacher", str(teacher), "--state-source", "teacher"]),
                              opened) == str(tmp_path / "toy" / "opd-stress-teacher-states")
    hub = opd.Teacher("Qwen/Qwen3-1.7B", str(tmp_path))  # a hub id, as fetched into a model folder
    assert opd.student_folder(opd.parse_args(["--teacher", hub.name]), hub) == os.path.join("out",
                                                                                         "opd-Qwen3-1.7B")


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


def test_opd_targets_end_before_a_stop_string(tiny_model, data_dir, tmp_path, monkeypatch):
    # a teacher that goes on into a new question: what it writes after its answer is not taught
    real_generate = opd.generate
    _, tok = M.load(tiny_model)
    answer, beyond = tok.encode(" 3 + 4 = 7.\n#### 7"), tok.encode("\n\nQuestion: Tom has 5 pens.")
    assert find_stop(tok.decode(answer + beyond), data.GSM8K_STOP) >= 0

    def teacher_runs_on(model, tok, prompts, sampling, **k):
        out = real_generate(model, tok, prompts, sampling, **k)
        if lora.active_adapter(model) is None:  # the teacher, the base model here
            assert sampling.stop == data.GSM8K_STOP
            for r in out:
                r.completion_ids = answer + beyond
        return out
    monkeypatch.setattr(opd, "generate", teacher_runs_on)
    trained = []
    real_logprobs = train.sequence_logprobs
    monkeypatch.setattr(train, "sequence_logprobs", lambda m, seqs, st, pad_id=0: (
        trained.extend(s[t:] for s, t in zip(seqs, st)) if torch.is_grad_enabled() else None)
        or real_logprobs(m, seqs, st, pad_id))
    opd.main(common(tiny_model, data_dir, tmp_path / "opd", "--teacher", tiny_model, "--prompts-per-step", 2,
                    "--max-new-tokens", 6, "--max-steps", 1))
    assert trained and all(t == tokens_before_stop(tok, answer + beyond, data.GSM8K_STOP) for t in trained)
    assert all(find_stop(tok.decode(t), data.GSM8K_STOP) == -1 and len(t) >= len(answer) for t in trained)


def test_opd_cuts_lie_before_the_stop_string_of_the_students_rollout(tiny_model, data_dir, tmp_path, monkeypatch):
    """A student rollout that runs on into a new question: no cut falls inside "\n\nQuestion:",
    from where the teacher would continue the new question and the student learn to ask it."""
    real_generate = opd.generate
    _, tok = M.load(tiny_model)
    answer, beyond = tok.encode(" 3 + 4 = 7.\n#### 7"), tok.encode("\n\nQuestion: Tom has 5 pens.")
    before = tokens_before_stop(tok, answer + beyond, data.GSM8K_STOP)
    prompts, prefixes = [], []

    def student_runs_on(model, tok, inputs, *a, **k):
        out = real_generate(model, tok, inputs, *a, **k)
        if lora.active_adapter(model) == "default":  # the student's rollouts: the states
            for r in out:
                r.completion_ids = answer + beyond
                prompts.append(r.prompt_ids)
        else:  # the teacher continues these
            prefixes.extend(list(p) for p in inputs)
        return out
    monkeypatch.setattr(opd, "generate", student_runs_on)
    opd.main(common(tiny_model, data_dir, tmp_path / "opd", "--teacher", tiny_model, "--prompts-per-step", 2,
                    "--max-new-tokens", 6, "--max-steps", 1, "--cuts", 100))  # every cut there is
    cuts = sorted(len(p) - len(prompt) for p in prefixes for prompt in prompts if p[:len(prompt)] == prompt)
    assert len(before) < len(answer + beyond) and cuts == sorted(list(range(len(before))) * 2)


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
    real_logprobs = train.sequence_logprobs
    monkeypatch.setattr(train, "sequence_logprobs", lambda m, seqs, st, pad_id=0: (
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
    # the state distance's NLL is the base's of the tokens the loss is computed on (the teacher's
    # continuations), as in sft.py and rl.py: at the first step, the adapter still zero, the loss itself
    assert log["state_nll_base"] == pytest.approx(log["loss"], abs=1e-5)
    assert abs(log["state_nll_base"] - log["state_nll"]) > 1e-3  # not the trajectories' own

    # the teacher's rollouts: the states are sampled with the teacher adapter too
    log = run("teacher")
    assert [c[0] for c in calls] == ["teacher", "teacher"]
    rollouts = calls[0][2]
    check_trained_on([r.prompt_ids + r.completion_ids for r in rollouts])
    assert log["completion_len"] == sum(len(r.completion_ids) for r in rollouts) / 2
    assert log["state_nll_base"] == pytest.approx(log["loss"], abs=1e-5)

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
    assert log["state_nll_base"] == pytest.approx(log["loss"], abs=1e-5)
    # with the teacher's logits as the signal nothing at all is sampled
    log = run("data", "--signal", "logits")
    assert calls == [] and log["loss"] > 0 and log["completion_len"] == 6
    # a per-state signal trains at every state of the trajectories: their NLL, the base's at step 1
    log = run("student", "--signal", "logits")
    assert log["state_nll_base"] == pytest.approx(log["state_nll"], abs=1e-4)


def test_bad_teacher_is_a_one_line_error(tiny_models, data_dir, tmp_path, monkeypatch):
    def run(teacher, model):
        # the script's own entry point, in this process (a subprocess per case cost seconds
        # of imports; test_a_missing_model_or_data_folder_is_one_line_from_a_script runs one)
        monkeypatch.setattr(sys, "argv", ["opd.py", "--teacher", str(teacher),
                                          *common(model, data_dir, tmp_path / "o", "--max-steps", 1)])
        with pytest.raises(SystemExit) as e:
            cli.run_script(opd.main)
        return str(e.value.code).strip().splitlines()

    load = M.load

    def too_soon(*args, **kwargs):  # where --model is the default, that would fetch Qwen3 first
        raise AssertionError("a model loaded before --teacher was checked")
    monkeypatch.setattr(M, "load", too_soon)
    lines = run("does/not/exist", tiny_models["tied"])
    assert len(lines) == 1 and "--teacher 'does/not/exist' is neither a local folder nor a hub id" in lines[0], lines
    lines = run(tmp_path, tiny_models["tied"])  # the study's folder, not a run in it
    assert len(lines) == 1 and lines[0].endswith("is not a run folder (no adapter_config.json); name a folder "
                                                 "written by sft.py, rl.py or opd.py, or a model folder (config.json)")
    monkeypatch.setattr(M, "load", load)
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
    retokenized = tmp_path / "retokenized"
    shutil.copytree(tiny_models["tied"], retokenized)
    organism.train_tokenizer(["Question: how many apples?\nAnswer: 12 apples."] * 20, str(retokenized / "tokenizer.json"),
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


def test_the_sampled_signal_averages_to_the_reverse_kl_gradient_of_the_logit_signal():
    """--signal sampled: at one state, the mean gradient over many tokens drawn from the
    student is the closed-form gradient of KL(student || teacher) within Monte Carlo error,
    an error small enough that the opposite sign would fail; and each draw's own gradient is
    -A (e_y - p_s) exactly, as with a detached advantage (attached, it would be (1 - A)(e_y - p_s))."""
    V, N = 6, 200_000
    g = torch.Generator().manual_seed(0)
    z = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_()
    log_t = torch.randn(V, generator=g, dtype=torch.float64).log_softmax(-1)
    log_s = z.log_softmax(-1)
    p = log_s.exp().detach()
    y = torch.multinomial(p, N, replacement=True, generator=g)
    loss, _ = opd.sampled_token_loss(log_s[y], log_t[y])
    (loss / N).backward()
    kl = (p * (log_s.detach() - log_t)).sum()
    closed = p * (log_s.detach() - log_t - kl)  # d KL(s || t) / dz, as train.token_kl's reverse direction forms it
    advantage = (log_t - log_s.detach())[y]
    per_draw = -advantage[:, None] * (torch.nn.functional.one_hot(y, V).double() - p)
    stderr = per_draw.std(0) / N ** 0.5
    assert ((z.grad - closed).abs() < 4 * stderr).all()
    assert ((closed - (-closed)).abs() > 20 * stderr).any()  # a flipped sign lies far outside the error

    for draw in y[:3].tolist():
        one = z.detach().clone().requires_grad_()
        log_one = one.log_softmax(-1)
        opd.sampled_token_loss(log_one[draw:draw + 1], log_t[draw:draw + 1])[0].backward()
        a = (log_t[draw] - log_one[draw]).item()
        assert torch.allclose(one.grad, -a * (torch.nn.functional.one_hot(torch.tensor(draw), V).double() - p), atol=1e-12)


def test_a_state_source_that_is_neither_a_source_nor_a_mixture_is_refused_in_one_line(tiny_model, data_dir, tmp_path):
    for bad in ("students", "student=0.5,teacher=0.4"):
        with pytest.raises(InputError, match=f"--state-source '{bad}': give student, teacher or data, or weights"):
            opd.main(common(tiny_model, data_dir, tmp_path / "x", "--teacher", tiny_model, "--state-source", bad))
    assert not (tmp_path / "x").exists()  # refused before anything was made


SOURCES = ("student", "teacher", "data")


def test_a_state_source_mixture_draws_each_prompts_source_by_its_place_in_the_step():
    assert cli.mixture("teacher", SOURCES, "--state-source") == {"teacher": 1.0}
    assert cli.mixture("student=0.25, data=0.75", SOURCES, "--state-source") == {"student": 0.25, "data": 0.75}
    for bad in ("students", "student=0.5,data=0.6", "student=x", "student=0.5=1", "data=-0.5,student=1.5", "student=nan,data=nan"):
        with pytest.raises(InputError, match=r"--state-source .*: give student, teacher or data, or weights of them "
                                               r"that sum to 1, e\.g\. student=0\.25,data=0\.75"):
            cli.mixture(bad, SOURCES, "--state-source")
    weights = {"student": 0.25, "data": 0.75}
    picks = opd.state_sources(weights, 4000, (0, 7, 0))
    assert abs(picks.count("student") / 4000 - 0.25) < 0.03 and set(picks) == {"student", "data"}
    # a step's prompts split over two processes (first 0 and first 4) draw what one process draws
    assert opd.state_sources(weights, 8, (3, 5, 0)) == opd.state_sources(weights, 4, (3, 5, 0)) + \
        opd.state_sources(weights, 4, (3, 5, 4))
    assert opd.state_sources(weights, 8, (3, 5, 0)) != opd.state_sources(weights, 8, (3, 6, 0))  # step by step anew
    assert opd.state_sources({"teacher": 1.0}, 5, (0, 0, 0)) == ["teacher"] * 5
