"""
The study's figures, drawn where matplotlib is installed (it is optional, never required):
results.png, the frontier (target against retention, a marker per state source) and drift
against forgetting (P4), a point per run; curves.png, training curves of run folders, a
line per condition with its seeds' range as a band.

    python results.py --curves out/rl out/rl-seed1   # curves.png beside the first
"""
import os
import re
import statistics

import lora
from plumbing import runs
from plumbing.files import write_atomic


def pyplot():
    """matplotlib.pyplot when installed (it is optional, never required), else None and a note."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("note: no figures without matplotlib (pip install matplotlib)")
        return None


def save(fig, path, dpi=110):
    """Write fig to path whole or not at all, and let it go."""
    fig.tight_layout()
    write_atomic(path, lambda p: fig.savefig(p, dpi=dpi, format="png"))
    pyplot().close(fig)
    return path


def state_source(run_name):
    """Where a condition's training states come from: the dataset's (data), the teacher's, the
    learner's own (student)."""
    c = runs.condition(run_name)  # the main study's conditions, or the frontier study's arms
    if c in ("mild", "stress", "degraded") or c.startswith(("sft-", "opd-data-")):
        return "data"
    if c.startswith("kd-"):
        return "teacher"
    return "student" if c.startswith(("opd", "rl", "rs-sft-")) else "other"


def plot(out, rows):
    """results.png, a point per run: the frontier (target against retention, a marker per state
    source), and drift against forgetting (P4)."""
    plt = pyplot()
    if plt is None:
        return
    points = [r for r in rows if r["run"] != "base" and r["gsm8k"] is not None
              and r["retention"] is not None]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    markers = {"data": "s", "student": "o", "teacher": "^", "other": "x"}
    for source, marker in markers.items():
        mine = [r for r in points if state_source(r["run"]) == source]
        if mine:
            a.scatter([r["retention"] for r in mine], [r["gsm8k"] for r in mine], marker=marker,
                      label=f"{source} states")
    for r in points:
        a.annotate(runs.condition(r["run"]), (r["retention"], r["gsm8k"]), fontsize=7)
        if r["mmd2"] is not None and r["forgetting"] is not None:
            b.errorbar(r["mmd2"], r["forgetting"], yerr=r["forgetting_stderr"], fmt="o", capsize=3)
            b.annotate(runs.condition(r["run"]), (r["mmd2"], r["forgetting"]), fontsize=7)
    if points:
        a.legend(fontsize=7)
    a.set(xlabel="mean retention ratio", ylabel="GSM8K accuracy",
          title="the frontier: target against retention")
    b.set(xlabel="MMD^2 of rollout states", ylabel="mean forgetting (bars: one standard error)",
          title="drift against forgetting (P4)")
    save(fig, os.path.join(out, "results.png"), dpi=120)


CURVES = (("loss", "loss"), ("reward", "training reward"),
          ("state_nll_base", "state NLL under the base"), ("state_kl", "KL to the teacher"),
          ("kl", "KL to the base (k3)"), ("lr", "learning rate"))


def curve(logs, key, window=1):
    """One condition's curve of `key` over its seeds' logs: (steps every log has, mean, lowest,
    highest), each value first a running mean over `window` steps of its own log."""
    series = []
    for records in logs:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        series.append({step: statistics.mean(v for _, v in points[max(0, i - window + 1):i + 1])
                       for i, (step, _) in enumerate(points)})
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    values = [[s[t] for s in series] for t in steps]
    return (steps, [statistics.mean(v) for v in values], [min(v) for v in values],
            [max(v) for v in values])


def curves(folders, path):
    """Training curves of run folders, one line per condition (its seeds' mean, their range as a
    band), a panel per quantity of CURVES (log key, title) a log holds, each a running mean over a
    twentieth of the run, and the update norm at each snapshot a run kept. Returns path, or None."""
    logs = {}
    for folder in folders:
        if os.path.isfile(os.path.join(folder, "log.jsonl")):
            name = runs.condition(os.path.basename(os.path.normpath(folder)))
            logs.setdefault(name, []).append(
                (folder, runs.read_log(os.path.join(folder, "log.jsonl"))))
    records = [r for ms in logs.values() for _, rs in ms for r in rs]
    keys = [(k, title) for k, title in CURVES if any(k in r for r in records)]
    snapshots = {f: sorted(os.listdir(os.path.join(f, "snapshots"))) for ms in logs.values()
                 for f, _ in ms if os.path.isdir(os.path.join(f, "snapshots"))}
    if not keys or (plt := pyplot()) is None:
        return None
    panels = len(keys) + bool(snapshots)
    fig, axes = plt.subplots(1, panels, figsize=(3.6 * panels, 3.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], keys):
        for name, members in logs.items():
            window = max(1, len(members[0][1]) // 20)
            steps, mean, low, high = curve([rs for _, rs in members], key, window)
            line, = ax.plot(steps, mean, label=name, linewidth=1)
            if len(members) > 1:
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
        ax.set(xlabel="step", title=title)
    for folder, names in snapshots.items():  # how far the weights moved, along the run
        steps = [int(n.split("-")[1]) for n in names if re.fullmatch(r"step-\d+", n)]
        norms = [lora.update_norm(os.path.join(folder, "snapshots", f"step-{t:06d}"))
                 for t in steps]
        axes[0][-1].plot(steps, norms, marker="o", label=os.path.basename(os.path.normpath(folder)))
        axes[0][-1].set(xlabel="step", title="update norm at snapshots")
    axes[0][0].legend(fontsize=7)
    save(fig, path, dpi=100)
    return path


