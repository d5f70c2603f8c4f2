"""
The size study's report (docs/size-study.md): do the state sources differ in forgetting once
the update is of the same size? Each arm of a pair (the same loss, its states from elsewhere)
trains under each cap on its update norm (--max-update-norm) at a rate that reaches it, with
snapshots along the way; at each cap the pair is compared at matched gain as the frontier
study compares it, with a standard error over seeds and questions, and the caps' comparisons
give one verdict by the rule fixed before the runs.

    python reproduce.py --study size             # one seed, into out/toy/size
    python results.py out/toy/size --study size  # the report again from the runs
"""
import functools
import math
import os
import re
import statistics

import evaluate
import lora
from plumbing import provenance
from plumbing.files import write_atomic, write_json
from study import figures, frontier, report

# (on-policy arm, off-policy arm): the same loss, the states from elsewhere
PAIRS = (("rs-sft", "sft"), ("rl", "sft"), ("opd-student", "opd-data"))
DECIDING = 2  # a pair's highest caps tested that decide "supported"
BAND = 0.03  # "refuted": every d within the noise and within this much of zero
BINDS = 0.95  # a capped run binds where it ends within 5% of its cap
SCALES = (0.25, 0.5, 0.75)  # WiSE-FT's interpolations of a run (scale 1: the run itself)

# each preset's arms: a learning rate that reaches the caps, and the caps each arm runs at (the
# toy's by docs/size-study.md's rule); the OPD arms learn from the frontier's teacher (RL
# uncapped at the frontier's first rate)
SPECS = {
    "toy": dict(lrs={"sft": 6e-3, "rs-sft": 6e-3, "rl": 1e-3, "opd-student": 1e-2,
                     "opd-data": 1e-2},
                caps=(1.625, 3.25, 6.5, 13.0), arm_caps={"rl": (0.8125, 1.625)}),
    "toy-mini": dict(lrs={"sft": 1e-3, "rl": 1e-3, "opd-student": 1e-3, "opd-data": 1e-3},
                     caps=(0.02, 0.05), arm_caps={}),
}


def run_name(arm, cap, seed=0):
    return f"{arm}-cap{cap:g}" + (f"-seed{seed}" if seed else "")


def parse_name(name):
    """(arm, cap, seed) of a run_name, or None for another folder (the teacher's among them)."""
    m = re.fullmatch(r"([a-z-]+?)-cap([0-9.e+-]+?)(?:-seed(\d+))?", name)
    return (m[1], float(m[2]), int(m[3] or 0)) if m and m[1] in frontier.ARMS else None


def caps_of(arm, preset="toy"):
    spec = SPECS[preset]
    return spec["arm_caps"].get(arm, spec["caps"])


def runs_of(out, seed=0, preset="toy"):
    """name -> (script, arguments): the OPD arms' teacher first, then every arm at each of its
    caps with the frontier study's flags for its script and its own, all with the same seed."""
    spec, flags = SPECS[preset], frontier.SPECS[preset]
    teacher_lr = flags["lrs"][frontier.TEACHER_ARM][0]
    teacher = frontier.run_name(frontier.TEACHER_ARM, teacher_lr, seed)
    conditions = {teacher: ("rl", [*flags["flags"]["rl"], "--lr", str(teacher_lr),
                                   "--seed", str(seed)])}
    for arm, lr in spec["lrs"].items():
        script, own = frontier.ARMS[arm]
        arm_flags = [*flags["flags"][script], *own, *flags["arm_flags"].get(arm, []),
                     *(["--teacher", os.path.join(out, teacher)] if script == "opd" else [])]
        for cap in caps_of(arm, preset):
            conditions[run_name(arm, cap, seed)] = (
                script, [*arm_flags, "--max-update-norm", str(cap), "--lr", str(lr),
                         "--seed", str(seed)])
    return conditions


def interpolated(folder, scale):
    """Where the interpolation of the run in folder at this scale lies."""
    return os.path.join(folder, "interpolated", f"scale-{scale:g}")


def interpolate(folder, scale):
    """WiSE-FT's interpolation (arXiv 2109.01903) of the run in folder: its adapter with every B
    scaled, so that each layer's update and the update norm are scaled by `scale`, written in
    <folder>/interpolated/scale-<scale>, a finished run folder of its own that evaluate.py takes
    (its run.json the run's, with the scale). The folder."""
    from safetensors.torch import save_file
    out = interpolated(folder, scale)
    cfg, state = lora.read_adapter(folder)
    scaled = {k: v * scale if k.endswith(".lora_B.weight") else v for k, v in state.items()}
    os.makedirs(out, exist_ok=True)
    write_atomic(os.path.join(out, "adapter_model.safetensors"), lambda p: save_file(scaled, p))
    write_json(os.path.join(out, "adapter_config.json"), cfg)
    write_json(os.path.join(out, "run.json"), {**provenance.run_record(folder), "scale": scale})
    return out


def interpolations(out, conditions, preset="toy"):
    """The interpolations' folders of each arm's runs at its highest cap among conditions (run
    names), each written where not there yet: the curves beside the rule."""
    folders = []
    for name in conditions:
        parsed = parse_name(name)
        if parsed and parsed[1] == max(caps_of(parsed[0], preset)):
            for scale in SCALES:
                there = interpolated(os.path.join(out, name), scale)
                done = os.path.isfile(os.path.join(there, "run.json"))  # written last
                folders.append(there if done else interpolate(os.path.join(out, name), scale))
    return folders


@functools.lru_cache(maxsize=None)
def question_se(folder_a, folder_b):
    """The standard error of forgetting(a) - forgetting(b) from the retention questions alone:
    both answer the same questions, so per task the error of the mean of the per-question
    differences (evaluate.paired_stderr), the tasks' errors added in squares, over two tasks."""
    errors = evaluate.paired_stderr(evaluate.read_samples(folder_a),
                                    evaluate.read_samples(folder_b), folder_a)
    return math.sqrt(sum(e * e for e in errors.values())) / len(errors)


def least_forgetting(points, gain):
    """The point of least forgetting among those with at least this gain (None: none)."""
    reached = [p for p in points if p["gain"] >= gain]
    return min(reached, key=lambda p: p["forgetting"]) if reached else None


def compare(on, off):
    """One pair at one cap ({seed: points} each): over the gains both arms reach in every seed,
    (0, G] at frontier.GRID gains, d = forgetting(off) - forgetting(on) of each seed's
    least_forgetting points; its mean, each seed's, and a standard error that adds in squares
    the seeds' (their spread over sqrt(seeds)) and the questions' (question_se, root mean
    square over the seeds, not divided by them: every seed answers the same questions)."""
    seeds = sorted(set(on) & set(off))
    if not seeds:
        return dict(why="an arm has no points", grid=[])
    top = min(max(p["gain"] for p in arm[s]) for arm in (on, off) for s in seeds)
    if top < frontier.MIN_OVERLAP:
        return dict(seeds=len(seeds), top=top, grid=[],
                    why=f"the arms share gains up to {top:+.3f} only, under "
                        f"{frontier.MIN_OVERLAP}")
    grid = []
    for g in (top * i / frontier.GRID for i in range(1, frontier.GRID + 1)):
        chosen = [(least_forgetting(off[s], g), least_forgetting(on[s], g)) for s in seeds]
        d = [a["forgetting"] - b["forgetting"] for a, b in chosen]
        questions = math.sqrt(statistics.mean(question_se(a["path"], b["path"]) ** 2
                                              for a, b in chosen))
        spread = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
        grid.append(dict(gain=g, d=statistics.mean(d), per_seed=d,
                         se=math.hypot(spread, questions)))
    return dict(seeds=len(seeds), top=top, grid=grid)


def verdict(comparisons):
    """The rule's verdict from one pair's comparisons, one a cap in increasing order: not tested
    at fewer than DECIDING caps tested; supported where at the DECIDING highest caps tested d
    stands out (above two standard errors, every seed's above 0) at every matched gain; refuted
    where at every cap tested every d is within two standard errors and within BAND of zero;
    else undecided."""
    tested = [c for c in comparisons if c["grid"]]
    if len(tested) < DECIDING:
        return "not tested"
    if all(x["d"] > 2 * x["se"] and min(x["per_seed"]) > 0
           for c in tested[-DECIDING:] for x in c["grid"]):
        return "supported"
    if all(abs(x["d"]) <= 2 * x["se"] and abs(x["d"]) <= BAND for c in tested for x in c["grid"]):
        return "refuted"
    return "undecided"


def reading(root):
    """size.json's content: every point, the runs' ends, each pair at each cap and its verdict."""
    base, points = frontier.collect(root, parse_name, "cap")
    kept = [p for p in points if not p["degenerate"]]
    pairs = []
    for on, off in PAIRS:
        caps = sorted({p["cap"] for p in kept if p["arm"] == on} &
                      {p["cap"] for p in kept if p["arm"] == off})
        arms = {cap: frontier.by_arm([p for p in kept if p["cap"] == cap]) for cap in caps}
        at = [dict(cap=cap, **compare(arms[cap].get(on, {}), arms[cap].get(off, {})))
              for cap in caps]
        pairs.append(dict(on=on, off=off, caps=at, verdict=verdict(at)))
    return dict(points=[{k: v for k, v in p.items() if k != "path"} for p in points],
                ends=ends(points), pairs=pairs,
                curves=curve_rows(curves(points, base["gsm8k"]["flexible"])))


def curves(points, base_gsm8k):
    """Each interpolated run's curve, from scale 1/4 to its end (scale 1): arm, cap, seed and at
    each scale its update norm, gain and forgetting."""
    out = []
    for p in points:
        root = os.path.join(p["path"], "interpolated")  # a snapshot's path has none
        if not os.path.isdir(root):
            continue
        found = report.collect_runs(root)
        curve = [dict(scale=provenance.run_record(found[r["run"]]["folder"])["scale"],
                      update_norm=r["update_norm"], gain=r["gsm8k"] - base_gsm8k,
                      forgetting=r["forgetting"]) for r in report.table_rows(found)]
        curve.append(dict(scale=1.0, **{k: p[k] for k in ("update_norm", "gain", "forgetting")}))
        out.append(dict(run=p["run"], arm=p["arm"], cap=p["cap"], seed=p["seed"],
                        points=sorted(curve, key=lambda c: c["scale"])))
    return out


def curve_rows(curves):
    """Per (arm, scale), mean and standard deviation over seeds of norm, gain and forgetting."""
    groups = {}
    for c in curves:
        for x in c["points"]:
            groups.setdefault((c["arm"], c["cap"], x["scale"]), []).append(x)
    rows = []
    for (arm, cap, scale), xs in sorted(groups.items(), key=lambda kv: (
            list(frontier.ARMS).index(kv[0][0]), kv[0][2])):
        rows.append(dict(arm=arm, cap=cap, scale=scale, seeds=len(xs),
                         **{k: report.mean_sd([x[k] for x in xs])
                            for k in ("update_norm", "gain", "forgetting")}))
    return rows


def ends(points):
    """Per (arm, cap), the runs' last points over seeds (frontier.ends), with how many of them
    bind: end within 5% of the cap."""
    rows = frontier.ends(points, "cap")
    last = {p["run"]: p for p in sorted(points, key=lambda p: p["step"])}
    for row in rows:
        row["binds"] = sum(p["update_norm"] >= BINDS * row["cap"] for p in last.values()
                           if (p["arm"], p["cap"]) == (row["arm"], row["cap"]))
    return rows


def markdown(r):
    lines = ["# The size study", "", "The end of each run over seeds, mean±standard deviation "
             "(binds: runs that end within 5% of their cap):", "",
             "| arm | cap | seeds | binds | update norm | forgetting | GSM8K gain | degenerate |",
             "|---|---|---|---|---|---|---|---|"]
    for e in r["ends"]:
        cells = [report.fmt(e[k][0], spec, e[k][1]) for k, spec in
                 (("update_norm", ".2f"), ("forgetting", ".3f"), ("gain", ".3f"))]
        lines.append(f"| {e['arm']} | {e['cap']:g} | {e['seeds']} | {e['binds']} | "
                     f"{' | '.join(cells)} | {e['degenerate'] or ''} |")
    lines += ["", "Each pair at each cap, by the rule (d = forgetting of the off-policy arm minus "
              "the on-policy arm's at matched gain; its standard error covers the seeds' spread "
              "and the retention questions' noise):", ""]
    for c in r["pairs"]:
        lines.append(f"- **{c['on']} against {c['off']}: {c['verdict']}**")
        for at in c["caps"]:
            if not at["grid"]:
                lines.append(f"  - cap {at['cap']:g}: not tested ({at['why']})")
                continue
            grid = ", ".join(f"{x['d']:+.3f} ({x['se']:.3f})" for x in at["grid"])
            lines.append(f"  - cap {at['cap']:g}, gains {at['top'] / frontier.GRID:.3f} to "
                         f"{at['top']:.3f}, {at['seeds']} seed(s); d (standard error): {grid}")
    return "\n".join(lines + curve_lines(r["curves"])) + "\n"


def curve_lines(rows):
    if not rows:
        return []
    lines = ["", "Beside the rule, not a verdict: WiSE-FT's interpolation of each arm's run at its "
             "highest cap (its update scaled; evaluations only), mean±standard deviation over "
             "seeds:", "", "| arm | cap | scale | seeds | update norm | GSM8K gain | forgetting |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [report.fmt(row[k][0], spec, row[k][1]) for k, spec in
                 (("update_norm", ".2f"), ("gain", ".3f"), ("forgetting", ".3f"))]
        lines.append(f"| {row['arm']} | {row['cap']:g} | {row['scale']:g} | {row['seeds']} | "
                     f"{' | '.join(cells)} |")
    return lines


def plot(root, r):
    """size.png: forgetting and gain against update norm, every point, a colour an arm, the
    caps dotted; each arm's interpolation curve (mean over seeds) as a line."""
    plt = figures.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm in frontier.ARMS:
        pts = [p for p in r["points"] if p["arm"] == arm and p["forgetting"] is not None]
        curve = [c for c in r["curves"] if c["arm"] == arm]
        if not pts:
            continue
        for ax, key in zip(axes, ("forgetting", "gain")):
            dots, = ax.plot([p["update_norm"] for p in pts], [p[key] for p in pts], "o", ms=3,
                            alpha=0.5, label=arm)
            ax.plot([c["update_norm"][0] for c in curve], [c[key][0] for c in curve], "-",
                    color=dots.get_color())
    for ax in axes:
        for cap in sorted({p["cap"] for p in r["points"]}):
            ax.axvline(cap, color="grey", ls=":", lw=0.8)
    axes[0].set(xlabel="update norm (caps dotted)", ylabel="forgetting",
                title="forgetting at a capped update size")
    axes[1].set(xlabel="update norm (caps dotted)", ylabel="GSM8K gain over the base",
                title="lines: each arm's top run interpolated")
    axes[0].legend(fontsize=7)
    return figures.save(fig, os.path.join(root, "size.png"))


def write_report(root):
    """size.json, size.md and size.png in root; returns the markdown."""
    return frontier.report_files(root, "size", reading(root), markdown, plot)
