"""
The pressure study's report (docs/pressure-study.md): P2 read at matched pressure. One signal
(the continuations of an RL teacher, which writes as the base writes), the state source
changed alone, each arm pushed across the same range of update norms by its learning rate;
every run and snapshot is a point (update norm, forgetting, GSM8K gain), and the student
arm's forgetting is compared with the data arm's at matched update norm (and at matched
gain) by the rule fixed before the runs.

    python pressure.py out/toy/pressure     # pressure.md, pressure.json, pressure.png again
"""
import argparse
import math
import os
import re
import statistics

import cli
import figures
import lora
import model as M
import provenance
import results
import runs

ARMS = {"student": "student", "teacher": "teacher", "data": "data", "mixed": "student=0.5,data=0.5"}
ENDS = ("sft", "rl")  # the paper's two ends, described beside the arms
TEACHER = "rl-teacher"  # the signal's source: the toy's RL run, trained once per seed
GRID = 8  # matched points over the range two arms share
JUMP = 0.5  # nats per token: a run whose own states moved this far from the base while it trained


def run_name(arm, lr, seed=0):
    return f"{arm}-lr{lr:g}" + (f"-seed{seed}" if seed else "")


def parse_name(name):
    """(arm, lr, seed) of a run_name, or None for another folder (the teacher, the base)."""
    m = re.fullmatch(r"([a-z]+)-lr([0-9.e+-]+?)(?:-seed(\d+))?", name)
    return (m[1], float(m[2]), int(m[3] or 0)) if m and m[1] in (*ARMS, *ENDS) else None


def degenerate(folder):
    """Whether the run's own states moved away while it trained: the mean state_nll_base of its
    last fifth of steps exceeds that of its first fifth by more than JUMP."""
    log = runs.read_log(os.path.join(folder, "log.jsonl"))
    nll = [r["state_nll_base"] for r in log if "state_nll_base" in r]
    k = max(1, len(nll) // 5)
    return len(nll) >= 2 and sum(nll[-k:]) / k - sum(nll[:k]) / k > JUMP


def snapshots(folder):
    """A finished run's snapshot folders before its last step (the last is the run itself)."""
    root, last = os.path.join(folder, "snapshots"), provenance.run_record(folder)["finished_steps"]
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, s) for s in sorted(os.listdir(root)) if s != f"step-{last:06d}"]


def snapshot_points(folder, base_gsm8k):
    """The points of a run's evaluated snapshots: dict(step, norm, forgetting, gain)."""
    out = []
    for f in snapshots(folder):
        if os.path.isfile(os.path.join(f, "eval.json")):
            e = M.read_json(os.path.join(f, "eval.json"))
            out.append(dict(step=provenance.run_record(f)["finished_steps"],
                            norm=lora.update_norm(f), forgetting=e["retention"]["forgetting"],
                            gain=e["gsm8k"]["flexible"] - base_gsm8k))
    return out


def collect(root):
    """(the base's eval, {arm: {seed: [points]}} without degenerate runs, every point as a row): the
    study's runs as results.collect_runs gathers them, each with its snapshots."""
    found = results.collect_runs(root)
    base = found["base"]["eval"]
    arms, rows = {}, []
    for row in results.table_rows(found):
        parsed = parse_name(row["run"])
        if parsed is None:
            continue
        folder = found[row["run"]]["folder"]
        final = dict(step=provenance.run_record(folder)["finished_steps"], norm=row["update_norm"],
                     forgetting=row["forgetting"], gain=row["gsm8k"] - base["gsm8k"]["flexible"])
        bad = degenerate(folder)
        for p in snapshot_points(folder, base["gsm8k"]["flexible"]) + [final]:
            rows.append(dict(run=row["run"], arm=parsed[0], lr=parsed[1], seed=parsed[2],
                             degenerate=bad, state_distance=row["state_distance"], **p))
            if not bad:
                arms.setdefault(parsed[0], {}).setdefault(parsed[2], []).append(p)
    return base, arms, rows


def interpolate(points, key, x, log=False):
    """Forgetting at x of `key`, linear between the points in order of key (None outside them)."""
    f = (lambda v: math.log(v)) if log else (lambda v: v)
    pts = sorted((f(p[key]), p["forgetting"]) for p in points)
    xv = f(x)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= xv <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (xv - x0) / (x1 - x0)
    return pts[0][1] if len(pts) == 1 and abs(pts[0][0] - xv) < 1e-12 else None


def matched(a, b, key, question_se, log=False):
    """The rule's comparison of arms a and b ({seed: points}) at matched `key`: d = forgetting(b) -
    forgetting(a) on GRID values over the range both cover in every seed; its mean and standard
    error (over seeds, or question_se for one seed); the verdict."""
    seeds = sorted(set(a) & set(b))
    lo = max(min(p[key] for p in s[seed]) for s in (a, b) for seed in seeds) if seeds else None
    hi = min(max(p[key] for p in s[seed]) for s in (a, b) for seed in seeds) if seeds else None
    if not seeds or lo >= hi or (log and lo <= 0):
        return dict(verdict="undecided", why="the arms share no range", grid=[])
    def step(i):  # GRID values, evenly spaced (in log space with log)
        return lo * (hi / lo) ** (i / (GRID - 1)) if log else lo + (hi - lo) * i / (GRID - 1)
    grid = []
    for x in (min(max(step(i), lo), hi) for i in range(GRID)):  # the ends exactly, rounding aside
        d = [interpolate(b[s], key, x, log) - interpolate(a[s], key, x, log) for s in seeds]
        mean = sum(d) / len(d)
        se = (math.sqrt(sum((v - mean) ** 2 for v in d) / (len(d) - 1) / len(d)) if len(d) > 1
              else question_se)
        grid.append(dict(x=x, d=mean, se=se))
    verdict = ("supported" if all(g["d"] > 2 * g["se"] for g in grid) else
               "refuted" if all(abs(g["d"]) <= 2 * g["se"] for g in grid) else "undecided")
    return dict(verdict=verdict, seeds=len(seeds), lo=lo, hi=hi, grid=grid)


def question_se(base):
    """One seed's standard error of a difference of two forgetting values: the questions' noise."""
    m, t = base["mmlu"]["acc"], base["truthfulqa"]["mc1"]
    return 0.5 * math.sqrt(2 * m * (1 - m) / base["mmlu"]["n"]
                           + 2 * t * (1 - t) / base["truthfulqa"]["n"])


def reading(root):
    """pressure.json's content: the points, precondition C, and the two matched comparisons."""
    base, arms, rows = collect(root)
    per_run = {(r["arm"], r["run"]): r["state_distance"] for r in rows
               if r["state_distance"] is not None}  # a run once
    dist = {arm: [d for (a, _), d in per_run.items() if a == arm] for arm in ("student", "data")}
    mean = {arm: sum(v) / len(v) if v else None for arm, v in dist.items()}
    c = None not in mean.values() and mean["data"] - mean["student"] >= 0.3
    se = question_se(base)
    out = dict(points=rows, state_distance=mean, precondition=c, question_se=se)
    for key, log in (("norm", True), ("gain", False)):
        out[f"matched_{key}"] = (
            matched(arms.get("student", {}), arms.get("data", {}), key, se, log) if c else
            dict(verdict="not tested", why="precondition C fails", grid=[]))
    return out


def ends(points):
    """Per (arm, lr), the runs' last points over seeds: seeds, and the mean (and standard
    deviation over seeds) of update norm, forgetting, GSM8K gain and state distance;
    degenerate runs counted."""
    last = {}
    for p in points:
        if p["step"] >= last.get(p["run"], p)["step"]:
            last[p["run"]] = p
    out = {}
    for p in last.values():
        out.setdefault((p["arm"], p["lr"]), []).append(p)
    rows = []
    for (arm, lr), group in sorted(out.items()):
        row = dict(arm=arm, lr=lr, seeds=len(group), degenerate=sum(p["degenerate"] for p in group))
        for k in ("norm", "forgetting", "gain", "state_distance"):
            values = [p[k] for p in group if p[k] is not None]
            row[k] = (statistics.mean(values) if values else None,
                      statistics.stdev(values) if len(values) > 1 else None)
        rows.append(row)
    return rows


def markdown(r):
    lines = ["# The pressure study", "",
             "The end of each run over seeds, mean±standard deviation:", "",
             "| arm | lr | seeds | update norm | forgetting | GSM8K gain | state distance | "
             "degenerate |", "|---|---|---|---|---|---|---|---|"]
    for e in ends(r["points"]):
        marked = f"{e['degenerate']} of {e['seeds']}" if e["degenerate"] else ""
        specs = (("norm", ".1f"), ("forgetting", ".3f"), ("gain", ".3f"), ("state_distance", ".2f"))
        cells = [results.fmt(e[k][0], spec, e[k][1]) for k, spec in specs]
        lines.append(f"| {e['arm']} | {e['lr']:g} | {e['seeds']} | {' | '.join(cells)} | "
                     f"{marked} |")
    lines += ["", "Every point (a run's snapshots and its end):", "",
              "| run | arm | lr | seed | step | update norm | forgetting | GSM8K gain | "
              "state distance | degenerate |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["points"]:
        sd = "-" if p["state_distance"] is None else f"{p['state_distance']:.2f}"
        lines.append(f"| {p['run']} | {p['arm']} | {p['lr']:g} | {p['seed']} | {p['step']} | "
                     f"{p['norm']:.2f} | {p['forgetting']:.3f} | {p['gain']:+.3f} | {sd} | "
                     f"{'yes' if p['degenerate'] else ''} |")
    sd = r["state_distance"]
    lines += ["", f"Precondition C (the student arm's states lie at least 0.3 nats nearer the base "
              f"than the data arm's): student {results.fmt(sd['student'], '.2f')}, data "
              f"{results.fmt(sd['data'], '.2f')}: {'holds' if r['precondition'] else 'fails'}. "
              f"One seed's standard error: {r['question_se']:.3f}."]
    for key, what in (("norm", "update norm"), ("gain", "GSM8K gain")):
        m = r[f"matched_{key}"]
        grid = ", ".join(f"{g['d']:+.3f} ({g['se']:.3f})" for g in m.get("grid", []))
        over = (f" ({m['why']})" if "why" in m else
                f", over {m['lo']:.3g} to {m['hi']:.3g}, {m['seeds']} seed(s); d = "
                f"forgetting(data) - forgetting(student) (standard error): " + grid)
        lines += ["", f"P2 at matched {what}: **{m['verdict']}**" + over]
    return "\n".join(lines) + "\n"


def plot(root, r):
    """pressure.png: forgetting against update norm and against GSM8K gain, one curve per arm
    (the mean over seeds at each learning rate and step, the seeds' range as a band)."""
    plt = figures.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for arm in (*ARMS, *ENDS):
        by_point = {}
        for p in r["points"]:
            if p["arm"] == arm and not p["degenerate"]:
                by_point.setdefault((p["lr"], p["step"]), []).append(p)
        if not by_point:
            continue
        groups = sorted(by_point.values(), key=lambda g: sum(p["norm"] for p in g))
        for ax, key in zip(axes, ("norm", "gain")):
            x = [sum(p[key] for p in g) / len(g) for g in groups]
            y = [sum(p["forgetting"] for p in g) / len(g) for g in groups]
            line, = ax.plot(x, y, "o-", ms=3, label=arm)
            ax.fill_between(x, [min(p["forgetting"] for p in g) for g in groups],
                            [max(p["forgetting"] for p in g) for g in groups],
                            color=line.get_color(), alpha=0.15)
    for p in r["points"]:
        if p["degenerate"]:
            for ax, key in zip(axes, ("norm", "gain")):
                ax.plot(p[key], p["forgetting"], "x", color="gray")
    axes[0].set(xscale="log", xlabel="update norm", ylabel="forgetting",
                title="at matched pressure")
    axes[1].set(xlabel="GSM8K gain over the base", title="at matched gain (x: degenerate)")
    axes[0].legend(fontsize=7)
    path = os.path.join(root, "pressure.png")
    fig.tight_layout()
    M.write_atomic(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return path


def write_report(root):
    """pressure.json, pressure.md and pressure.png in root; returns the markdown."""
    r = reading(root)
    M.write_json(os.path.join(root, "pressure.json"), r)
    text = markdown(r)
    M.write_atomic(os.path.join(root, "pressure.md"), lambda p: open(p, "w").write(text))
    plot(root, r)
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="the pressure study's folder (reproduce.py --study pressure)")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.root, "eval.json")):
        raise M.InputError(f"{args.root} holds no base evaluation (eval.json); run python "
                           f"reproduce.py --study pressure")
    print(write_report(args.root))


if __name__ == "__main__":
    cli.run_script(main)
