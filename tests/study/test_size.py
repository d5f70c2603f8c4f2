"""study/size.py: forgetting at a matched update norm. Its run end to end, in the frontier study's folder (sharing its
world, base and teacher), is in test_frontier.py."""
import json
import math
import os

import pytest
import torch

import lora
import model as M
from conftest import randomize_adapter
from study import frontier, size


def arm(*gain_forgetting, seed=0):
    return [dict(gain=g, forgetting=f, path=f"{seed}-{g}-{f}") for g, f in gain_forgetting]


def seeds(*arms):
    return dict(enumerate(arms))


def test_run_names_and_each_arms_flags_and_caps():
    for a in frontier.ARMS:
        assert size.parse_name(size.run_name(a, 4.0, 2)) == (a, 4.0, 2)
        assert size.parse_name(size.run_name(a, 0.5)) == (a, 0.5, 0)
    assert size.parse_name("rl-lr0.0003") is None and size.parse_name("base-model") is None  # the teacher: no point
    runs = size.runs_of("out/s", seed=1)
    teacher = "rl-lr0.0003-seed1"
    assert list(runs)[0] == teacher and runs[teacher] == ("rl", ["--group-size", "8", "--snapshot-every", "25",
                                                                "--lr", "0.0003", "--seed", "1"])
    spec = size.SPECS["toy"]
    assert {n for n in runs if n.startswith("rl-cap")} == {f"rl-cap{c:g}-seed1" for c in spec["arm_caps"]["rl"]}
    top = spec["caps"][-1]
    assert runs[f"sft-cap{top:g}-seed1"] == ("sft", ["--preset", "mild", "--epochs", "3", "--snapshot-every", "38",
                                                    "--max-update-norm", str(top), "--lr", "0.006", "--seed", "1"])
    assert runs[f"opd-data-cap{top:g}-seed1"][1] == [
        "--steps", "60", "--snapshot-every", "15", "--state-source", "data", "--teacher", "out/s/" + teacher,
        "--max-update-norm", str(top), "--lr", "0.01", "--seed", "1"]
    assert len(runs) == 1 + 4 * len(spec["caps"]) + len(spec["arm_caps"]["rl"])


def test_the_standard_error_adds_the_questions_noise_unshrunk_by_seeds_to_the_seeds_spread(monkeypatch):
    monkeypatch.setattr(size, "question_se", lambda a, b: 0.01)
    on = arm((0.3, 0.0))
    same = size.compare(seeds(on, on, on), seeds(*[arm((0.3, 0.1))] * 3))
    assert all(x["d"] == pytest.approx(0.1) and x["se"] == pytest.approx(0.01) for x in same["grid"])  # not 0.01/sqrt(3)
    spread = size.compare(seeds(on, on, on), seeds(arm((0.3, 0.1)), arm((0.3, 0.2)), arm((0.3, 0.3))))
    x = spread["grid"][-1]
    assert x["per_seed"] == pytest.approx([0.1, 0.2, 0.3])
    assert x["se"] == pytest.approx(math.hypot(0.1 / math.sqrt(3), 0.01))
    short = size.compare(seeds(on), seeds(arm((0.09, 0.0))))  # the arms share gains under 0.1: no comparison
    assert short["grid"] == [] and "under 0.1" in short["why"]
    assert size.compare(seeds(on), {})["why"] == "an arm has no points"


def test_the_pairs_at_matched_gain_pick_each_seeds_least_forgetting_point(monkeypatch):
    asked = []
    monkeypatch.setattr(size, "question_se", lambda a, b: asked.append((a, b)) or 0.0)
    off = arm((0.1, 0.05), (0.3, 0.2), (0.3, 0.15))  # the least forgetting at 0.3 or more: 0.15
    c = size.compare(seeds(arm((0.3, 0.0))), seeds(off))
    assert [round(x["d"], 6) for x in c["grid"]][-1] == 0.15 and asked[-1] == ("0-0.3-0.15", "0-0.3-0.0")


def comparison(d, se, per_seed=None):
    return dict(grid=[dict(gain=0.1, d=d, se=se, per_seed=per_seed or [d, d, d])])


def test_the_size_rule_turns_at_its_boundaries():
    untested = dict(grid=[], why="under 0.1")
    assert size.verdict([comparison(0.2, 0.01)]) == "not tested"  # one cap tested: fewer than DECIDING
    assert size.verdict([untested, comparison(0.2, 0.01), untested]) == "not tested"
    assert size.verdict([comparison(0.0, 0.01), comparison(0.2, 0.01), comparison(0.2, 0.01)]) == "supported"
    # two standard errors exactly: not beyond them
    assert size.verdict([comparison(0.0, 0.01), comparison(0.2, 0.1), comparison(0.2, 0.01)]) == "undecided"
    assert size.verdict([comparison(0.2, 0.01), comparison(0.2001, 0.1)]) == "supported"
    # a seed whose d is not above 0 keeps it from "supported"
    assert size.verdict([comparison(0.2, 0.01), comparison(0.2, 0.01, [0.3, 0.3, 0.0])]) == "undecided"
    # every d within two standard errors and within the band (0.03): refuted; outside the band: undecided
    assert size.verdict([comparison(0.02, 0.01), comparison(-0.03, 0.015)]) == "refuted"
    assert size.verdict([comparison(0.02, 0.01), comparison(0.031, 0.02)]) == "undecided"
    assert size.verdict([comparison(0.02, 0.01), comparison(0.021, 0.01)]) == "undecided"  # beyond the noise


def write_samples(folder, mmlu, truthfulqa):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "eval_samples.jsonl"), "w") as f:
        for task, right in (("mmlu", mmlu), ("truthfulqa", truthfulqa)):
            for i, c in enumerate(right):
                f.write(json.dumps(dict(task=task, index=i, prompt=f"q{i}", correct=bool(c))) + "\n")


def test_the_questions_noise_of_a_difference_is_paired_question_by_question(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_samples(a, [1, 1, 0, 0], [1, 0, 1, 0])
    write_samples(b, [1, 0, 0, 0], [1, 0, 1, 0])  # truthfulqa answered alike: no noise from it
    mmlu = math.sqrt(((1 - 0.25) ** 2 + 3 * 0.25 ** 2) / 3 / 4)  # per-question differences 0, 1, 0, 0
    assert size.question_se(a, b) == pytest.approx(mmlu / 2)


def test_an_interpolation_scales_every_layers_update_and_the_norm_by_its_factor(tiny_model, tmp_path):
    net, _ = M.load(tiny_model)
    lora.add_lora(net, rank=4, alpha=12)
    randomize_adapter(net, seed=3)
    run = tmp_path / "sft-cap13"
    lora.save_adapter(net, str(run))
    (run / "run.json").write_text(json.dumps(dict(model=tiny_model, finished_steps=7)))
    before = {n: layer.delta_weight("default").detach().clone() for n, layer in lora.lora_layers(net).items()}
    folder = size.interpolate(str(run), 0.25)
    assert folder == str(run / "interpolated" / "scale-0.25")
    assert json.loads((run / "interpolated" / "scale-0.25" / "run.json").read_text()) == dict(
        model=tiny_model, finished_steps=7, scale=0.25)
    assert lora.update_norm(folder) == pytest.approx(0.25 * lora.update_norm(str(run)), rel=1e-6)
    scaled, _ = M.load(tiny_model)
    lora.load_adapter(scaled, folder)
    for n, layer in lora.lora_layers(scaled).items():  # each layer's change, not only the norm
        assert torch.allclose(layer.delta_weight("default"), before[n] / 4, atol=1e-7), n
    # only the arms' runs at their highest cap are interpolated, each scale once
    (run / "interpolated" / "scale-0.5").mkdir()  # a half-written one (no run.json): written again
    folders = size.interpolations(str(tmp_path), ["sft-cap13", "sft-cap6.5", "rl-lr0.0003"], "toy")
    assert folders == [str(run / "interpolated" / f"scale-{s:g}") for s in size.SCALES]
    assert all((run / "interpolated" / f"scale-{s:g}" / "adapter_model.safetensors").is_file() for s in size.SCALES)


def test_the_curves_run_from_the_smallest_scale_to_the_runs_end_and_average_over_seeds():
    curve = lambda seed, f: dict(arm="sft", cap=13.0, seed=seed, run=f"sft-cap13-seed{seed}", points=[
        dict(scale=s, update_norm=13 * s, gain=0.4 * s, forgetting=f * s) for s in (0.25, 0.5, 1.0)])
    rows = size.curve_rows([curve(0, 0.2), curve(1, 0.4), dict(curve(0, 0.1), arm="rl", cap=1.625)])
    assert [(r["arm"], r["scale"], r["seeds"]) for r in rows] == [
        ("sft", 0.25, 2), ("sft", 0.5, 2), ("sft", 1.0, 2), ("rl", 0.25, 1), ("rl", 0.5, 1), ("rl", 1.0, 1)]
    assert rows[2]["forgetting"] == pytest.approx((0.3, math.sqrt(0.02)))
    assert rows[3]["forgetting"] == (0.025, None)
