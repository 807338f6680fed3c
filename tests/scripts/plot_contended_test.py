#!/usr/bin/env python3
"""scripts/plot.py marks a figure drawn from a contended run, and only such a figure.

  plot_contended_test.py SOURCE_DIR

Writes a multi_head_bench.json (the threads figure's runs: 1 and 2 threads) to a scratch
directory, once with a measure_load.py record of a machine other work kept busy and once
of a quiet one, runs `plot.py bench` on each and checks the figure, the note in its title
and the OUT_DIR/CONTENDED list; that scripts/bench draws outside docs/images; and runs
measure_load.py itself on a short command.
Exit 77 (skipped) without matplotlib.
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

if importlib.util.find_spec("matplotlib") is None:
    print("matplotlib is not installed: skipped")
    sys.exit(77)

source = sys.argv[1]
sys.path.insert(0, os.path.join(source, "scripts"))
import plot  # noqa: E402

failures = []


def check(condition, what):
    if not condition:
        failures.append(what)
        print("FAILED:", what)


def bench_json(directory, load):
    runs = []
    for threads, ns in ((1, 1.0e6), (2, 1.6e6)):  # two threads slower than one: contended
        runs.append({"name": f"BM_SoftmaxLayer/{threads}/8/2/64/real_time", "run_name":
                     f"BM_SoftmaxLayer/{threads}/8/2/64/real_time", "run_type": "iteration",
                     "real_time": ns, "time_unit": "ns"})
    context = {"cpu_model": "test CPU", "num_cpus": 2, "date": "2024-01-01T00:00:00", "load_avg": [0.1, 0.1, 0.1]}
    with open(os.path.join(directory, "multi_head_bench.json"), "w") as f:
        json.dump({"context": context, "benchmarks": runs}, f)
    if load is not None:
        with open(os.path.join(directory, "multi_head_bench.load.json"), "w") as f:
            json.dump(load, f)


busy = {"cpus": 2, "other_cores_busy": 0.9, "loadavg_before": [1.7, 1.5, 1.2], "loadavg_after": [2.1, 1.6, 1.3]}
quiet = {"cpus": 2, "other_cores_busy": 0.02, "loadavg_before": [0.1, 0.1, 0.1], "loadavg_after": [1.0, 0.3, 0.1]}

# The note itself.
note = plot.contention({"memattn_load": busy})
check(note is not None and "CONTENDED" in note and "0.90 of 2 cores" in note and "1.70 before" in note,
      f"a busy run's note names the other processes' share and the load: {note!r}")
check(plot.contention({"memattn_load": quiet}) is None, "a quiet run carries no note")
check(plot.contention({"load_avg": [1.5, 1, 1], "num_cpus": 2}) is not None,
      "without a record, a high load average at the start is flagged")
check(plot.contention({"load_avg": [0.2, 0.1, 0.1], "num_cpus": 2}) is None, "nor a low one")

plot_py = os.path.join(source, "scripts", "plot.py")
for label, load, marked in (("busy", busy, True), ("quiet", quiet, False)):
    with tempfile.TemporaryDirectory() as scratch:
        results, images = os.path.join(scratch, "results"), os.path.join(scratch, "images")
        os.makedirs(results)
        bench_json(results, load)
        os.makedirs(images)
        with open(os.path.join(images, "CONTENDED"), "w") as f:
            f.write("stale.png\n")  # a previous run's list must not survive a quiet run
        run = subprocess.run([sys.executable, plot_py, "bench", results, images], capture_output=True, text=True)
        check(run.returncode == 0, f"{label}: plot.py bench succeeds ({run.stderr.strip()})")
        check(os.path.exists(os.path.join(images, "threads.png")), f"{label}: threads.png is drawn")
        marker = os.path.join(images, "CONTENDED")
        listed = open(marker).read().split() if os.path.exists(marker) else []
        check(listed == (["threads.png"] if marked else []), f"{label}: CONTENDED lists {listed}")
        check(("CONTENDED RUN" in run.stdout) == marked, f"{label}: the output says so: {run.stdout.strip()}")

# scripts/bench draws into the build tree: docs/images only through --update-docs' copy.
with open(os.path.join(source, "scripts", "bench")) as f:
    bench = f.read().splitlines()
plot_lines = [line for line in bench if "plot.py bench" in line]
check(plot_lines and all("docs/images" not in line for line in plot_lines),
      f"scripts/bench's plot.py writes outside docs/images: {plot_lines}")

# measure_load.py records the run and passes the command's exit status on.
with tempfile.TemporaryDirectory() as scratch:
    record_path = os.path.join(scratch, "load.json")
    measure = os.path.join(source, "scripts", "lib", "measure_load.py")
    status = subprocess.call([sys.executable, measure, record_path, sys.executable, "-c",
                              "import sys; sum(range(3000000)); sys.exit(3)"])
    check(status == 3, f"measure_load.py returns the command's status (got {status})")
    record = json.load(open(record_path))
    for key in ("cpus", "wall_seconds", "cpu_seconds_self", "loadavg_before", "loadavg_after", "other_cores_busy"):
        check(key in record, f"the record has {key}")
    check(record.get("cpu_seconds_self", 0) > 0, "the command's own CPU time is counted")

print("ok" if not failures else f"{len(failures)} failed")
sys.exit(1 if failures else 0)
