"""study/frontier.py, reproduce.py --study frontier and results.py --study frontier: forgetting at matched
gain, by its rule."""
import json
import math
import os
import subprocess
import sys

import pytest

import reproduce
from conftest import ROOT
from study import frontier, size


def arm(*pairs):
    """{seed 0: points} of (gain, forgetting) pairs."""
    return {0: [dict(gain=g, forgetting=f) for g, f in pairs]}


def seeds(*arms):
    return {s: a[0] for s, a in enumerate(arms)}


def test_the_frontier_is_the_least_forgetting_at_a_gain_reached():
    points = arm((0.05, 0.00), (0.20, 0.30), (0.30, 0.10), (-0.1, -0.05))[0]
    assert frontier.frontier(points, 0.0) == 0.00  # the loss of the target does not count as a gain
    assert frontier.frontier(points, 0.10) == 0.10  # 0.30 forgets less than 0.20 and gains more
    assert frontier.frontier(points, 0.30) == 0.10 and frontier.frontier(points, 0.31) is None
    # the figure's curve: the mean over seeds up to the gain every seed reaches, the seeds' range as a band
    gains, mean, lo, hi = frontier.envelope({0: points, 1: arm((0.02, 0.04))[0]}, step=0.01)
    assert gains == pytest.approx([0.0, 0.01, 0.02]) and mean == pytest.approx([0.02] * 3)
    assert (lo, hi) == ([0.0] * 3, [0.04] * 3)
    assert frontier.envelope({0: points, 1: arm((-0.02, 0.04))[0]}) is None  # a seed that gains nothing: no curve


def test_the_rule_reads_supported_refuted_undecided_and_not_tested():
    on = arm((0.1, 0.00), (0.4, 0.02))
    off = arm((0.2, 0.10), (0.3, 0.20))  # reaches 0.3 at most: the overlap is (0, 0.3]
    c = frontier.compare(on, off, question_se=0.02)
    assert c["verdict"] == "supported" and c["top"] == 0.3 and len(c["grid"]) == frontier.GRID
    assert [x["gain"] for x in c["grid"]] == pytest.approx([0.3 * i / 8 for i in range(1, 9)])
    # gain 0.0375 and 0.15: on reaches both with 0.00 then 0.02; off with 0.10 then 0.10
    assert c["grid"][0]["d"] == pytest.approx(0.10) and c["grid"][3]["d"] == pytest.approx(0.10 - 0.02)
    assert c["grid"][0]["se"] == 0.02  # one seed: the questions' noise
    assert frontier.compare(on, on, 0.02)["verdict"] == "refuted"
    steep = arm((0.1, 0.00), (0.4, 0.30))  # the off-policy arm forgets more at small gains, less at large ones
    assert frontier.compare(steep, arm((0.4, 0.10)), 0.02)["verdict"] == "undecided"
    short = frontier.compare(on, arm((0.05, 0.5), (0.09, 0.6)), 0.02)
    assert short["verdict"] == "not tested" and "under 0.1" in short["why"]
    assert frontier.compare(on, {}, 0.02)["verdict"] == "not tested"
    # with seeds, the standard error is theirs: the same mean difference, once steady and once not
    steady = frontier.compare(seeds(on, on, on), seeds(*[arm((0.4, 0.1))] * 3), question_se=1.0)
    assert steady["verdict"] == "supported" and steady["grid"][0]["se"] == pytest.approx(0, abs=1e-12)
    noisy = frontier.compare(seeds(on, on, on), seeds(arm((0.4, 0.3)), arm((0.4, -0.1)), arm((0.4, 0.1))),
                             question_se=0.0)
    assert noisy["verdict"] == "refuted" and noisy["grid"][0]["se"] == pytest.approx(0.2 / math.sqrt(3))



def test_the_frontiers_rule_turns_at_its_boundaries():
    """Two standard errors (not one or three), every matched gain (not any), MIN_OVERLAP."""
    on = arm((0.2, 0.0))
    for d, verdict in ((0.019, "refuted"), (0.021, "supported")):  # at every gain, d against 2 x 0.01
        assert frontier.compare(on, arm((0.2, d)), question_se=0.01)["verdict"] == verdict, d
    # d = 0 up to gain 0.1, beyond the noise above it: neither every gain beyond it nor every one within
    half = frontier.compare(on, arm((0.1, 0.0), (0.2, 0.05)), question_se=0.01)
    assert [x["d"] for x in half["grid"]] == pytest.approx([0.0] * 4 + [0.05] * 4)
    assert half["verdict"] == "undecided"
    flipped = frontier.compare(arm((0.1, 0.0), (0.2, 0.05)), on, question_se=0.01)  # d of -0.05 above 0.1
    assert flipped["verdict"] == "undecided"
    for top, tested in ((0.09, False), (0.11, True)):  # MIN_OVERLAP
        c = frontier.compare(arm((top, 0.0)), arm((top, 0.0)), question_se=0.01)
        assert (c["verdict"] != "not tested") is tested, top

def log_run(folder, nll):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "log.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": i + 1, "state_nll_base": v}) + "\n" for i, v in enumerate(nll))


def test_a_run_whose_own_states_moved_away_is_marked_degenerate_and_left_off_the_frontier(tmp_path):
    log_run(tmp_path / "a", [0.2] * 8 + [0.9, 0.9])
    log_run(tmp_path / "b", [0.2] * 8 + [0.6, 0.6])  # a rise of 0.4 nats: within the bound
    assert frontier.degenerate(str(tmp_path / "a")) and not frontier.degenerate(str(tmp_path / "b"))
    points = [dict(arm="rl", seed=0, degenerate=True, gain=0.5, forgetting=0.0),
              dict(arm="rl", seed=1, degenerate=False, gain=0.1, forgetting=0.2)]
    assert frontier.by_arm(points) == {"rl": {1: [points[1]]}}


def test_run_names_round_trip_and_other_folders_are_not_arms():
    for a in frontier.ARMS:
        assert frontier.parse_name(frontier.run_name(a, 3e-3, 2)) == (a, 3e-3, 2)
        assert frontier.parse_name(frontier.run_name(a, 1e-2)) == (a, 1e-2, 0)
    assert frontier.parse_name("base-model") is None and frontier.parse_name("mild-seed1") is None


def test_each_arm_has_its_scripts_flags_and_the_opd_arms_learn_from_the_rl_arm():
    runs = frontier.runs_of("out/f", seed=1)
    assert len(runs) == 6 * 2 and list(runs).index("rl-lr0.0003-seed1") < list(runs).index("opd-student-lr0.003-seed1")
    teacher = ["--teacher", "out/f/rl-lr0.0003-seed1"]
    mild = ["--preset", "mild", "--epochs", "3", "--snapshot-every", "38"]
    assert runs["sft-lr0.006-seed1"] == ("sft", [*mild, "--lr", "0.006", "--seed", "1"])
    assert runs["rs-sft-lr0.002-seed1"] == ("sft", [*mild, "--answers", "samples", "--samples-per-prompt", "3",
                                                    "--max-new-tokens", "96", "--lr", "0.002", "--seed", "1"])
    assert runs["rl-lr0.001-seed1"] == ("rl", ["--group-size", "8", "--snapshot-every", "25", "--lr", "0.001", "--seed",
                                               "1"])
    # the main study's RL draws groups of 16; the frontier's runs as it ran, with groups of 8 after the preset's flags
    toy_rl = reproduce.PRESETS["toy"]["train"]["rl"]
    assert reproduce.PARSERS["rl"](toy_rl).group_size == 16
    assert reproduce.PARSERS["rl"]([*toy_rl, *runs["rl-lr0.001-seed1"][1]]).group_size == 8
    for name, source in (("opd-student", "student"), ("opd-data", "data"), ("kd", "teacher")):
        assert runs[f"{name}-lr0.01-seed1"] == ("opd", ["--steps", "60", "--snapshot-every", "15", "--state-source",
                                                        source, *teacher, "--lr", "0.01", "--seed", "1"])


def test_the_summary_reads_each_runs_end_over_seeds():
    def point(seed, step, norm, forgetting, bad=False):
        return dict(run=frontier.run_name("opd-student", 1e-3, seed), arm="opd-student", lr=1e-3, seed=seed,
                    step=step, update_norm=norm, forgetting=forgetting, gain=0.01 * seed, state_distance=0.1,
                    kl_to_base=1.0, mmd2=0.01, degenerate=bad)
    points = [point(0, 20, 1.0, 0.50), point(0, 60, 2.0, 0.10), point(1, 60, 4.0, 0.30, bad=True),
              point(1, 20, 3.0, 0.90)]  # snapshots (step 20) are not ends, in whatever order they come
    (row,) = frontier.ends(points)
    assert (row["arm"], row["lr"], row["seeds"], row["degenerate"]) == ("opd-student", 1e-3, 2, 1)
    assert row["update_norm"] == pytest.approx((3.0, math.sqrt(2)))
    assert row["forgetting"] == pytest.approx((0.2, math.sqrt(0.02)))
    report = dict(points=points, question_se=0.02, predictors={k: None for k in frontier.PREDICTORS},
                  pairs=[dict(on="rl", off="sft", verdict="not tested", why="an arm has no points", grid=[])])
    text = frontier.markdown(report)
    assert "| opd-student | 0.001 | 2 | 3.0±1.4 | 0.200±0.141 | 0.005±0.007 | 1±0 | 0.10±0.00 | 1 of 2 |" in text
    assert "- **rl against sft: not tested** (an arm has no points)" in text


def test_frontier_and_size_studies_run_end_to_end_in_miniature(tmp_path):
    out = tmp_path / "frontier"
    cmd = [sys.executable, os.path.join(ROOT, "reproduce.py"), "--preset", "toy-mini", "--study", "pressure", "--out",
           str(out)]  # the study's name before, kept
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "frontier.json").read_text())
    points = {(p["arm"], p["step"]) for p in report["points"]}
    assert points == {("sft", 1), ("sft", 2), ("sft", 3), ("rl", 1), ("rl", 2), ("opd-student", 1),
                      ("opd-student", 2), ("opd-data", 1), ("opd-data", 2)}  # each snapshot and each end
    for p in report["points"]:  # every point evaluated and measured, snapshots as ends
        assert None not in (p["forgetting"], p["kl_to_base"], p["mmd2"], p["update_norm"]), p
    assert (out / "rl-lr0.001" / "snapshots" / "step-000001" / "drift.json").is_file()
    run = json.loads((out / "opd-data-lr0.001" / "run.json").read_text())
    assert run["state_source"] == "data" and run["teacher"] == str(out / "rl-lr0.001")
    assert [(c["on"], c["off"]) for c in report["pairs"]] == list(frontier.PAIRS)
    assert "P2 at matched gain" in (out / "frontier.md").read_text()
    assert (out / "frontier.png").stat().st_size > 1000
    # the report again from the runs, by results.py's command
    (out / "frontier.md").unlink(), (out / "frontier.json").unlink()
    again = subprocess.run([sys.executable, os.path.join(ROOT, "results.py"), str(out), "--study", "frontier"],
                           capture_output=True, text=True)
    assert again.returncode == 0 and "P2 at matched gain" in again.stdout, again.stderr[-3000:]
    assert json.loads((out / "frontier.json").read_text()) == report
    alone = subprocess.run([sys.executable, os.path.join(ROOT, "results.py"), str(tmp_path), "--study", "frontier"],
                           capture_output=True, text=True)
    assert alone.returncode != 0 and "holds no base evaluation (eval.json)" in alone.stderr.strip().splitlines()[-1]
    wrong = subprocess.run([sys.executable, os.path.join(ROOT, "reproduce.py"), "--preset", "smoke", "--study",
                            "frontier"], capture_output=True, text=True)
    assert wrong.returncode != 0 and "--study frontier is a toy study: pass --preset toy or toy-mini" in wrong.stderr
    # the size study in the same folder: the frontier's world, base and rl run (its OPD teacher) are done already
    size_cmd = [*cmd[:5], "size", *cmd[6:], "--conditions", "sft-cap0.05,opd-data-cap0.05"]
    r = subprocess.run(size_cmd, capture_output=True, text=True)
    assert r.returncode == 0 and "[done already] train rl-lr0.001" in r.stdout, r.stderr[-3000:]
    capped = json.loads((out / "size.json").read_text())
    assert {p["run"] for p in capped["points"]} == {"sft-cap0.05", "opd-data-cap0.05"}  # no uncapped run is a point
    run = json.loads((out / "opd-data-cap0.05" / "run.json").read_text())
    assert run["max_update_norm"] == 0.05 and run["teacher"] == str(out / "rl-lr0.001")
    for e in capped["ends"]:  # the caps bind in miniature too
        assert e["binds"] == 1 and e["update_norm"][0] <= e["cap"], e
    assert [(c["on"], c["off"]) for c in capped["pairs"]] == list(size.PAIRS)
    # beside the rule, each top-cap run interpolated and evaluated: norms in proportion to the scale
    assert {(c["arm"], c["scale"]) for c in capped["curves"]} == {
        (a, s) for a in ("sft", "opd-data") for s in (*size.SCALES, 1.0)}
    for c in capped["curves"]:
        end = next(e for e in capped["ends"] if e["arm"] == c["arm"])
        assert c["update_norm"][0] == pytest.approx(c["scale"] * end["update_norm"][0], rel=1e-5)
        assert c["forgetting"][0] is not None and c["gain"][0] is not None
    assert (out / "size.png").stat().st_size > 1000
    (out / "size.json").unlink()
    again = subprocess.run([sys.executable, os.path.join(ROOT, "results.py"), str(out), "--study", "size"],
                           capture_output=True, text=True)
    assert again.returncode == 0 and "# The size study" in again.stdout, again.stderr[-3000:]
    assert json.loads((out / "size.json").read_text()) == capped
    subprocess.run([sys.executable, os.path.join(ROOT, "results.py"), str(out), "--study", "frontier"], check=True,
                   capture_output=True)
    assert json.loads((out / "frontier.json").read_text()) == report  # nor is a capped run the frontier's
    wrong = subprocess.run([sys.executable, os.path.join(ROOT, "reproduce.py"), "--preset", "smoke", "--study",
                            "size"], capture_output=True, text=True)
    assert wrong.returncode != 0 and "--study size is a toy study: pass --preset toy or toy-mini" in wrong.stderr


def test_the_regression_recovers_its_coefficients_and_its_errors_cluster_by_run():
    import numpy as np
    points, shift = [], {}
    for r in range(18):  # three runs of each arm, three points a run
        arm = list(frontier.ARMS)[r % 6]
        shift[r] = 0.02 * ((r * 7) % 5 - 2)  # a run's own noise, shared by its points
        for t in (1, 2, 3):
            norm, gain = 2.0 * t + r % 4, 0.05 * t + 0.01 * (r % 3)
            own = frontier.SOURCES[arm] == "own rollouts"
            points.append(dict(run=f"{arm}-{r}", arm=arm, update_norm=norm, gain=gain,
                               forgetting=0.05 * math.log(norm) + 0.1 * gain - 0.03 * own))
    exact = frontier.regression(points)
    coef = {t["name"]: t["coef"] for t in exact["terms"]}
    assert exact["runs"] == 18 and exact["n"] == 54 and exact["r2"] == pytest.approx(1.0)
    assert coef["log update norm"] == pytest.approx(0.05) and coef["gain"] == pytest.approx(0.1)
    assert coef["own rollouts"] == pytest.approx(-0.03) and abs(coef["teacher's rollouts"]) < 1e-9
    for p in points:
        p["forgetting"] += shift[int(p["run"].rsplit("-", 1)[1])]
    noisy = frontier.regression(points)
    X = np.array([[1.0, math.log(p["update_norm"]), p["gain"]] + [float(frontier.SOURCES[p["arm"]] == s) for s in
                  ("base's right samples", "own rollouts", "teacher's rollouts")] for p in points])
    y = np.array([p["forgetting"] for p in points])
    residual = y - X @ np.linalg.lstsq(X, y, rcond=None)[0]
    naive = np.sqrt(np.diag(np.linalg.inv(X.T @ X)) * (residual ** 2).sum() / (len(y) - X.shape[1]))
    se = {t["name"]: t["se"] for t in noisy["terms"]}
    assert se["own rollouts"] > naive[4]  # a run's points share its noise: not 54 independent draws
    assert frontier.regression(points[:9]) is None  # 3 runs, 6 terms
    assert "No regression: no more runs than terms." in frontier.markdown(dict(
        points=[], question_se=0.02, pairs=[], predictors={k: None for k in frontier.PREDICTORS}, regression=None))
