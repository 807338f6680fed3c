#!/usr/bin/env python3
"""Runs a benchmark and records how busy the machine was meanwhile (scripts/bench).

  measure_load.py OUT_JSON COMMAND [ARG...]

Runs COMMAND (its output as it is, its exit status returned) and writes OUT_JSON: the
load averages and runnable threads of /proc/loadavg before and after, the wall time, the
CPU time the command used (its user + system, every thread), and the CPU time the whole
machine used meanwhile (/proc/stat). Their difference is what other processes took while
the benchmark ran, `other_cores_busy` on average over the run: scripts/plot.py marks a
figure drawn from a run where that is a real share of a core, so a contended run's
timings are not read as the library's.
"""
import json
import os
import resource
import subprocess
import sys
import time


def loadavg():
    """(1, 5 and 15-minute load averages, runnable threads) from /proc/loadavg."""
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        return [float(x) for x in fields[:3]], int(fields[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None, None


def busy_seconds():
    """CPU seconds every core has spent not idle since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is within user).
    ticks = [int(x) for x in fields[1:9]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, command = argv[1], argv[2:]
    load_before, runnable_before = loadavg()
    busy_before = busy_seconds()
    start = time.monotonic()
    status = subprocess.call(command)
    wall = time.monotonic() - start
    busy_after = busy_seconds()
    load_after, runnable_after = loadavg()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = usage.ru_utime + usage.ru_stime
    record = {
        "command": os.path.basename(command[0]),
        "cpus": os.cpu_count(),
        "wall_seconds": round(wall, 3),
        "cpu_seconds_self": round(own, 3),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "runnable_before": runnable_before,
        "runnable_after": runnable_after,
    }
    if busy_before is not None and busy_after is not None and wall > 0:
        machine = busy_after - busy_before
        record["cpu_seconds_machine"] = round(machine, 3)
        record["other_cores_busy"] = round(max(0.0, machine - own) / wall, 3)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
