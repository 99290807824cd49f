#!/usr/bin/python3
"""Time validation of `loom plan` on this machine (issue 14).

1. For 15 attention configurations that a 2-core machine can time honestly (P <= 2 ranks,
   S 2048-16384, every strategy, fp32 and bf16), `loom attn --backward` is timed and
   `loom plan --simulate` predicts the forward + backward time from a profile of this machine
   calibrated by `loom plan --calibrate` (1 thread per rank, P ranks computing at once).
2. Load on a shared machine drifts within seconds, so each problem (a group of configurations
   with one calibration) runs in --rounds rounds: every round calibrates, then times each of the
   problem's configurations once (the median of --iters iterations of each pass), in an order
   rotated by the round. Each round's measurement is paired with the prediction from that
   round's own profile (taken seconds before, so both see the same load), and a configuration's
   error is the median over rounds of predicted / measured - 1: drift between rounds (the VM's
   speed moves by 20-30 % from minute to minute) cancels in each pair. The table also shows the
   median measurement and the prediction from the field-by-field median of the rounds'
   profiles, and that unpaired error.
3. Criteria: every prediction within 15 % of the measurement, median error <= 8 %, and for each
   problem timed with several strategies the planner's first choice (the fastest predicted)
   within 10 % of the fastest measured one. One PASS/FAIL line per criterion.
Prints a Markdown table (for docs/performance.md) and writes JSON with --json FILE.
Usage: /usr/bin/python3 bench/plan_validate.py [--loom build/loom] [--rounds 7] [--json out.json]
Takes about 4 minutes on a quiet 2-core machine (--rounds 7).
"""
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import validate_common

# (label, strategy, layout, ranks, degree, seq, heads, kv_heads, window, dtype); degree: the
# strategy's inner axis (hybrid: --ulysses, ring2d: --inner), 0 for none.
CONFIGS = [
    ("A", "ring", "zigzag", 2, 0, 4096, 2, 2, 0, "fp32"),
    ("A", "ring", "contiguous", 2, 0, 4096, 2, 2, 0, "fp32"),
    ("A", "ulysses", "zigzag", 2, 0, 4096, 2, 2, 0, "fp32"),
    ("A", "allgather", "zigzag", 2, 0, 4096, 2, 2, 0, "fp32"),
    ("A", "hybrid", "zigzag", 2, 2, 4096, 2, 2, 0, "fp32"),
    ("A", "ring2d", "zigzag", 2, 1, 4096, 2, 2, 0, "fp32"),
    ("B", "ring", "zigzag", 2, 0, 4096, 2, 2, 0, "bf16"),
    ("B", "ulysses", "zigzag", 2, 0, 4096, 2, 2, 0, "bf16"),
    ("B", "allgather", "zigzag", 2, 0, 4096, 2, 2, 0, "bf16"),
    ("C", "ring", "zigzag", 2, 0, 8192, 2, 1, 1024, "bf16"),
    ("C", "ulysses", "stripe", 2, 0, 8192, 2, 2, 1024, "bf16"),
    ("D", "ring", "zigzag", 2, 0, 16384, 2, 2, 512, "fp32"),
    ("D", "allgather", "contiguous", 2, 0, 16384, 2, 2, 512, "fp32"),
    ("E", "ring", "zigzag", 1, 0, 2048, 2, 2, 0, "fp32"),
    ("F", "ring", "zigzag", 1, 0, 2048, 2, 2, 0, "bf16"),
]
DEGREE_OPTION = {"hybrid": "--ulysses", "ring2d": "--inner"}


def run(cmd):
    return validate_common.run(cmd, "plan_validate")


def run_json(cmd, path, keys=()):
    """Runs cmd, which writes a JSON report at path, and returns it (one line and exit 1 when it
    does not: a --loom that is not loom)."""
    return validate_common.run_json(cmd, path, "plan_validate", keys)


def median_profile(profiles):
    """The field-by-field median of profiles (numbers and number arrays; the rest from the first)."""
    first = profiles[0]
    if isinstance(first, dict):
        return {k: (v if k == "sources" else median_profile([p[k] for p in profiles]))
                for k, v in first.items()}
    if isinstance(first, list):
        return [median_profile([p[i] for p in profiles]) for i in range(len(first))]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        m = statistics.median(profiles)
        return int(m) if isinstance(first, int) else m
    return first


def main():
    ap = validate_common.ArgumentParser()
    validate_common.add_loom_and_json(ap)
    ap.add_argument("--iters", type=validate_common.int_at_least(1), default=3,
                    help="timed iterations per run (median kept)")
    ap.add_argument("--rounds", type=validate_common.int_at_least(1), default=7,
                    help="calibrate-and-measure rounds (median)")
    a = ap.parse_args()
    validate_common.check_loom_and_json(ap, a)
    tmp = tempfile.mkdtemp(prefix="loom_plan_validate_")
    try:
        return validate(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the profiles and reports (once left behind)


def validate(a, tmp):
    t_start = time.time()
    loads = [validate_common.loadavg()]
    labels = sorted(set(c[0] for c in CONFIGS))
    rows, profiles = [], {}
    for label in labels:
        group = [c for c in CONFIGS if c[0] == label]
        P = group[0][3]
        samples = {i: [] for i in range(len(group))}
        round_profiles = []
        for rnd in range(a.rounds):
            pf = os.path.join(tmp, f"profile_{label}_{rnd}.json")
            round_profiles.append(run_json([a.loom, "plan", "--calibrate", pf, "--threads", "1",
                                            "--ranks-per-node", str(P)], pf))
            order = list(range(len(group)))
            order = order[rnd % len(order):] + order[:rnd % len(order)]
            for i in order:
                (_, strat, layout, _, U, S, H, HKV, W, dtype) = group[i]
                mj = os.path.join(tmp, "m.json")
                m = run_json([a.loom, "attn", "--quiet", "--backward", "--threads", "1", "--ranks",
                              str(P), "--iters", str(a.iters), "--warmup", "1", "--json", mj]
                             + args_of(group[i]), mj, ("forward_times_s", "backward_times_s"))
                # The median iteration of each pass (the calibration keeps the median of its
                # windows of calls, each about as long as one iteration here).
                samples[i].append(statistics.median(m["forward_times_s"]) +
                                  statistics.median(m["backward_times_s"]))
            loads.append(validate_common.loadavg())
        # Each round's prediction, from that round's profile (paired with its measurements).
        paired = {i: [] for i in range(len(group))}
        for rnd, rp in enumerate(round_profiles):
            pf = os.path.join(tmp, f"profile_{label}_{rnd}.json")
            for i, cfg in enumerate(group):
                paired[i].append(predict(a.loom, pf, P, cfg, tmp) / samples[i][rnd])
        merged = median_profile(round_profiles)
        pf = os.path.join(tmp, f"profile_{label}.json")
        with open(pf, "w") as f:
            json.dump(merged, f, indent=2)
        profiles[label] = merged
        for i, cfg in enumerate(group):
            (_, strat, layout, _, U, S, H, HKV, W, dtype) = cfg
            predicted = predict(a.loom, pf, P, cfg, tmp)
            measured = statistics.median(samples[i])
            spread = (max(samples[i]) - min(samples[i])) / measured
            err = statistics.median(paired[i]) - 1
            rows.append(dict(label=label, strategy=strat, layout=layout, ranks=P, degree=U, seq=S,
                             heads=H, kv_heads=HKV, window=W, dtype=dtype, measured_s=measured,
                             samples_s=samples[i], spread=spread, predicted_s=predicted,
                             round_ratios=paired[i], error=err,
                             unpaired_error=predicted / measured - 1))
            print(f"  {label} {strat:9s} {layout:10s} P={P} S={S:5d} W={W:4d} {dtype}: measured "
                  f"{measured*1e3:8.1f} ms (spread {100*spread:4.1f} %), predicted "
                  f"{predicted*1e3:8.1f} ms; paired error {100*err:+.1f} %", flush=True)
    elapsed = time.time() - t_start
    errs = [abs(r["error"]) for r in rows]
    worst, med = max(errs), statistics.median(errs)
    choices = []
    for label in labels:
        group = [r for r in rows if r["label"] == label]
        if len(group) < 2:
            continue
        pick = min(group, key=lambda r: r["predicted_s"])
        best = min(group, key=lambda r: r["measured_s"])
        choices.append(dict(label=label, pick=name_of(pick), fastest=name_of(best),
                            ratio=pick["measured_s"] / best["measured_s"]))
    print()
    print("| problem | strategy / layout | P | S | window | dtype | measured ms (spread) "
          "| predicted ms | unpaired error | paired error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {name_of(r)} | {r['ranks']} | {r['seq']} | {r['window']} | "
              f"{r['dtype']} | {r['measured_s']*1e3:.1f} ({100*r['spread']:.0f} %) | "
              f"{r['predicted_s']*1e3:.1f} | {100*r['unpaired_error']:+.1f} % | "
              f"{100*r['error']:+.1f} % |")
    print()
    print("| problem | planner's first choice | fastest measured | first choice / fastest |")
    print("|---|---|---|---|")
    for c in choices:
        print(f"| {c['label']} | {c['pick']} | {c['fastest']} | {c['ratio']:.3f} |")
    ok_worst, ok_med = worst <= 0.15, med <= 0.08
    ok_pick = all(c["ratio"] <= 1.10 for c in choices)
    n_pick = sum(c["ratio"] <= 1.10 for c in choices)
    print()
    print(f"{len(rows)} configurations, {a.rounds} rounds, {elapsed:.0f} s, load average "
          f"{min(loads):.1f}-{max(loads):.1f} (1-minute, sampled between rounds)")
    print(f"worst error {100*worst:.1f} % (<= 15 %): {'PASS' if ok_worst else 'FAIL'}")
    print(f"median error {100*med:.1f} % (<= 8 %): {'PASS' if ok_med else 'FAIL'}")
    un = [abs(r["unpaired_error"]) for r in rows]
    print(f"(unpaired, for comparison: worst {100*max(un):.1f} %, median "
          f"{100*statistics.median(un):.1f} %)")
    print(f"first choice within 10 % of the fastest measured in {n_pick} of {len(choices)} "
          f"problems: {'PASS' if ok_pick else 'FAIL'}")
    if a.json:
        validate_common.write_json(a.json, dict(rows=rows, choices=choices, worst=worst,
                                                median=med, rounds=a.rounds, seconds=elapsed,
                                                loadavg=loads, profiles=profiles))
    return 0 if (ok_worst and ok_med and ok_pick) else 1


def predict(loom, profile, ranks, cfg, tmp):
    """Predicted forward + backward seconds of cfg from a profile (loom plan --simulate)."""
    pj = os.path.join(tmp, "p.json")
    p = run_json([loom, "plan", "--simulate", "--profile", profile, "--ranks", str(ranks), "--json",
                  pj] + args_of(cfg), pj, ("forward_s", "backward_s"))
    return p["forward_s"] + p["backward_s"]


def args_of(cfg):
    (_, strat, layout, _, U, S, H, HKV, W, dtype) = cfg
    args = ["--strategy", strat, "--layout", layout, "--seq", str(S), "--heads", str(H),
            "--kv-heads", str(HKV), "--head-dim", "64", "--window", str(W), "--dtype", dtype]
    if U:
        args += [DEGREE_OPTION[strat], str(U)]
    return args


def name_of(r):
    opt = {"hybrid": " U=", "ring2d": " I="}.get(r["strategy"], "")
    return f"{r['strategy']} / {r['layout']}" + (f"{opt}{r['degree']}" if r["degree"] else "")


if __name__ == "__main__":
    sys.exit(main())
