"""pressure.py and reproduce.py --study pressure: P2 at matched pressure, by its rule."""
import json
import math
import os
import subprocess
import sys

import pytest

import pressure
import reproduce
from conftest import ROOT


def arm(*pairs):
    """{seed 0: points} of (update norm, forgetting) pairs."""
    return {0: [dict(norm=n, forgetting=f, gain=n / 100) for n, f in pairs]}


def seeds(*arms):
    return {s: a[0] for s, a in enumerate(arms)}


def test_the_rule_reads_supported_refuted_and_undecided_at_matched_norm():
    student = arm((1, 0.00), (10, 0.02), (100, 0.10))
    assert pressure.interpolate(student[0], "norm", math.sqrt(10), log=True) == pytest.approx(0.01)
    assert pressure.interpolate(student[0], "norm", 1000, log=True) is None  # outside the points: not guessed
    data = arm((2, 0.10), (20, 0.20), (200, 0.40))  # forgets more all over the range both cover, 2 to 100
    m = pressure.matched(student, data, "norm", question_se=0.02, log=True)
    assert m["verdict"] == "supported" and (m["lo"], m["hi"]) == (2, 100) and len(m["grid"]) == pressure.GRID
    assert m["grid"][0]["d"] == pytest.approx(0.10 - 0.02 * math.log(2) / math.log(10))
    assert pressure.matched(student, student, "norm", 0.02, log=True)["verdict"] == "refuted"
    crossing = arm((1, 0.20), (100, -0.10))  # more at small norms, less at large ones
    assert pressure.matched(student, crossing, "norm", 0.02, log=True)["verdict"] == "undecided"
    lo, hi = 3.5365405995973345, 458.3664384111899  # lo * (hi / lo) ** 1 rounds above hi: the grid's end is hi itself
    assert pressure.matched(arm((lo, 0.0), (hi, 0.1)), arm((lo, 0.2), (hi, 0.3)), "norm", 0.02, log=True)["grid"][-1][
        "x"] == hi
    apart = arm((200, 0.5), (300, 0.6))  # no shared range
    assert pressure.matched(student, apart, "norm", 0.02, log=True)["verdict"] == "undecided"
    # with seeds, the standard error is theirs: the same mean difference, once steady and once not
    steady = pressure.matched(seeds(student, student, student), seeds(*[arm((1, 0.05), (100, 0.15))] * 3), "norm",
                              question_se=1.0, log=True)
    assert steady["verdict"] == "supported" and steady["grid"][0]["se"] == pytest.approx(0, abs=1e-12)  # seeds' SE
    noisy = pressure.matched(seeds(student, student, student),
                             seeds(arm((1, 0.25), (100, 0.35)), arm((1, -0.15), (100, -0.05)), arm((1, 0.05), (100, 0.15))),
                             "norm", question_se=0.0, log=True)
    assert noisy["verdict"] == "refuted" and noisy["grid"][0]["se"] == pytest.approx(0.2 / math.sqrt(3))


def log_run(folder, nll):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "log.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": i + 1, "state_nll_base": v}) + "\n" for i, v in enumerate(nll))


def test_a_run_whose_own_states_moved_away_is_marked_degenerate(tmp_path):
    log_run(tmp_path / "a", [0.2] * 8 + [0.9, 0.9])
    log_run(tmp_path / "b", [0.2] * 8 + [0.6, 0.6])  # a rise of 0.4 nats: within the bound
    assert pressure.degenerate(str(tmp_path / "a")) and not pressure.degenerate(str(tmp_path / "b"))


def test_run_names_round_trip_and_other_folders_are_not_arms():
    assert pressure.parse_name(pressure.run_name("mixed", 3e-3, 2)) == ("mixed", 3e-3, 2)
    assert pressure.parse_name(pressure.run_name("rl", 1e-2)) == ("rl", 1e-2, 0)
    assert pressure.parse_name(pressure.TEACHER) is None and pressure.parse_name(pressure.TEACHER + "-seed1") is None


def test_each_arm_differs_from_the_others_in_its_state_source_alone():
    runs = reproduce.pressure_runs("out/p", seed=1)
    opd = {n: argv for n, (script, argv) in runs.items() if script == "opd"}
    assert len(opd) == 4 * 4 and len(runs) == 1 + 6 * 4
    for name, argv in opd.items():
        a, lr, seed = pressure.parse_name(name)
        assert argv == ["--teacher", "out/p/rl-teacher-seed1", "--state-source", pressure.ARMS[a], "--lr", str(lr),
                        "--snapshot-every", "20", "--seed", "1"]
    assert list(runs)[0] == "rl-teacher-seed1" and runs["rl-teacher-seed1"] == ("rl", ["--seed", "1"])  # trained first


def test_pressure_study_runs_end_to_end_in_miniature(tmp_path):
    out = tmp_path / "pressure"
    cmd = [sys.executable, os.path.join(ROOT, "reproduce.py"), "--preset", "toy-mini", "--study", "pressure", "--out",
           str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "pressure.json").read_text())
    points = {(p["arm"], p["step"]) for p in report["points"]}
    assert points == {("student", 1), ("student", 2), ("data", 1), ("data", 2)}  # a snapshot and the end of each
    for arm_name in ("student", "data"):  # every point is evaluated; the data arm trains on the gold answers
        assert (out / pressure.run_name(arm_name, 1e-3) / "snapshots" / "step-000001" / "eval.json").is_file()
    run = json.loads((out / pressure.run_name("data", 1e-3) / "run.json").read_text())
    assert run["state_source"] == "data" and run["lr"] == 1e-3 and run["teacher"] == str(out / pressure.TEACHER)
    assert report["matched_norm"]["verdict"] in ("supported", "refuted", "undecided", "not tested")
    assert "P2 at matched update norm" in (out / "pressure.md").read_text()
    assert (out / "pressure.png").stat().st_size > 1000
    wrong = subprocess.run([sys.executable, os.path.join(ROOT, "reproduce.py"), "--preset", "smoke", "--study",
                            "pressure"], capture_output=True, text=True)
    assert wrong.returncode != 0 and "--study pressure is a toy study: pass --preset toy or toy-mini" in wrong.stderr


def test_precondition_c_weighs_each_run_once_however_many_of_its_points_were_evaluated(monkeypatch):
    point = lambda run, arm, distance: dict(run=run, arm=arm, state_distance=distance, norm=1.0, forgetting=0.0)
    rows = [point("student-lr0.001", "student", 0.1)] * 3 + [point("student-lr0.01", "student", 1.0)] + [
        point("data-lr0.001", "data", 0.9)] * 3
    base = {"mmlu": {"acc": 0.8, "n": 210}, "truthfulqa": {"mc1": 0.7, "n": 400}}
    monkeypatch.setattr(pressure, "collect", lambda root: (base, {}, rows))
    r = pressure.reading("unused")
    assert r["state_distance"] == {"student": pytest.approx(0.55), "data": pytest.approx(0.9)}
    assert r["precondition"] is True and r["matched_norm"]["verdict"] == "undecided"  # no points: no shared range


def test_the_summary_reads_each_runs_end_over_seeds():
    def point(seed, step, norm, forgetting, bad=False):
        return dict(run=pressure.run_name("student", 1e-3, seed), arm="student", lr=1e-3, seed=seed, step=step,
                    norm=norm, forgetting=forgetting, gain=0.01 * seed, state_distance=0.1, degenerate=bad)
    points = [point(0, 20, 1.0, 0.50), point(0, 60, 2.0, 0.10), point(1, 60, 4.0, 0.30, bad=True),
              point(1, 20, 3.0, 0.90)]  # snapshots (step 20) are not ends, in whatever order they come
    (row,) = pressure.ends(points)
    assert (row["arm"], row["lr"], row["seeds"], row["degenerate"]) == ("student", 1e-3, 2, 1)
    assert row["norm"] == pytest.approx((3.0, math.sqrt(2))) and row["forgetting"] == pytest.approx((0.2, math.sqrt(0.02)))
    report = dict(points=points, state_distance={"student": 0.1, "data": None}, precondition=False, question_se=0.02,
                  matched_norm=dict(verdict="not tested", why="precondition C fails"),
                  matched_gain=dict(verdict="not tested", why="precondition C fails"))
    assert "| student | 0.001 | 2 | 3.0±1.4 | 0.200±0.141 | 0.005±0.007 | 0.10±0.00 | 1 of 2 |" in (
        pressure.markdown(report))
