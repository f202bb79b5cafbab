#!/usr/bin/env python3
"""libfsdp against PyTorch's own FSDP2 and DDP, side by side, in one table.

For every model, world size and parameter dtype asked for, the runner launches
`fsdp-bench train` (libfsdp, built against the same pip LibTorch as the peer)
and torch_fsdp2.py (PyTorch FSDP2 / DDP on gloo) under the same mpiexec, the
same ranks, threads per rank, model, seed, data and AdamW. The two programs
cannot share a process, so noise is spread twice: inside a launch each
program runs its configs interleaved step by step, and each round runs both
launches (odd rounds in reverse order). A config's step time is the median
over rounds of its per-launch median (the slowest rank's step, as both
programs measure it).

    compare.py --fsdp-bench build-torch2/bench/tools/fsdp-bench/fsdp-bench \\
               --np 2,4 --dtypes float32,bfloat16 --rounds 3 --json out.json

Targets (summary lines; the issue "Performance against the real peer"):
libfsdp fsdp step <= 0.90x torch-fsdp2's and <= torch-ddp's, hsdp <= 0.90x
torch-hsdp's, peak bytes per rank <= torch-fsdp2's, at world size 1 the
fsdp step <= 1.03x the plain LibTorch step (libfsdp's `single`), and
persistent bytes per rank within 2% of single/N. --plot writes the scaling
plot with gnuplot.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 1024.0 * 1024.0

MODELS = {
    # The test plan's decoder (models::DecoderConfig's defaults).
    "plan": {},
    # Hidden 512 (3.7x the parameters per layer: 13.4M in all, against the
    # plan's 3.5M), small enough to time on a 2-core machine.
    "large": {"hidden": 512},
}

STEP_TARGET_FSDP2 = 0.90
STEP_TARGET_DDP = 1.00
WORLD1_TARGET = 1.03
PERSISTENT_TARGET = 1.02


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fsdp-bench", required=True, type=Path,
                   help="fsdp-bench built against the pip LibTorch the peer imports")
    p.add_argument("--python", default=sys.executable,
                   help="Python with that torch (default: this one)")
    p.add_argument("--np", default="2,4",
                   help="world sizes, comma-separated (default 2,4)")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="param dtypes of the FSDP configs: float32, bfloat16")
    p.add_argument("--models", default="plan",
                   help=f"models, comma-separated: {', '.join(MODELS)} (default plan)")
    p.add_argument("--rounds", type=int, default=3, help="launches per program and point")
    p.add_argument("--steps", type=int, default=10, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per launch")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--libfsdp-configs", default="single,ddp,fsdp,hsdp",
                   help="fsdp-bench train --configs (hsdp only where the world fits)")
    p.add_argument("--peer-configs", default="torch-ddp,torch-fsdp2,torch-hsdp",
                   help="torch_fsdp2.py --config (torch-hsdp only where the world fits)")
    p.add_argument("--mpiexec", default="mpiexec")
    p.add_argument("--mpiexec-args", default="",
                   help="extra mpiexec arguments (e.g. Open MPI --mca settings)")
    p.add_argument("--launcher", default="",
                   help="a command that starts the job itself instead of mpiexec -n N (e.g. "
                        "'ci/cluster/fsdp-cluster --nodes 2 --ranks-per-node 2 --net netns "
                        "--rate 10gbit --': the simulated cluster); its rank count must be "
                        "the single --np; --mpiexec-args follow it")
    p.add_argument("--json", type=Path, help="write every launch's rows and the summary")
    p.add_argument("--plot", type=Path,
                   help="scaling plot (PNG, gnuplot): step time and peak / persistent bytes "
                        "per rank against the world size")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    a = p.parse_args(argv)
    try:
        a.np = [int(x) for x in a.np.split(",")]
    except ValueError:
        p.error(f"--np {a.np}: expected comma-separated positive integers")
    if not a.np or min(a.np) < 1:
        p.error(f"--np {a.np}: expected positive integers")
    a.dtypes = a.dtypes.split(",")
    for d in a.dtypes:
        if d not in ("float32", "bfloat16"):
            p.error(f"--dtypes {d}: accepted: float32, bfloat16")
    a.models = a.models.split(",")
    for m in a.models:
        if m not in MODELS:
            p.error(f"--models {m}: accepted: {', '.join(MODELS)}")
    for name in ("rounds", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} {getattr(a, name)}: expected >= 1")
    if not os.access(a.fsdp_bench, os.X_OK):
        p.error(f"--fsdp-bench {a.fsdp_bench}: not an executable file")
    if a.launcher and len(a.np) != 1:
        p.error(f"--launcher starts its own rank count: give one --np (got {a.np})")
    if a.plot and shutil.which("gnuplot") is None:
        p.error("--plot needs gnuplot on PATH (Debian: gnuplot-nox)")
    return a


def mpiexec(args, n):
    if args.launcher:
        return args.launcher.split() + args.mpiexec_args.split()
    cmd = [args.mpiexec, "-n", str(n)]
    if n > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    cmd += args.mpiexec_args.split()
    return cmd


def launch(args, n, program, out_json, port):
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["MASTER_PORT"] = str(port)
    cmd = mpiexec(args, n) + program + ["--json", str(out_json)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"compare.py: {' '.join(cmd)} exited with {done.returncode}")
    with open(out_json) as f:
        return json.load(f)


def model_flags(model):
    flags = []
    for k, v in MODELS[model].items():
        flags += [f"--{k}", str(v)]
    return flags


def launches_for(args, model, n, dtype):
    """(program, argv) pairs of one round at one point."""
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup),
              "--batch", str(args.batch)] + model_flags(model)
    hsdp_fits = n >= 4 and n % 2 == 0
    lib = [c for c in args.libfsdp_configs.split(",")
           if (c != "ddp" or n > 1) and (c != "hsdp" or hsdp_fits)]
    out = [("libfsdp", [str(args.fsdp_bench), "train", "--configs", ",".join(lib),
                        "--param-dtype", dtype] + common)]
    peer = [c for c in args.peer_configs.split(",")
            if (c != "torch-hsdp" or hsdp_fits) and (c != "torch-ddp" or n > 1)]
    if peer:
        out.append(("peer", [args.python, str(HERE / "torch_fsdp2.py"), "--config",
                             ",".join(peer), "--param-dtype", dtype] + common))
    return out


def collect(args):
    """{(model, np, dtype): {config: [row per round]}} and the metas."""
    results, metas = {}, {}
    port = 29600
    with tempfile.TemporaryDirectory(prefix="fsdp-compare-") as tmp:
        for model in args.models:
            for n in args.np:
                for dtype in args.dtypes:
                    point = (model, n, dtype)
                    rows = results.setdefault(point, {})
                    runs = launches_for(args, model, n, dtype)
                    for r in range(args.rounds):
                        order = runs if r % 2 == 0 else list(reversed(runs))
                        for name, program in order:
                            port += 1
                            doc = launch(args, n, program, Path(tmp) / "out.json", port)
                            metas.setdefault(name, doc.get("meta", {}))
                            for row in doc["rows"]:
                                key = row["config"]
                                if name == "peer" and not key.startswith("torch-"):
                                    key = "torch-" + key  # the peer's single
                                rows.setdefault(key, []).append(row)
                        print(f"# {model} np {n} {dtype}: round {r + 1}/{args.rounds} done",
                              file=sys.stderr, flush=True)
    return results, metas


def summarize(rows):
    """One config's rows over rounds -> the numbers the table shows."""
    def med(key):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None
    return {
        "step_ms": med("step_ms"),
        "step_min_ms": min(r["step_min_ms"] for r in rows),
        "round_medians_ms": [r["step_ms"] for r in rows],
        "persistent_bytes": med("persistent_bytes"),
        "peak_bytes": med("peak_bytes"),
        "collectives_per_step": rows[-1].get("collectives_per_step", "-"),
        "final_loss": rows[-1].get("final_loss"),
    }


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def report(args, results):
    points = []
    targets = []
    header = (f"{'model':>6} {'np':>3} {'dtype':>9} {'config':>12} {'median':>8} {'min':>8} "
              f"{'vs fsdp2':>8} {'vs tddp':>8} {'persist':>8} {'peak':>8} {'peak vs':>8} "
              f"{'AG/RS/AR':>10} {'loss':>9}")
    units = (f"{'':>6} {'':>3} {'':>9} {'':>12} {'(ms)':>8} {'(ms)':>8} {'(x)':>8} {'(x)':>8} "
             f"{'(MiB)':>8} {'(MiB)':>8} {'fsdp2':>8} {'per step':>10} {'':>9}")
    print("# libfsdp (fsdp-bench train) and PyTorch (torch_fsdp2.py) on the same pip LibTorch;"
          " step = slowest rank, median over rounds of each launch's median")
    print("# vs fsdp2 / vs tddp: step time over torch-fsdp2's (torch-hsdp's for hsdp, "
          "torch-fsdp2-hpz's for fsdp-hpz) / "
          "torch-ddp's at the same point; peak vs fsdp2: peak bytes per rank over the same peer's")
    print("#" + header[1:])
    print("#" + units[1:])
    for (model, n, dtype), configs in results.items():
        s = {c: summarize(rows) for c, rows in configs.items()}
        fsdp2 = s.get("torch-fsdp2", {})
        tddp = s.get("torch-ddp", {})
        for c, v in s.items():
            peer = (s.get("torch-hsdp", {}) if c == "hsdp" else
                    s.get("torch-fsdp2-hpz", {}) if c == "fsdp-hpz" else fsdp2)
            vs_fsdp2 = ratio(v["step_ms"], peer.get("step_ms"))
            vs_ddp = ratio(v["step_ms"], tddp.get("step_ms"))
            peak_vs = ratio(v["peak_bytes"], peer.get("peak_bytes"))
            print(f"  {model:>5} {n:>3} {dtype:>9} {c:>12} {fmt(v['step_ms'], '.1f'):>8} "
                  f"{fmt(v['step_min_ms'], '.1f'):>8} {fmt(vs_fsdp2, '.3f'):>8} "
                  f"{fmt(vs_ddp, '.3f'):>8} "
                  f"{fmt(v['persistent_bytes'] and v['persistent_bytes'] / MIB, '.2f'):>8} "
                  f"{fmt(v['peak_bytes'] and v['peak_bytes'] / MIB, '.2f'):>8} "
                  f"{fmt(peak_vs, '.3f'):>8} {v['collectives_per_step']:>10} "
                  f"{fmt(v['final_loss'], '.5f'):>9}")
            points.append({"model": model, "np": n, "dtype": dtype, "config": c,
                           "vs_peer_fsdp": vs_fsdp2, "vs_torch_ddp": vs_ddp,
                           "peak_vs_torch_fsdp2": peak_vs, **v})
        targets += point_targets(model, n, dtype, s)
    for t in targets:
        print(f"# target {t['what']}: {fmt(t['value'], '.3f')}x (<= {t['limit']:.2f}x) -> "
              f"{'n/a' if t['value'] is None else ('MET' if t['met'] else 'NOT MET')}")
    return points, targets


def point_targets(model, n, dtype, s):
    out = []

    def target(what, value, limit):
        out.append({"model": model, "np": n, "dtype": dtype, "what":
                    f"{model} np {n} {dtype}: {what}", "value": value, "limit": limit,
                    "met": None if value is None else value <= limit})

    def step(c):
        return s.get(c, {}).get("step_ms")

    if n == 1:
        target("fsdp step vs plain LibTorch (single)", ratio(step("fsdp"), step("single")),
               WORLD1_TARGET)
        return out
    target("fsdp step vs torch-fsdp2", ratio(step("fsdp"), step("torch-fsdp2")),
           STEP_TARGET_FSDP2)
    target("fsdp step vs torch-ddp", ratio(step("fsdp"), step("torch-ddp")), STEP_TARGET_DDP)
    if "hsdp" in s:
        target("hsdp step vs torch-hsdp", ratio(step("hsdp"), step("torch-hsdp")),
               STEP_TARGET_FSDP2)
    if "fsdp-hpz" in s and "torch-fsdp2-hpz" in s:
        target("fsdp-hpz step vs torch-fsdp2-hpz", ratio(step("fsdp-hpz"), step("torch-fsdp2-hpz")),
               STEP_TARGET_FSDP2)
    target("fsdp peak bytes vs torch-fsdp2",
           ratio(s.get("fsdp", {}).get("peak_bytes"), s.get("torch-fsdp2", {}).get("peak_bytes")),
           1.0)
    single = s.get("single", {}).get("persistent_bytes")
    if single:
        target("fsdp persistent bytes vs single/N",
               ratio(s.get("fsdp", {}).get("persistent_bytes"), single / n), PERSISTENT_TARGET)
    return out


def plot(path, points, models, dtypes):
    """Per model and dtype: step time, and peak and persistent bytes per rank,
    against the world size."""
    configs = ["fsdp", "hsdp", "ddp", "torch-fsdp2", "torch-hsdp", "torch-ddp", "single"]
    with tempfile.TemporaryDirectory(prefix="fsdp-plot-") as tmp:
        panels = []
        for model in models:
            for dtype in dtypes:
                series = []
                for c in configs:
                    pts = sorted((p["np"], p["step_ms"], (p["peak_bytes"] or 0) / MIB,
                                  (p["persistent_bytes"] or 0) / MIB)
                                 for p in points
                                 if p["model"] == model and p["dtype"] == dtype
                                 and p["config"] == c and p["step_ms"] is not None)
                    if not pts:
                        continue
                    f = Path(tmp) / f"{model}-{dtype}-{c}.dat"
                    f.write_text("".join(f"{a} {b} {m} {q}\n" for a, b, m, q in pts))
                    series.append((c, f))
                panels.append((model, dtype, dict(series)))
        script = [f"set terminal pngcairo size 1800,{400 * len(panels)}",
                  f"set output '{path}'", "set key outside right", "set grid",
                  "set logscale x 2", "set xtics (1, 2, 4, 8, 16)", "set xlabel 'ranks'",
                  f"set multiplot layout {len(panels)},2"]
        for model, dtype, series in panels:
            script += [f"set title '{model} decoder, {dtype}: step time (slowest rank, median)'",
                       "set ylabel 'ms'",
                       "plot " + ", ".join(f"'{f}' using 1:2 with linespoints title '{c}'"
                                           for c, f in series.items())]
            lines = [f"'{f}' using 1:3 with linespoints title '{c} peak'"
                     for c, f in series.items()]
            for c in ("fsdp", "torch-fsdp2"):
                if c in series:
                    lines.append(f"'{series[c]}' using 1:4 with lines dashtype 2 "
                                 f"title '{c} persistent'")
            if "single" in series:
                lines.append(f"'{series['single']}' using 1:($4/$1) with lines dashtype 3 "
                             "title 'single / N'")
            script += [f"set title '{model} decoder, {dtype}: MiB per rank'",
                       "set ylabel 'MiB'", "plot " + ", ".join(lines)]
        script.append("unset multiplot")
        subprocess.run(["gnuplot"], input="\n".join(script), text=True, check=True)


def main(argv=None):
    args = parse_args(argv)
    results, metas = collect(args)
    points, targets = report(args, results)
    if args.plot:
        plot(args.plot, points, args.models, args.dtypes)
        print(f"# scaling plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "train-vs-peers",
                                         "meta": {"args": {k: str(v) for k, v in
                                                           vars(args).items()},
                                                  "programs": metas},
                                         "points": points, "targets": targets}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
