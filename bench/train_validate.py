#!/usr/bin/python3
"""Time validation of `loom plan --train-step` against `loom train` on this machine (issue 14).

`loom plan --train-step` measures one rank of the model here (dp = tp = cp = 1) and predicts the
step time of other meshes from it, the calibrated profile (the simulator's attention, the
node's contention, the local backend's links) and the mesh's collectives. This script checks
those predictions against `loom train` runs of the same model on three meshes of two ranks
(ring cp 2, tp 2, dp 2) and Ulysses cp 2:

1. Load on a shared machine drifts within seconds, so the work runs in --rounds rounds. Every
   round calibrates a profile (`loom plan --calibrate`, 2 ranks per node), predicts every mesh
   (`loom plan --train-step`, which measures one rank first), then runs `loom train` on each mesh
   (--steps steps; the median step after the first two, from --log) in an order rotated by the
   round.
2. Each round's measurement is paired with that round's prediction (made seconds before, so
   both see the same load), and a mesh's error is the median over rounds of predicted /
   measured - 1; the table also shows the median measurement, the median prediction and that
   unpaired error.
3. Criterion (issue 14): every prediction within 20 % of its measurement. One PASS/FAIL line.
Prints a Markdown table (for docs/performance.md) and writes JSON with --json FILE.
Usage: /usr/bin/python3 bench/train_validate.py [--loom build/loom] [--rounds 7] [--json out.json]
       [--data data/kjv.txt]
--data is the text `loom train` trains on (default: the repository's data/kjv.txt, written by
scripts/setup.sh, wherever the script is run from; it was loom's default, relative to the
current directory, so a run from elsewhere failed after the first calibration), checked first.
Takes about 1.5 minutes on a quiet 2-core machine (--rounds 7).
"""
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import validate_common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The model: loom train options, and the same as loom plan --model layers,dim,heads,kv,ffn,vocab.
LAYERS, DIM, HEADS, KV, FFN, SEQ, BATCH = 2, 128, 4, 2, 512, 1024, 2
# (label, dp, tp, ulysses, ring)
MESHES = [
    ("ring cp 2", 1, 1, 1, 2),
    ("tp 2", 1, 2, 1, 1),
    ("dp 2", 2, 1, 1, 1),
    ("ulysses cp 2", 1, 1, 2, 1),
]


def run(cmd):
    return validate_common.run(cmd, "train_validate")


def run_json(cmd, path, keys=()):
    """Runs cmd, which writes a JSON report at path, and returns it (one line and exit 1 when it
    does not: a --loom that is not loom)."""
    return validate_common.run_json(cmd, path, "train_validate", keys)


def step_seconds(cmd, log):
    """The per-step seconds of the `loom train` log cmd wrote, at least 3 of them (one line and
    exit 1 without)."""
    if os.path.lexists(log):
        os.remove(log)
    run(cmd)
    try:
        with open(log) as f:
            steps = [json.loads(line)["seconds"] for line in f]
        if len(steps) < 3 or not all(isinstance(x, (int, float)) for x in steps):
            raise ValueError(f"{len(steps)} step times, want numbers for at least 3")
        return steps
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"train_validate: `{' '.join(cmd)}` exited 0 but {log} is not its step log "
                 f"({e}); is --loom {cmd[0]} the loom command?")


def main():
    ap = validate_common.ArgumentParser()
    validate_common.add_loom_and_json(ap)
    ap.add_argument("--rounds", type=validate_common.int_at_least(1), default=7,
                    help="calibrate-predict-measure rounds")
    ap.add_argument("--steps", type=validate_common.int_at_least(3), default=8,
                    help="loom train steps per run (the first two are not timed)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "kjv.txt"),
                    help="the text loom train trains on (default: the repository's data/kjv.txt)")
    a = ap.parse_args()
    validate_common.check_loom_and_json(ap, a, [("--data", a.data)])
    if not os.path.isfile(a.data) or not os.access(a.data, os.R_OK):
        ap.error(f"--data {a.data}: no readable file (scripts/setup.sh writes data/kjv.txt)")
    tmp = tempfile.mkdtemp(prefix="loom_train_validate_")
    try:
        return validate(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the profiles and logs (once left behind)


def validate(a, tmp):
    t0 = time.time()
    loads = [validate_common.loadavg()]
    model = ["--layers", str(LAYERS), "--dim", str(DIM), "--heads", str(HEADS),
             "--kv-heads", str(KV), "--ffn", str(FFN), "--seq", str(SEQ), "--batch", str(BATCH),
             "--dtype", a.dtype]
    measured = {m[0]: [] for m in MESHES}
    predicted = {m[0]: [] for m in MESHES}
    one_rank = []
    for rnd in range(a.rounds):
        pf = os.path.join(tmp, f"profile_{rnd}.json")
        run_json([a.loom, "plan", "--calibrate", pf, "--threads", "1", "--ranks-per-node", "2"], pf)
        pj = os.path.join(tmp, "predict.json")
        cmd = [a.loom, "plan", "--train-step", "--profile", pf, "--model",
               f"{LAYERS},{DIM},{HEADS},{KV},{FFN},256", "--seq", str(SEQ), "--batch",
               str(BATCH), "--dtype", a.dtype, "--json", pj]
        for (_, dp, tp, u, r) in MESHES:
            cmd += ["--mesh", f"{dp},{tp},{u},{r}"]
        p = run_json(cmd, pj, ("one_rank", "meshes"))
        if not isinstance(p["meshes"], list) or len(p["meshes"]) != len(MESHES) or not all(
                isinstance(m, dict) and isinstance(m.get("step_s"), (int, float))
                for m in p["meshes"]):
            sys.exit(f"train_validate: `{' '.join(cmd)}` predicted {p['meshes']!r}, not one "
                     f"step per mesh ({len(MESHES)})")
        one_rank.append(p["one_rank"])
        for (label, *_), pm in zip(MESHES, p["meshes"]):
            predicted[label].append(pm["step_s"])
        order = MESHES[rnd % len(MESHES):] + MESHES[:rnd % len(MESHES)]
        for (label, dp, tp, u, r) in order:
            log = os.path.join(tmp, "steps.jsonl")
            steps = step_seconds([a.loom, "train", "--ranks", str(dp * tp * u * r), "--dp",
                                  str(dp), "--tp", str(tp), "--ulysses", str(u), "--ring", str(r),
                                  "--steps", str(a.steps), "--eval-every", "0", "--quiet",
                                  "--data", a.data, "--log", log] + model, log)[2:]
            measured[label].append(statistics.median(steps))
        loads.append(validate_common.loadavg())
        print(f"  round {rnd + 1}: " + ", ".join(
            f"{lbl} {measured[lbl][-1]*1e3:.0f} / {predicted[lbl][-1]*1e3:.0f} ms"
            for lbl in measured), flush=True)
    rows = []
    for (label, dp, tp, u, r) in MESHES:
        m, pr = statistics.median(measured[label]), statistics.median(predicted[label])
        spread = (max(measured[label]) - min(measured[label])) / m
        paired = [x / y for x, y in zip(predicted[label], measured[label])]
        rows.append(dict(mesh=label, dp=dp, tp=tp, ulysses=u, ring=r, measured_s=m,
                         samples_s=measured[label], spread=spread, predicted_s=pr,
                         predictions_s=predicted[label], round_ratios=paired,
                         error=statistics.median(paired) - 1, unpaired_error=pr / m - 1))
    elapsed = time.time() - t0
    print()
    print(f"Model layers={LAYERS} dim={DIM} heads={HEADS} kv-heads={KV} ffn={FFN}, seq {SEQ}, "
          f"batch {BATCH}, {a.dtype}, 1 thread per rank, local backend")
    print()
    print("| mesh | dp | tp | ulysses | ring | measured ms per step (spread) | predicted ms | "
          "unpaired error | paired error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['mesh']} | {x['dp']} | {x['tp']} | {x['ulysses']} | {x['ring']} | "
              f"{x['measured_s']*1e3:.1f} ({100*x['spread']:.0f} %) | {x['predicted_s']*1e3:.1f} | "
              f"{100*x['unpaired_error']:+.1f} % | {100*x['error']:+.1f} % |")
    worst = max(abs(x["error"]) for x in rows)
    ok = worst <= 0.20
    print()
    print(f"{len(rows)} meshes, {a.rounds} rounds, {elapsed:.0f} s, load average "
          f"{min(loads):.1f}-{max(loads):.1f} (1-minute, sampled between rounds)")
    print(f"worst error {100*worst:.1f} % (<= 20 %): {'PASS' if ok else 'FAIL'}")
    if a.json:
        validate_common.write_json(a.json, dict(rows=rows, one_rank=one_rank, worst=worst,
                                                rounds=a.rounds, seconds=elapsed, loadavg=loads))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
