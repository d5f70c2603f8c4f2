"""
The frontier study's report (docs/frontier-study.md): forgetting at matched gain on the target.
Each arm (a method and where its states come from) runs at a few learning rates with
snapshots along the way; every run end and snapshot is a point (GSM8K gain over the base,
forgetting, update norm, KL to the base, state distance, MMD^2). An arm's frontier is the
least forgetting it reaches for at least a given gain; pairs of arms that differ in their
states are compared along it by the rule fixed before the runs.

    python results.py out/toy/frontier --study frontier   # the report again from the runs
"""
import math
import os
import re
import statistics

import numpy as np

from plumbing import provenance, runs
from plumbing.files import write_atomic, write_json
from study import direction, figures, report

# arm -> (script, its flags): where each arm's states and signal come from
ARMS = {"sft": ("sft", []),  # the gold answers' states
        "rs-sft": ("sft", ["--answers", "samples"]),  # the base's own right samples
        "rl": ("rl", []),  # the learner's rollouts, scored by the reward
        "opd-student": ("opd", ["--state-source", "student"]),  # the teacher's signal, own states
        "opd-data": ("opd", ["--state-source", "data"]),  # the same signal, the gold states
        "kd": ("opd", ["--state-source", "teacher"])}  # the same signal, the teacher's states
# (on-policy arm, off-policy arm): each pair changes where the states come from
PAIRS = (("rl", "sft"), ("rs-sft", "sft"), ("opd-student", "opd-data"))
TEACHER_ARM = "rl"  # the OPD arms' teacher: the rl arm's run at its first learning rate
GRID = 8  # matched gains over a pair's overlap
MIN_OVERLAP = 0.1  # a pair whose arms share less range of gain is not tested
JUMP = 0.5  # nats per token: a run whose own states moved this far from the base while it trained


# each preset's arms, each script's learning rates (the toy
# rate, then the high rate the probes chose), each script's flags and an arm's own
SPECS = {
    "toy": dict(arms=tuple(ARMS),
                lrs={"sft": (2e-3, 6e-3), "rl": (3e-4, 1e-3), "opd": (3e-3, 1e-2)},
                flags={"sft": ["--preset", "mild", "--epochs", "3", "--snapshot-every", "38"],
                       "rl": ["--group-size", "8", "--snapshot-every", "25"],  # as it ran
                       "opd": ["--steps", "60", "--snapshot-every", "15"]},
                arm_flags={"rs-sft": ["--samples-per-prompt", "3", "--max-new-tokens", "96"]}),
    "toy-mini": dict(arms=("sft", "rl", "opd-student", "opd-data"),
                     lrs={"sft": (1e-3,), "rl": (1e-3,), "opd": (1e-3,)},
                     flags={script: ["--snapshot-every", "1"] for script in ("sft", "rl", "opd")},
                     arm_flags={}),
}


def runs_of(out, seed=0, preset="toy"):
    """name -> (script, arguments): every arm of the frontier study at each of its script's
    learning rates, all with the same seed (seed s > 0: names end in -seed<s>). The OPD arms
    learn from the rl arm's run at its first rate, which comes before them."""
    spec = SPECS[preset]
    teacher = os.path.join(out, run_name(TEACHER_ARM, spec["lrs"]["rl"][0], seed))
    conditions = {}
    for arm in spec["arms"]:
        script, own = ARMS[arm]
        flags = [*spec["flags"][script], *own, *spec["arm_flags"].get(arm, []),
                 *(["--teacher", teacher] if script == "opd" else [])]
        for lr in spec["lrs"][script]:
            conditions[run_name(arm, lr, seed)] = (
                script, [*flags, "--lr", str(lr), "--seed", str(seed)])
    return conditions


def run_name(arm, lr, seed=0):
    return f"{arm}-lr{lr:g}" + (f"-seed{seed}" if seed else "")


def parse_name(name):
    """(arm, lr, seed) of a run_name, or None for another folder."""
    m = re.fullmatch(r"([a-z-]+?)-lr([0-9.e+-]+?)(?:-seed(\d+))?", name)
    return (m[1], float(m[2]), int(m[3] or 0)) if m and m[1] in ARMS else None


def degenerate(folder):
    """Whether the run's own states moved away while it trained: the mean state_nll_base of its
    last fifth of steps exceeds that of its first fifth by more than JUMP."""
    log = runs.read_log(os.path.join(folder, "log.jsonl"))
    nll = [r["state_nll_base"] for r in log if "state_nll_base" in r]
    k = max(1, len(nll) // 5)
    return len(nll) >= 2 and sum(nll[-k:]) / k - sum(nll[:k]) / k > JUMP


def snapshots(folder):
    """A finished run's snapshot folders before its last step (the last is the run itself)."""
    root = os.path.join(folder, "snapshots")
    if not os.path.isdir(root):  # a run without --snapshot-every: run.json need not be read
        return []
    last = provenance.run_record(folder)["finished_steps"]
    return [os.path.join(root, s) for s in sorted(os.listdir(root)) if s != f"step-{last:06d}"]


PREDICTORS = tuple(k for k, _ in report.PREDICTORS)  # update_norm, mmd2, state_distance, kl
# what the report sets beside forgetting: the main study's predictors and the update's direction
BESIDE = (*report.PREDICTORS, ("principal_share", "share in the base's principal directions"))


def point(row, folder, base_gsm8k, bases, **where):
    """A point of the study from a results row of a run's end or snapshot; bases: the base's
    principal directions (direction.principal_bases)."""
    return dict(**where, step=provenance.run_record(folder)["finished_steps"],
                gain=row["gsm8k"] - base_gsm8k, forgetting=row["forgetting"],
                **{k: row[k] for k in PREDICTORS},
                principal_share=direction.principal_share(folder, bases))


def collect(root, parse=parse_name, key="lr"):
    """(the base's eval, every point): each run's end and evaluated snapshots, with its arm, its
    learning rate (or the key of what another study's parse names second), seed, folder (path)
    and whether it is degenerate; rows as report.table_rows reads them."""
    found = report.collect_runs(root)
    base_gsm8k, bases, points = found["base"]["eval"]["gsm8k"]["flexible"], None, []
    for row in report.table_rows(found):
        parsed = parse(row["run"])
        if parsed is None:
            continue
        folder = found[row["run"]]["folder"]
        bases = bases or direction.principal_bases(provenance.run_record(folder)["model"])
        where = {"run": row["run"], "arm": parsed[0], key: parsed[1], "seed": parsed[2],
                 "degenerate": degenerate(folder)}
        shots = report.collect_runs(os.path.join(folder, "snapshots"))
        for snap in report.table_rows(shots):
            at = shots[snap["run"]]["folder"]
            points.append(point(snap, at, base_gsm8k, bases, path=at, **where))
        points.append(point(row, folder, base_gsm8k, bases, path=folder, **where))
    return found["base"]["eval"], points


def by_arm(points):
    """{arm: {seed: [points]}} of the points of runs not marked degenerate."""
    out = {}
    for p in points:
        if not p["degenerate"]:
            out.setdefault(p["arm"], {}).setdefault(p["seed"], []).append(p)
    return out


def frontier(points, gain):
    """The least forgetting among the points with at least this gain (None: none reaches it)."""
    reached = [p["forgetting"] for p in points if p["gain"] >= gain]
    return min(reached) if reached else None


def compare(on, off, question_se):
    """The rule's reading of one pair ({seed: points} each): over the gains both arms reach in
    every seed, (0, G], d = forgetting(off) - forgetting(on) at GRID gains G/GRID .. G, its mean
    over seeds and standard error (question_se with one seed); the verdict."""
    seeds = sorted(set(on) & set(off))
    if not seeds:
        return dict(verdict="not tested", why="an arm has no points", grid=[])
    top = min(max(p["gain"] for p in arm[s]) for arm in (on, off) for s in seeds)
    if top < MIN_OVERLAP:
        return dict(verdict="not tested", seeds=len(seeds), top=top, grid=[],
                    why=f"the arms share gains up to {top:+.3f} only, under {MIN_OVERLAP}")
    grid = []
    for g in (top * i / GRID for i in range(1, GRID + 1)):
        d = [frontier(off[s], g) - frontier(on[s], g) for s in seeds]
        se = (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else question_se)
        grid.append(dict(gain=g, d=statistics.mean(d), se=se))
    verdict = ("supported" if all(x["d"] > 2 * x["se"] for x in grid) else
               "refuted" if all(abs(x["d"]) <= 2 * x["se"] for x in grid) else "undecided")
    return dict(verdict=verdict, seeds=len(seeds), top=top, grid=grid)


def question_se(base):
    """One seed's standard error of a difference of two forgetting values: the questions' noise."""
    m, t = base["mmlu"]["acc"], base["truthfulqa"]["mc1"]
    return 0.5 * math.sqrt(2 * m * (1 - m) / base["mmlu"]["n"]
                           + 2 * t * (1 - t) / base["truthfulqa"]["n"])


def reading(root):
    """frontier.json's content: every point, each pair's comparison, the predictors, the
    regression."""
    base, points = collect(root)
    arms, se = by_arm(points), question_se(base)
    kept = [p for p in points if not p["degenerate"]]
    return dict(points=[{k: v for k, v in p.items() if k != "path"} for p in points],
                question_se=se,
                pairs=[dict(on=on, off=off, **compare(arms.get(on, {}), arms.get(off, {}), se))
                       for on, off in PAIRS],
                predictors={k: report.drift_vs_forgetting(kept, k) for k, _ in BESIDE},
                regression=regression(kept))


# where each arm's states come from, for the regression (the gold data's is its baseline)
SOURCES = {"sft": "gold data", "opd-data": "gold data", "rs-sft": "base's right samples",
           "rl": "own rollouts", "opd-student": "own rollouts", "kd": "teacher's rollouts"}


def regression(points):
    """Beside the rule: forgetting fitted by least squares on log update norm, gain and the state
    source (an indicator a source; the gold data's the baseline) over points of runs not marked
    degenerate, each coefficient with its standard error clustered by run (a run's snapshots
    share its noise), CR1's small-sample factor. None with no more runs than terms."""
    kept = [p for p in points if p["update_norm"] and p["forgetting"] is not None]
    sources = sorted({SOURCES[p["arm"]] for p in kept} - {"gold data"})
    X = np.array([[1.0, math.log(p["update_norm"]), p["gain"],
                   *(float(SOURCES[p["arm"]] == s) for s in sources)] for p in kept])
    y = np.array([p["forgetting"] for p in kept])
    runs_of_points = [p["run"] for p in kept]
    n, k, g = len(y), 3 + len(sources), len(set(runs_of_points))
    if g <= k:
        return None
    inverse = np.linalg.pinv(X.T @ X)
    beta = inverse @ X.T @ y
    residual = y - X @ beta
    meat = np.zeros((k, k))
    for run in set(runs_of_points):
        score = sum(X[i] * residual[i] for i, r in enumerate(runs_of_points) if r == run)
        meat += np.outer(score, score)
    scale = g / (g - 1) * (n - 1) / (n - k)
    se = np.sqrt(np.clip(np.diag(inverse @ meat @ inverse) * scale, 0, None))
    spread = ((y - y.mean()) ** 2).sum()
    return dict(n=n, runs=g, r2=float(1 - (residual ** 2).sum() / spread) if spread else None,
                terms=[dict(name=t, coef=float(b), se=float(e)) for t, b, e in
                       zip(["intercept", "log update norm", "gain", *sources], beta, se)])


def ends(points, key="lr"):
    """Per (arm, lr) (or another study's key), the runs' last points over seeds: those points,
    seeds, degenerate runs, and the mean and standard deviation over seeds of update norm,
    forgetting, gain, KL, state distance."""
    last = {}
    for p in points:
        if p["step"] >= last.get(p["run"], p)["step"]:
            last[p["run"]] = p
    groups = {}
    for p in last.values():
        groups.setdefault((p["arm"], p[key]), []).append(p)
    rows = []
    for (arm, at), group in sorted(groups.items(), key=lambda kv: (list(ARMS).index(kv[0][0]),
                                                                   kv[0][1])):
        row = {"arm": arm, key: at, "seeds": len(group),
               "degenerate": sum(p["degenerate"] for p in group)}
        for k in ("update_norm", "forgetting", "gain", "kl_to_base", "state_distance"):
            row[k] = report.mean_sd([p[k] for p in group])
        rows.append(row)
    return rows


END_COLUMNS = (("update_norm", ".1f"), ("forgetting", ".3f"), ("gain", ".3f"),
               ("kl_to_base", ".3g"), ("state_distance", ".2f"))


def ends_lines(points):
    lines = ["The end of each run over seeds, mean±standard deviation:", "",
             "| arm | lr | seeds | update norm | forgetting | GSM8K gain | KL to base | "
             "state distance | degenerate |", "|---|---|---|---|---|---|---|---|---|"]
    for e in ends(points):
        marked = f"{e['degenerate']} of {e['seeds']}" if e["degenerate"] else ""
        cells = [report.fmt(e[k][0], spec, e[k][1]) for k, spec in END_COLUMNS]
        lines.append(f"| {e['arm']} | {e['lr']:g} | {e['seeds']} | {' | '.join(cells)} | "
                     f"{marked} |")
    return lines


def point_lines(points):
    lines = ["Every point (a run's snapshots and its end):", "",
             "| run | seed | step | update norm | forgetting | GSM8K gain | KL to base | "
             "state distance | MMD^2 | degenerate |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        cells = [report.fmt(p[k], spec) for k, spec in (*END_COLUMNS, ("mmd2", ".4g"))]
        lines.append(f"| {p['run']} | {p['seed']} | {p['step']} | {' | '.join(cells)} | "
                     f"{'yes' if p['degenerate'] else ''} |")
    return lines


def pair_lines(r):
    lines = [f"P2 at matched gain, by the rule (d = forgetting of the off-policy arm minus the "
             f"on-policy arm's; its standard error: the seeds' spread over the square root of "
             f"their number, which leaves out the questions' noise that every seed shares; "
             f"with one seed, the questions' alone: {r['question_se']:.3f}):", ""]
    for c in r["pairs"]:
        head = f"- **{c['on']} against {c['off']}: {c['verdict']}**"
        if not c["grid"]:
            lines.append(f"{head} ({c['why']})")
            continue
        grid = ", ".join(f"{x['d']:+.3f} ({x['se']:.3f})" for x in c["grid"])
        lines.append(f"{head}, at gains {c['top'] / GRID:.3f} to {c['top']:.3f}, {c['seeds']} "
                     f"seed(s); d (standard error): {grid}")
    return lines


def predictor_lines(r):
    lines = ["What predicts forgetting over every point of a run not marked degenerate (RL's "
             "Razor: R^2 0.96 on its toy, 0.71 on LLMs, for the KL to the base):", "",
             "| predictor | points | Spearman | p | R^2 | p |", "|---|---|---|---|---|---|"]
    for key, name in BESIDE:
        c = r["predictors"].get(key)
        if c is not None:
            lines.append(f"| {name} | {c['n']} | {c['spearman']:.2f} | "
                         f"{report.p_value(c['spearman_p'])} | {c['pearson'] ** 2:.2f} | "
                         f"{report.p_value(c['pearson_p'])} |")
    return lines


def regression_lines(r):
    fit = r.get("regression")
    if fit is None:
        return ["No regression: no more runs than terms."]
    lines = [f"Beside the rule, not a verdict: forgetting fitted on log update norm, gain and the "
             f"state source (the gold data's the baseline) over {fit['n']} points of "
             f"{fit['runs']} runs, R^2 {report.fmt(fit['r2'], '.2f')}; standard errors "
             f"clustered by run:", "", "| term | coefficient | standard error |", "|---|---|---|"]
    return lines + [f"| {t['name']} | {t['coef']:+.4f} | {t['se']:.4f} |" for t in fit["terms"]]


def markdown(r):
    parts = (["# The frontier study"], ends_lines(r["points"]), pair_lines(r), predictor_lines(r),
             regression_lines(r), point_lines(r["points"]))
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def envelope(arm, step=0.01):
    """(gains, mean frontier over seeds, lowest, highest) from no gain up to the highest gain
    every seed of the arm ({seed: points}) reaches, in steps of `step`; None if a seed gains
    nothing."""
    top = min(max(p["gain"] for p in pts) for pts in arm.values())
    if top < 0:
        return None
    gains = [i * step for i in range(int(top / step) + 1)]
    per_seed = [[frontier(pts, g) for g in gains] for pts in arm.values()]
    columns = list(zip(*per_seed))
    return (gains, [statistics.mean(c) for c in columns], [min(c) for c in columns],
            [max(c) for c in columns])


def plot(root, r):
    """frontier.png: each arm's frontier (forgetting against gain, the mean over seeds with
    their range as a band, every point faint) and forgetting against the KL to the base."""
    plt = figures.pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    arms = by_arm(r["points"])
    for arm, seeds in ((a, arms[a]) for a in ARMS if a in arms):  # the same colour for each arm
        curve, pts = envelope(seeds), [p for s in seeds.values() for p in s]
        line, = left.plot(*(curve[:2] if curve else ([], [])), "-", label=arm)
        if curve:
            left.fill_between(curve[0], curve[2], curve[3], color=line.get_color(), alpha=0.15)
        left.plot([p["gain"] for p in pts], [p["forgetting"] for p in pts], ".",
                  color=line.get_color(), alpha=0.3, ms=3)
        right.plot([p["kl_to_base"] for p in pts], [p["forgetting"] for p in pts], "o", ms=3,
                   color=line.get_color(), label=arm)
    left.set(xlabel="GSM8K gain over the base", ylabel="forgetting (least at that gain or more)",
             title="the frontier: forgetting at matched gain")
    right.set(xscale="log", xlabel="KL to the base on the target (RL's Razor)",
              ylabel="forgetting", title="every point")
    left.legend(fontsize=7)
    return figures.save(fig, os.path.join(root, "frontier.png"))


def write_report(root):
    """frontier.json, frontier.md and frontier.png in root; returns the markdown."""
    return report_files(root, "frontier", reading(root), markdown, plot)


def report_files(root, name, r, to_markdown, draw):
    """<name>.json, <name>.md and <name>.png in root from a study's reading r; the markdown."""
    write_json(os.path.join(root, f"{name}.json"), r)
    text = to_markdown(r)
    write_atomic(os.path.join(root, f"{name}.md"), lambda p: open(p, "w").write(text))
    draw(root, r)
    return text
