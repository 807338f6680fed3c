#!/usr/bin/env python3
"""Figures from memattn's benchmark output (Debian: python3-matplotlib).

  plot.py bench RESULTS_DIR OUT_DIR   Google Benchmark JSON (scripts/bench --plot) -> PNGs
  plot.py demo CSV OUT_PNG            streaming_decode --csv output (scripts/demo --plot) -> one PNG
  plot.py decode-table JSON           bench/decode_bench.cpp's JSON -> the Markdown table of
                                      docs/performance.md ("Decode at the roofline")
  plot.py kv-quality JSON [OUT_PNG]   bench/kv_quality_bench.cpp's JSON -> the Markdown table of
                                      docs/performance.md ("K/V storage: error against bytes"),
                                      and with OUT_PNG its figure
  plot.py memory-recall JSON [OUT_DIR]
                                      bench/memory_recall.cpp's JSON -> the Markdown table of
                                      every memory's recall, footprint and step, and with
                                      OUT_DIR its two figures

Every figure names the CPU, the SIMD level and the date of the run it shows. Repeated
runs are reduced to their median (Google Benchmark's aggregates when present).

A run on a busy machine is marked on its figure, in red in the title and at the foot: other
processes took at least CONTENDED_CORES of a core on average while it ran, as
scripts/lib/measure_load.py measured beside the JSON (NAME.load.json), or, for results
without that record, Google Benchmark's 1-minute load average at the start was at least
half the cores. `plot.py bench` lists the marked figures in OUT_DIR/CONTENDED (and removes
that file when none is), which `scripts/bench --plot --update-docs` refuses to copy.
"""
import csv
import datetime
import json
import os
import platform
import re
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Other processes' average use, in cores, during a run from which a figure is marked.
CONTENDED_CORES = 0.2
# The figures marked so far (file names), for OUT_DIR/CONTENDED.
contended_figures = []


def load(path):
    """Median real time (ns) and counters of each run, by run name, and the context."""
    with open(path) as f:
        data = json.load(f)
    scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}
    runs = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b.get("run_name", b["name"])
        entry = dict(b)
        entry["ns"] = b["real_time"] * scale[b.get("time_unit", "ns")]
        runs.setdefault(name, []).append(entry)
    merged = {}
    for name, entries in runs.items():
        medians = [e for e in entries if e.get("aggregate_name") == "median"]
        if medians:
            merged[name] = medians[0]
            continue
        keys = [k for k, v in entries[0].items() if isinstance(v, (int, float))]
        merged[name] = {k: statistics.median(e[k] for e in entries if k in e) for k in keys}
    context = dict(data.get("context", {}))
    sidecar = os.path.splitext(path)[0] + ".load.json"
    if os.path.exists(sidecar):
        with open(sidecar) as f:
            context["memattn_load"] = json.load(f)
    return merged, context


def contention(context):
    """The note a figure carries when its run shared the machine, else None."""
    record = context.get("memattn_load")
    if record and record.get("other_cores_busy") is not None:
        others = record["other_cores_busy"]
        if others < CONTENDED_CORES:
            return None
        cpus = record.get("cpus") or context.get("num_cpus") or "?"
        note = f"CONTENDED RUN: other processes used {others:.2f} of {cpus} cores on average while it ran"
        before, after = record.get("loadavg_before"), record.get("loadavg_after")
        if before and after:
            note += f" (load {before[0]:.2f} before, {after[0]:.2f} after)"
        return note + "; its timings are not the library's alone"
    load_avg = context.get("load_avg")
    cpus = context.get("num_cpus")
    if load_avg and cpus and load_avg[0] >= cpus / 2:
        return (f"POSSIBLY CONTENDED: load average {load_avg[0]:.2f} on {cpus} cores when the run started "
                "(no measurement during the run)")
    return None


def args_of(run_name):
    """('BM_X', {'N': 4096, ...}, [positional args]) from 'BM_X/N:4096/...'."""
    parts = run_name.split("/")
    named, positional = {}, []
    for p in parts[1:]:
        m = re.fullmatch(r"(\w+):(-?\d+)", p)
        if m:
            named[m.group(1)] = int(m.group(2))
        elif re.fullmatch(r"-?\d+", p):
            positional.append(int(p))
    return parts[0], named, positional


def series(runs, prefix, key, x_arg, filters, value):
    """Sorted (x, value) pairs of the runs named `prefix` whose args match `filters`."""
    points = []
    for name, run in runs.items():
        base, named, _ = args_of(name)
        if base != prefix or any(named.get(k) != v for k, v in filters.items()):
            continue
        if key is not None and key not in run:
            continue
        points.append((named[x_arg], value(run)))
    return sorted(points)


def caption(context):
    cpu = context.get("cpu_model") or platform.processor() or "unknown CPU"
    simd = context.get("simd", "")
    date = context.get("date", "")[:10] or datetime.date.today().isoformat()
    cores = context.get("num_cpus")
    parts = [cpu]
    if context.get("cpu_family_model"):
        parts.append(context["cpu_family_model"])
    if simd:
        parts.append(simd)
    if cores:
        parts.append(f"{cores} cores")
    parts.append(f"measured {date}")
    return ", ".join(parts)


def save(fig, context, path, title):
    note = contention(context)
    if note:
        title = f"{title}  [CONTENDED RUN]"
    fig.suptitle(f"{title}\n{caption(context)}", fontsize=10, color="tab:red" if note else "black")
    fig.tight_layout()
    if note:
        fig.subplots_adjust(bottom=fig.subplotpars.bottom + 0.06)
        fig.text(0.5, 0.01, note, ha="center", va="bottom", fontsize=7, color="tab:red",
                 bbox={"facecolor": "white", "edgecolor": "tab:red", "alpha": 0.9})
        contended_figures.append(os.path.basename(path))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}" + (f" -- {note}" if note else ""))


def causal_softmax(results, out):
    path = os.path.join(results, "causal_softmax_bench.json")
    if not os.path.exists(path):
        return
    runs, context = load(path)
    peak = next((r["GFLOPS"] for n, r in runs.items() if n.startswith("BM_FmaPeak")), None)
    # A CPU without AVX512-BF16 skips BM_Bf16DotPeak (an error, no GFLOPS)
    bf16_peak = next((r["GFLOPS"] for n, r in runs.items() if n.startswith("BM_Bf16DotPeak") and "GFLOPS" in r), None)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, d in zip(axes, (64, 128)):
        for prefix, window, label, style in [
            ("BM_CausalSoftmax", 0, "causal softmax, full", "o-"),
            ("BM_CausalSoftmax", 512, "causal softmax, window 512", "s-"),
            ("BM_CausalSoftmaxDouble", 0, "full, double", "^:"),
            ("BM_CausalSoftmaxBf16", 0, "full, bfloat16 in and out", "D-"),
            ("BM_EigenTileGemm", 0, "Eigen GEMM on 64x64 tiles (no softmax)", "x--"),
        ]:
            pts = series(runs, prefix, "GFLOPS", "N", {"d": d, "window": window}, lambda r: r["GFLOPS"])
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        if peak:
            ax.axhline(peak, color="k", lw=1, ls="-.", label=f"FMA peak, one core ({peak:.0f})")
        if bf16_peak:
            ax.axhline(bf16_peak, color="tab:gray", lw=1, ls="-.", label=f"bfloat16 dot peak ({bf16_peak:.0f})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens N")
        ax.set_title(f"d = dv = {d}")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GFLOP/s (2(d+dv) per visible pair), one thread")
    axes[0].set_ylim(bottom=0)
    axes[1].legend(fontsize=8, loc="lower right")
    save(fig, context, os.path.join(out, "causal_softmax.png"), "Causal softmax attention: speed against length")


MEMORIES = [
    ("BM_KVCacheStep", {}, "KV cache"),
    ("BM_SlidingWindowStep", {"window": 512}, "sliding window 512 + 4 sinks"),
    ("BM_SlidingWindowStep", {"window": 4096}, "sliding window 4096 + 4 sinks"),
    ("BM_HybridStep", {}, "hybrid 512 + 256 slots (rate 4)"),
    ("BM_MovingAverageStep", {"window": 512}, "moving average, window 512"),
    ("BM_MovingAverageStep", {"window": 0}, "moving average, cumulative"),
    ("BM_ExponentialAverageStep", {}, "exponential average"),
    ("BM_LinearAttentionStep", {}, "linear attention (elu+1)"),
]


def against_position(runs, context, key, value, ylabel, path, title):
    """One line per memory of MEMORIES (d = 64): value(run) against the position, log-log."""
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    for prefix, extra, label in MEMORIES:
        pts = series(runs, prefix, key, "position", {"d": 64, **extra}, value)
        if pts:
            ax.plot(*zip(*pts), "o-", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("position (tokens already in the memory)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    save(fig, context, path, title)


def memories(results, out):
    path = os.path.join(results, "memory_bench.json")
    if not os.path.exists(path):
        return
    runs, context = load(path)
    against_position(runs, context, None, lambda r: r["ns"] / 1e3, "one decoding step (update + attend), µs",
                     os.path.join(out, "decode_step.png"), "Decoding step against position, d = dv = 64, float")
    against_position(runs, context, "bytes", lambda r: r["bytes"], "bytes held (footprint)",
                     os.path.join(out, "bytes_held.png"), "Memory held against position, d = dv = 64, float")

    # Compact storage at 65536 pairs, d = 128: time, footprint and error against float.
    storages = [("float", "BM_KVCacheAttend"), ("bfloat16", "BM_KVCacheAttend<Eigen::bfloat16>"),
                ("float16", "BM_KVCacheAttend<Eigen::half>"), ("Q8", "BM_KVCacheAttend<memattn::Q8>")]
    base = runs.get("BM_KVCacheAttend/position:65536/d:128")
    if base:
        names, times, bytes_, errors = [], [], [], []
        for label, prefix in storages:
            run = runs.get(f"{prefix}/position:65536/d:128")
            if not run:
                continue
            names.append(label)
            times.append(run["ns"] / base["ns"])
            bytes_.append(run.get("footprint_vs_float", 1.0))
            errors.append(run.get("error_vs_float", 0.0))
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
        x = range(len(names))
        a1.bar([i - 0.2 for i in x], times, 0.4, label="attend time / float's")
        a1.bar([i + 0.2 for i in x], bytes_, 0.4, label="bytes held / float's")
        a1.set_xticks(list(x), names)
        a1.set_ylim(0, 1.15)
        a1.legend(fontsize=8)
        a1.set_title("KV cache, 65536 pairs, d = 128", fontsize=9)
        compact = [i for i, name in enumerate(names) if name != "float"]
        a2.bar(range(len(compact)), [max(errors[i], 1e-9) for i in compact], 0.5, color="tab:red")
        a2.set_xticks(range(len(compact)), [names[i] for i in compact])
        a2.set_yscale("log")
        a2.set_ylabel("max |out − out_float| / max |out_float|")
        a2.set_title("output error of one attend", fontsize=9)
        save(fig, context, os.path.join(out, "compact_storage.png"), "Compact K/V storage: speed, size and error")


def linear_forms(results, out):
    path = os.path.join(results, "linear_attention_bench.json")
    if not os.path.exists(path):
        return
    runs, context = load(path)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, d in zip(axes, (64, 128)):
        curves = {}
        for prefix, label, style in [
            ("BM_LinearChunked", "chunked linear", "o-"),
            ("BM_CrossoverChunked", None, "o-"),
            ("BM_LinearRecurrent", "recurrent linear", "s-"),
            ("BM_LinearQuadratic", "quadratic linear (pairs)", "^-"),
            ("BM_CausalSoftmax", "causal softmax", "x--"),
        ]:
            pts = series(runs, prefix, "tokens/s", "n", {"d": d}, lambda r: r["tokens/s"])
            key = "chunked linear" if prefix == "BM_CrossoverChunked" else label
            curves.setdefault(key, {}).update(dict(pts))
        for label, pts in curves.items():
            if pts:
                xs = sorted(pts)
                ax.plot(xs, [pts[x] for x in xs], "o-" if "softmax" not in label else "x--", label=label)
        chunked, softmax = curves.get("chunked linear", {}), curves.get("causal softmax", {})
        common = sorted(set(chunked) & set(softmax))
        crossover = next((n for n in common if chunked[n] >= softmax[n]), None)
        if crossover:
            ax.axvline(crossover, color="gray", ls=":", lw=1)
            ax.annotate(f"chunked linear faster\nfrom N = {crossover}", (crossover, ax.get_ylim()[0]),
                        xytext=(5, 10), textcoords="offset points", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N")
        ax.set_title(f"d = dv = {d}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("tokens per second, one thread")
    axes[1].legend(fontsize=8)
    save(fig, context, os.path.join(out, "linear_forms.png"),
         "Linear attention's three forms against causal softmax")


def threads(results, out):
    path = os.path.join(results, "multi_head_bench.json")
    if not os.path.exists(path):
        return
    runs, context = load(path)
    labels, speedups = [], []
    for prefix, kind in (("BM_SoftmaxLayer", "softmax"), ("BM_LinearLayer", "linear")):
        by_config = {}
        for name, run in runs.items():
            base, _, pos = args_of(name)
            if base != prefix or len(pos) < 4:
                continue
            threads_, q, kv, d = pos[:4]
            by_config.setdefault((q, kv, d), {})[threads_] = run["ns"]
        for (q, kv, d), t in sorted(by_config.items()):
            if 1 in t and 2 in t:
                labels.append(f"{kind}\n{q}/{kv} heads\nd={d}")
                speedups.append(t[1] / t[2])
    if not labels:
        return
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.bar(range(len(labels)), speedups)
    ax.axhline(2, color="k", ls=":", lw=1, label="2 threads, perfect")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("time on 1 thread / time on 2")
    ax.set_ylim(0, 2.2)
    ax.legend(fontsize=8)
    save(fig, context, os.path.join(out, "threads.png"), "Multi-head layer, N = 4096: two threads against one")


DECODE_STORAGES = [("float", "tab:blue"), ("bfloat16", "tab:orange"), ("half", "tab:green"), ("Q8", "tab:red"),
                   ("Q4", "tab:purple"), ("Q4Affine", "tab:brown"), ("Fp8E4M3", "tab:pink"),
                   ("Fp8E5M2", "tab:olive")]
DECODE_LAYOUTS = [(32, 8), (8, 1)]


def decode_cells(runs, prefix="BM_DecodeStep"):
    """{(storage, q, kv, length, threads): run} of bench/decode_bench.cpp's cells."""
    cells = {}
    for name, run in runs.items():
        base, named, _ = args_of(name)
        m = re.fullmatch(re.escape(prefix) + r"<(\w+)>", base)
        if m and "step_ms" in run:
            cells[(m.group(1), named["q"], named["kv"], named["length"], named["t"])] = run
    return cells


def decode_roofline(results, out):
    """Step time against cache length for every storage, each beside its roofline."""
    path = os.path.join(results, "decode_bench.json")
    if not os.path.exists(path):
        return
    runs, context = load(path)
    cells = decode_cells(runs)
    if not cells:
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for row, (q, kv) in enumerate(DECODE_LAYOUTS):
        for col, threads in enumerate((1, 2)):
            ax = axes[row][col]
            for storage, color in DECODE_STORAGES:
                pts = sorted((length, run) for (s, qq, kk, length, t), run in cells.items()
                             if (s, qq, kk, t) == (storage, q, kv, threads))
                if not pts:
                    continue
                xs = [length for length, _ in pts]
                ax.plot(xs, [r["step_ms"] for _, r in pts], "o-", color=color, label=f"{storage}: step")
                ax.plot(xs, [r["roofline_ms"] for _, r in pts], "--", color=color, lw=1.2,
                        label=f"{storage}: roofline")
                for x, (_, r) in zip(xs, pts):
                    ax.annotate(f"{r['fraction']:.2f}", (x, r["step_ms"]), xytext=(4, 3),
                                textcoords="offset points", fontsize=7, color=color)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{q} query / {kv} KV heads x 128, {threads} thread{'s' if threads > 1 else ''}",
                         fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if row == 1:
                ax.set_xlabel("cache length (tokens)")
            if col == 0:
                ax.set_ylabel("ms per step (median)")
    axes[0][1].legend(fontsize=7, loc="upper left", ncol=2)
    fig.text(0.5, 0.935, "roofline: the larger of a streaming read of the step's bytes (the caches' K and V as "
             "stored) and its multiply-adds at the FMA peak, same run and threads; numbers: roofline / step",
             ha="center", fontsize=7)
    fig.subplots_adjust(top=0.86)
    save(fig, context, os.path.join(out, "decode_roofline.png"),
         "Decode step (update + attend) of MultiHead<KVCache<float, S>> against its roofline")


def decode_table(path):
    """Prints the Markdown table of docs/performance.md from decode_bench's JSON."""
    runs, context = load(path)
    steps, attends = decode_cells(runs), decode_cells(runs, "BM_DecodeAttend")
    print(f"{caption(context)}")
    note = contention(context)
    if note:
        print(note)
    record = context.get("memattn_load") or {}
    if record.get("loadavg_before"):
        print(f"load average {record['loadavg_before'][0]:.2f} before, {record['loadavg_after'][0]:.2f} after")
    print()
    with_attend = bool(attends)
    header = "| storage | layout | length | MiB read | 1 thread: step / roofline ms | fraction |"
    header += " 2 threads: step / roofline ms | fraction |"
    if with_attend:
        header += " attend alone 1T / 2T ms |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for storage, _ in DECODE_STORAGES:
        for q, kv in DECODE_LAYOUTS:
            for length in sorted({c[3] for c in steps}):
                one, two = steps.get((storage, q, kv, length, 1)), steps.get((storage, q, kv, length, 2))
                if not one and not two:
                    continue
                mib = (one or two)["MiB"]

                def cell(r):
                    if not r:
                        return "– | –"
                    bound = " (FMA)" if r.get("compute_bound", 0) >= 0.5 else ""
                    return f"{r['step_ms']:.3g} / {r['roofline_ms']:.3g}{bound} | {r['fraction']:.2f}"

                line = f"| {storage} | {q}/{kv} | {length} | {mib:.0f} | {cell(one)} | {cell(two)} |"
                if with_attend:
                    a1, a2 = attends.get((storage, q, kv, length, 1)), attends.get((storage, q, kv, length, 2))
                    line += (f" {a1['step_ms']:.3g}" if a1 else " –") + " / " + (f"{a2['step_ms']:.3g} |" if a2 else "– |")
                print(line)
    return 0


KEY_KINDS = {0: "Gaussian keys", 1: "keys with outlier channels"}


def kv_quality_cells(runs):
    """{(storage, keys): run} of bench/kv_quality_bench.cpp, storages in the binary's order."""
    cells = {}
    for name, run in runs.items():
        base, named, _ = args_of(name)
        m = re.fullmatch(r"BM_KvQuality<(.+)>", base)
        if m and "kl" in run:
            cells[(m.group(1), named["keys"])] = run
    return cells


def kv_quality(path, out_png=None):
    """Prints the table of each storage's error, bytes and step; draws the figure."""
    runs, context = load(path)
    cells = kv_quality_cells(runs)
    order = sorted({s for s, _ in cells},
                   key=lambda s: -(cells.get((s, 0)) or cells.get((s, 1)))["bytes_per_token"])
    print(caption(context))
    note = contention(context)
    if note:
        print(note)
    print()
    print("| storage | bytes per token (K + V, d = 128) | Gaussian keys: output error / KL / top-1 "
          "| outlier keys: output error / KL / top-1 | step, µs (Gaussian / outlier keys) |")
    print("|---|---|---|---|---|")
    for storage in order:
        parts = []
        for keys in (0, 1):
            r = cells.get((storage, keys))
            parts.append("–" if not r else f"{r['rel_error']:.2g} / {r['kl']:.2g} / {r['top1']:.2f}")
        first = cells.get((storage, 0)) or cells.get((storage, 1))
        steps = "/".join(f"{cells[(storage, k)]['ns'] / 1e3:.0f}" for k in (0, 1) if (storage, k) in cells)
        print(f"| {storage} | {first['bytes_per_token']:.0f} | {parts[0]} | {parts[1]} | {steps} |")
    if out_png is None:
        return 0
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, keys in zip(axes, (0, 1)):
        for storage in order:
            r = cells.get((storage, keys))
            if not r or r["rel_error"] <= 0:
                continue
            ax.scatter(r["bytes_per_token"], r["rel_error"], s=30)
            ax.annotate(storage, (r["bytes_per_token"], r["rel_error"]), xytext=(4, -9 if "Rotated" in storage else 3),
                        textcoords="offset points", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(KEY_KINDS[keys], fontsize=9)
        ax.set_xlabel("bytes per token (one head's K and V, d = 128)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("attention output's relative error against double")
    save(fig, context, out_png, "K/V storage: the attention's error against the bytes it keeps")
    return 0


# bench/memory_recall.cpp's memories, in its order: (label in the benchmark name, legend).
RECALL_MEMORIES = [
    ("KVCache", "KV cache (float)"),
    ("KVCache_bf16", "KV cache, bfloat16"),
    ("KVCache_Q8", "KV cache, Q8"),
    ("SparseKVCache", "sparse KV cache (top 256 blocks of 8)"),
    ("Window", "sliding window"),
    ("WindowSinks", "sliding window + 4 sinks"),
    ("Hybrid_Mean", "hybrid, mean-pooled slots"),
    ("Hybrid_Max", "hybrid, max-pooled slots"),
    ("Hybrid_Weighted", "hybrid, weighted slots"),
    ("MovingAverage", "moving average"),
    ("EMA", "exponential average (α 0.05)"),
    ("Linear_Identity", "linear, identity, unnormalised"),
    ("Linear_Elu", "linear, elu + 1"),
    ("Linear_Relu", "linear, relu"),
    ("Linear_Taylor2", "linear, Taylor-2"),
    ("Linear_Favor", "linear, FAVOR+ (256)"),
    ("GLA", "gated linear (decay 0.99)"),
    ("DeltaRule", "delta rule (β 1)"),
    ("GatedDeltaRule", "gated delta rule (0.99)"),
    ("KDA", "KDA (0.99 in every channel)"),
    ("RWKV7", "RWKV-7 as a delta rule (0.99)"),
]
RECALL_KEYS = {0: "isotropic keys", 1: "clustered keys"}


def recall_cells(runs, family="BM_Recall"):
    """{(label, kib, keys, n): run} of bench/memory_recall.cpp's `family`."""
    cells = {}
    for name, run in runs.items():
        base, named, _ = args_of(name)
        m = re.fullmatch(re.escape(family) + r"<(\w+)>", base)
        if m and {"kib", "keys", "n"} <= named.keys():
            cells[(m.group(1), named["kib"], named["keys"], named["n"])] = run
    return cells


def recall_labels(cells):
    """The memories present, in the binary's order, then any it does not know yet."""
    present = {c[0] for c in cells}
    known = [label for label, _ in RECALL_MEMORIES if label in present]
    return known + sorted(present - set(known))


def recall_legend(label, cells):
    """The memory's legend: its name, and its bytes when they do not depend on n."""
    legend = dict(RECALL_MEMORIES).get(label, label)
    sizes = {run["bytes"] for (l, kib, _, _), run in cells.items() if l == label and kib == 0 and "bytes" in run}
    if len(sizes) == 1:
        size = sizes.pop()
        legend += f", {size / 1024:.3g} KiB" if size < 2 ** 20 else f", {size / 2 ** 20:.3g} MiB"
    return legend


def recall_columns(cells):
    """The figures' columns: (title, budget, labels). The memories without a budget split
    by whether their bytes grow with n (the caches that keep every pair) or not (the
    fixed-size states); then one column per budget."""
    labels = recall_labels(cells)
    growing, fixed = [], []
    for label in labels:
        sizes = {run.get("bytes") for (l, kib, _, _), run in cells.items() if l == label and kib == 0}
        if sizes:
            (growing if len(sizes) > 1 else fixed).append(label)
    columns = []
    if growing:
        columns.append(("every pair kept (bytes grow with n)", 0, growing))
    if fixed:
        columns.append(("fixed-size states", 0, fixed))
    for kib in sorted({c[1] for c in cells} - {0}):
        columns.append((f"budget {kib} KiB per head", kib,
                        [label for label in labels if any(c[:2] == (label, kib) for c in cells)]))
    return columns


def recall_style(j):
    """Line j of a panel: identical results (a storage, a code path) stay visible, the
    first drawn thickest, the later ones thinner and dashed on top of it."""
    styles = ("-", "--", "-.", ":")
    markers = ("o", "s", "^", "v", "D", "P", "X", "*")
    return {"color": plt.cm.tab10(j % 10), "ls": styles[(j // 10 + j) % 4], "marker": markers[j % 8],
            "lw": max(0.9, 2.6 - 0.25 * (j % 8)), "ms": max(2.5, 5.5 - 0.4 * (j % 8))}


def recall_figure(cells, points, xlabel, path, title, context, chance=False):
    """Rows the key distributions, columns recall_columns(); points(label, kib, keys) gives a
    line's (x, accuracy) pairs. The float KV cache is drawn dashed beside each budget's memories."""
    columns = recall_columns(cells)
    keys = sorted({c[2] for c in cells})
    fig, axes = plt.subplots(len(keys), len(columns), figsize=(4.6 * len(columns), 3.4 * len(keys) + 2.6),
                             sharey=True, squeeze=False)
    for row, k in enumerate(keys):
        for col, (heading, kib, labels) in enumerate(columns):
            ax = axes[row][col]
            for j, label in enumerate(labels):
                pts = points(label, kib, k)
                if pts:
                    ax.plot(*zip(*pts), label=recall_legend(label, cells), **recall_style(j))
            if kib:
                reference = points("KVCache", 0, k)
                if reference:
                    ax.plot(*zip(*reference), "k--", lw=1, label="KV cache (float, unbounded)")
                pairs = kib * 1024 // 512  # d = dv = 64 floats: 512 bytes a pair
                ax.axvline(pairs, color="gray", lw=0.8, ls="-.")
                ax.annotate(f"{pairs} pairs", (pairs, 0.5), xytext=(3, 0), textcoords="offset points", fontsize=7,
                            color="gray")
            if chance:
                ns = sorted({c[3] for c in cells})
                ax.plot(ns, [1 / n for n in ns], ":", color="gray", lw=1, label="chance, 1/n")
            ax.set_title(f"{RECALL_KEYS.get(k, k)}: {heading}", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.03, 1.03)
            ax.grid(True, which="both", alpha=0.3)
            if col == 0:
                ax.set_ylabel("accuracy (exact queries)")
            if row == len(keys) - 1:
                ax.set_xlabel(xlabel, fontsize=8)
                ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.text(0.5, 0.005, "retrieved: of all n stored values, the right one has the largest cosine to the output; "
             "softmax memories at logit scale 16 (q·k of unit vectors), linear ones read the unit query as it is",
             ha="center", va="bottom", fontsize=7)
    save(fig, context, path, title)


def memory_recall_figures(runs, context, out):
    """Accuracy against n, and against distance at the largest n, one line per memory."""
    cells = recall_cells(runs)
    if not cells:
        return
    # The figures show no time: a busy machine cannot change them, so they carry no contention mark.
    quiet = {k: v for k, v in context.items() if k not in ("memattn_load", "load_avg")}

    def against_n(label, kib, keys):
        return sorted((n, run["accuracy"]) for (l, b, k, n), run in cells.items() if (l, b, k) == (label, kib, keys))

    recall_figure(cells, against_n, "pairs in the stream n", os.path.join(out, "memory_recall.png"),
                  "Associative recall against the stream's length, d = dv = 64, float", quiet, chance=True)

    by_distance = recall_cells(runs, "BM_RecallDistance")
    if not by_distance:
        return
    n = max(c[3] for c in by_distance)

    def against_distance(label, kib, keys):
        run = by_distance.get((label, kib, keys, n))
        if not run:
            return []
        return sorted((int(name[len("acc_le"):]), value) for name, value in run.items()
                      if re.fullmatch(r"acc_le\d+", name))

    recall_figure(cells, against_distance, f"distance back from the newest pair (buckets (D/2, D]), n = {n}",
                  os.path.join(out, "memory_recall_distance.png"),
                  f"Associative recall against distance, n = {n}, d = dv = 64, float", quiet)


def memory_recall_table(path, out_dir=None):
    """Prints the Markdown table of every memory's recall; with out_dir, draws the figures."""
    runs, context = load(path)
    cells = recall_cells(runs)
    print(caption(context))
    note = contention(context)
    if note:
        print(note + " (the step times only: the recall figures are deterministic)")
    print()
    ns = sorted({c[3] for c in cells})
    print("| memory | budget | keys | " + " | ".join(f"n = {n}: accuracy / cosine / noisy" for n in ns)
          + f" | bytes at n = {ns[-1]} | step at n = {ns[-1]}, µs |")
    print("|---|---|---|" + "---|" * len(ns) + "---|---|")
    for label in recall_labels(cells):
        for kib in sorted({c[1] for c in cells if c[0] == label}):
            for keys in sorted({c[2] for c in cells}):
                row = [cells.get((label, kib, keys, n)) for n in ns]
                if not any(row):
                    continue
                parts = ["–" if r is None else f"{r['accuracy']:.3f} / {r['cosine']:.2f} / {r['noisy_accuracy']:.3f}"
                         for r in row]
                last = row[-1] or {}
                budget = f"{kib} KiB" if kib else "–"
                step = f"{last['ns'] / 1e3:.3g}" if "ns" in last else "–"
                print(f"| {label} | {budget} | {RECALL_KEYS[keys].split()[0]} | " + " | ".join(parts)
                      + f" | {last.get('bytes', 0):.0f} | {step} |")
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        memory_recall_figures(runs, context, out_dir)
    return 0


def memory_recall(results, out):
    path = os.path.join(results, "memory_recall.json")
    if not os.path.exists(path):
        return
    runs, context = load(path)
    memory_recall_figures(runs, context, out)


def demo(csv_path, out_png):
    data = {}
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            data.setdefault(row["memory"], []).append((int(row["position"]), float(row["us_per_token"])))
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    for name, pts in data.items():
        pts.sort()
        ax.plot(*zip(*pts), "o-", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("position (tokens already in the memory)")
    ax.set_ylabel("µs per decoding step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    context = {"cpu_model": cpu_model(), "date": datetime.date.today().isoformat(),
               "num_cpus": os.cpu_count()}
    save(fig, context, out_png, "scripts/demo: decoding step against position")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv):
    if len(argv) == 4 and argv[1] == "bench":
        os.makedirs(argv[3], exist_ok=True)
        for figure in (causal_softmax, memories, linear_forms, threads, decode_roofline, memory_recall):
            figure(argv[2], argv[3])
        quality = os.path.join(argv[2], "kv_quality_bench.json")
        if os.path.exists(quality):
            kv_quality(quality, os.path.join(argv[3], "kv_quality.png"))
        marker = os.path.join(argv[3], "CONTENDED")
        if contended_figures:
            with open(marker, "w") as f:
                f.write("".join(name + "\n" for name in contended_figures))
        elif os.path.exists(marker):
            os.remove(marker)
        return 0
    if len(argv) == 3 and argv[1] == "decode-table":
        return decode_table(argv[2])
    if len(argv) in (3, 4) and argv[1] == "kv-quality":
        return kv_quality(argv[2], argv[3] if len(argv) == 4 else None)
    if len(argv) in (3, 4) and argv[1] == "memory-recall":
        return memory_recall_table(argv[2], argv[3] if len(argv) == 4 else None)
    if len(argv) == 4 and argv[1] == "demo":
        demo(argv[2], argv[3])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
