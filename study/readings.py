"""The study's readings: each prediction of the paper read from the table by the rule written
before the runs (docs/toy-study.md, "Reading rules"), so that a study run on another machine,
whose numbers differ, is read by the same rules. results.md ends with them.

A difference between two conditions *stands out* when it exceeds two standard errors of a
difference over seeds, 2 sqrt(s_A^2/k_A + s_B^2/k_B); a gain over the base adds the base's
question noise instead of its seeds', 2 sqrt(b(1 - b)/n + s^2/k) with n test questions. Each
prediction's precondition (C1 to C4) is measured first; where it fails the prediction is "not
tested here", whatever its numbers say.
"""
import math

MATCHED_NORMS = 1.25  # "matched update norms": the larger at most 25% above the smaller
OFF_POLICY_GAP = 0.3  # C1: SFT's state distance, nats per token off the base's own samples
SIGNAL_PAIRS = (("stress", "opd-stress", "kd-stress"), ("degraded", "opd-degraded", "kd-degraded"))
METRICS = ("gsm8k", "forgetting", "retention", "update_norm", "state_distance")


def conditions(grouped):
    """condition -> metric -> (mean, standard deviation, seeds that have it), from the rows of
    report.group_seeds (the base left out). A metric fewer than two seeds have is left out:
    it has no spread to read a difference against, and a rule that needs it is not read."""
    return {r["run"]: {k: (r[k], r[k + "_std"], r[k + "_n"]) for k in METRICS
                       if (r.get(k + "_n") or 0) >= 2} for r in grouped if r["run"] != "base"}


def difference(c, a, b, metric):
    """(mean of a - mean of b, two standard errors of the difference over seeds)."""
    (ma, sa, ka), (mb, sb, kb) = c[a][metric], c[b][metric]
    return ma - mb, 2 * math.sqrt(sa ** 2 / ka + sb ** 2 / kb)


def above(c, a, b, metric):
    """Whether a's metric stands out above b's."""
    d, noise = difference(c, a, b, metric)
    return d > noise


def gain(c, name, base, n):
    """(gain on the target over the base, its two standard errors)."""
    m, s, k = c[name]["gsm8k"]
    return m - base, 2 * math.sqrt(base * (1 - base) / n + s ** 2 / k)


def matched(c, a, b):
    x, y = c[a]["update_norm"][0], c[b]["update_norm"][0]
    return max(x, y) <= MATCHED_NORMS * min(x, y)


def has(c, names, metrics=("gsm8k", "forgetting", "retention", "update_norm")):
    return all(n in c and all(m in c[n] for m in metrics) for n in names)


def p1(c):
    """P1, strong off-policy SFT pressure causes forgetting, given C1: mild and stress SFT's
    state distance at least OFF_POLICY_GAP."""
    if not has(c, ("stress", "mild")):
        return None
    sd = [c[n].get("state_distance", (None,))[0] for n in ("mild", "stress")]
    if None in sd:
        return "not tested here (C1 not measured: SFT's state distance needs drift.json)"
    if min(sd) < OFF_POLICY_GAP:
        return "not tested here (C1 fails: SFT's data is not off-policy for the base)"
    others = [n for n in ("rl", "opd-mild", "opd-stress") if n in c]
    if not others:  # all() of no comparison would read "shows"
        return "not tested here (no on-policy run, rl, opd-mild or opd-stress, to compare with)"
    if not above(c, "stress", "mild", "forgetting"):
        return "refuted (stress SFT's forgetting does not stand out above mild SFT's)"
    if all(above(c, "stress", n, "forgetting") for n in others):
        return f"shows (stress SFT forgets more than mild SFT and {', '.join(others)})"
    return "mixed (above mild SFT's, not above every on-policy run's)"


def p2(c):
    """P2, on-policy methods stay local, given C4: OPD on the student's states against the
    same teacher and signal on the teacher's (kd-stress)."""
    if not has(c, ("opd-stress", "kd-stress"), ("forgetting", "update_norm", "state_distance")):
        return None
    farther = c["kd-stress"]["state_distance"][0] - c["opd-stress"]["state_distance"][0]
    if farther < 0.1 or not matched(c, "kd-stress", "opd-stress"):
        return ("not tested here (C4 fails: kd-stress's states are not 0.1 farther from the "
                "base's than opd-stress's at matched update norms)")
    if above(c, "kd-stress", "opd-stress", "forgetting"):
        return "supported (kd-stress forgets more than opd-stress)"
    return "refuted (kd-stress does not forget more than opd-stress)"


def p3(c, base, n, teacher, student, control):
    """P3, an OPD student can beat a degraded teacher, given C3; and whether the win is owed
    to the student's states (the control: the same teacher and signal on the teacher's)."""
    if not has(c, (teacher, student, control)):
        return None
    g, noise = gain(c, teacher, base, n)
    if g >= -noise:
        return f"not tested here (C3 fails: {teacher} is not below the base on the target)"
    beats = above(c, student, teacher, "gsm8k") or (
        above(c, student, teacher, "retention") and not above(c, teacher, student, "gsm8k"))
    if not beats:
        return f"{student} does not beat its teacher"
    if not matched(c, student, control):  # a larger update could win whatever its states
        return (f"{student} beats its teacher; whether by its states is not tested here (its "
                f"update norm and {control}'s are not matched)")
    if any(above(c, student, control, m) for m in ("gsm8k", "retention")):
        return f"{student} beats its teacher, owed to the student's states (beyond {control})"
    return (f"{student} beats its teacher, not by its states: {control} does as well "
            f"(distillation from that teacher helps whatever the states)")


def p4(predictors):
    """P4, a scalar drift number does not explain forgetting by itself: MMD^2 over the runs."""
    fit = (predictors or {}).get("mmd2", {}).get("runs")
    if not fit:
        return None
    r2, p = fit["pearson"] ** 2, fit["spearman_p"]
    if r2 < 0.5 or p > 0.05:
        return f"supported (MMD^2's R^2 with forgetting {r2:.2f}, Spearman's p {p:.3f})"
    if r2 >= 0.8 and p < 0.01:
        return f"refuted (MMD^2's R^2 with forgetting {r2:.2f}, Spearman's p {p:.3f})"
    return f"undecided (MMD^2's R^2 with forgetting {r2:.2f}, Spearman's p {p:.3f})"


def readings_lines(grouped, predictors, n_questions):
    """results.md's readings from report.group_seeds' rows: each prediction by its rule, then
    each condition's gain on the target against its noise. The rules read a spread over seeds:
    with one, a line says so."""
    c = conditions(grouped)
    base = next((r["gsm8k"] for r in grouped if r["run"] == "base"), None)
    if not c or base is None or not any(name in c for name, _, _ in SIGNAL_PAIRS):
        return []
    if min(r["seeds"] for r in grouped if r["run"] != "base") < 2:
        return ["", "The readings by the rules written before the runs (readings.py) compare "
                    "conditions against their spread over seeds: run `python reproduce.py "
                    "--seeds 3` for them."]
    verdicts = [("P1, strong off-policy SFT pressure causes forgetting", p1(c)),
                ("P2, on-policy methods stay local", p2(c))]
    verdicts += [(f"P3 with {t}, an OPD student can beat a degraded teacher",
                  p3(c, base, n_questions, t, s, k)) for t, s, k in SIGNAL_PAIRS]
    verdicts.append(("P4, a scalar drift number does not explain forgetting", p4(predictors)))
    verdicts = [(name, v) for name, v in verdicts if v is not None]
    if not verdicts:  # a teacher run without the conditions any rule reads
        return []
    lines = ["", "Readings by the rules written before the runs (docs/toy-study.md): a "
                 "difference stands out beyond two standard errors over seeds (the seeds' "
                 "spread alone: every seed answers the same questions, so their noise is not "
                 "in it).", ""]
    lines += [f"- {name}: {v}." for name, v in verdicts]
    gains = []
    for name in c:
        if "gsm8k" in c[name]:
            g, noise = gain(c, name, base, n_questions)
            gains.append(f"{name} {g:+.3f}{' (stands out)' if abs(g) > noise else ''} "
                         f"against {noise:.3f}")
    return lines + ["", f"The target over the base's {base:.3f} ({n_questions} questions), each "
                        f"gain against its two standard errors (the base's question noise and "
                        f"the run's seeds' spread): {'; '.join(gains)}."]
