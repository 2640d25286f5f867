"""Where one training step's wall time goes (`polyrl bench --profile`).

The trainer marks its stages and the actor and sampler their phases with `region(name)` (a
`torch.profiler.record_function` named `polyrl/<name>`; nearly free when no profiler runs). `summarize_trace` reads
the Chrome trace that `torch.profiler` exports and reports, per region:

- wall seconds on the host, and the device-busy seconds inside that interval (the union of kernel and copy
  intervals). The trainer synchronises the device at stage boundaries, so for a stage wall − busy is the time the
  device waited on the host (launches, syncs, Python): what CUDA graphs or fewer host round trips can win back;
- the device seconds of the kernels *launched* from the region (matched to their launch by the trace's correlation
  ids): a phase's own device work even when the host runs ahead of the device, as it does inside a stage.

Then the kernel time by kind and the largest kernels and host-side ops, and the calls that made the host wait for the
device, counted by Python stack (`counted_syncs`: torch.cuda's sync debug mode; a copy into pageable memory or an
`.item()` inside a loop shows up there with the line that made it).
"""

from __future__ import annotations

import json
import os
import traceback
import warnings
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch

PREFIX = "polyrl/"
# first match wins: inductor's fused kernels are named after their ops (triton_..._to_copy_...), so "triton" comes
# before "copy"
KINDS = [("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
         ("matmul", ("gemm", "cutlass", "sm90", "nvjet", "matmul", "scaled_mm", "xmma", "splitk")),
         ("fused elementwise", ("triton",)),
         ("copy", ("copy", "memcpy", "memset", "cat", "fill"))]
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_kind(name: str) -> str:
    """A kernel's kind from its name: attention, matmul, copy, fused elementwise (inductor's Triton) or other."""
    low = name.lower()
    for kind, keys in KINDS:
        if any(key in low for key in keys):
            return kind
    return "other"


@contextmanager
def region(name: str):
    """Mark a region `polyrl/<name>` for the profiler (a no-op record when none runs)."""
    with torch.profiler.record_function(PREFIX + name):
        yield


def union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of [start, end) intervals clipped to [lo, hi); `intervals` sorted by start."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in intervals:
        start, end = max(start, lo), min(end, hi)
        if end <= start:
            continue
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize_trace(events: list[dict], top: int = 25) -> dict:
    """Chrome-trace events (torch.profiler's export: `ts`/`dur` in µs) -> per-region wall, device-busy and launched
    device seconds, kernel time by kind, the largest kernels and host ops. Regions of one name are summed."""
    complete = [e for e in events if e.get("ph") == "X"]
    device = sorted((e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("correlation")) for e in complete
                    if e.get("cat") in DEVICE_CATEGORIES)
    launches = {e["args"]["correlation"]: e for e in complete
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    launch_ts = {c: e["ts"] for c, e in launches.items()}
    launched = sorted((launch_ts[c], end - start) for start, end, _, c in device if c in launch_ts)
    launch_times = [t for t, _ in launched]
    cumulative = [0.0]
    for _, d in launched:
        cumulative.append(cumulative[-1] + d)
    spans = [(s, e) for s, e, _, _ in device]
    per_region: dict[str, dict] = {}
    for r in complete:
        if r.get("cat") != "user_annotation" or not r["name"].startswith(PREFIX):
            continue
        lo, hi = r["ts"], r["ts"] + r["dur"]
        row = per_region.setdefault(r["name"][len(PREFIX):],
                                    {"calls": 0, "wall_s": 0.0, "busy_s": 0.0, "launched_device_s": 0.0})
        row["calls"] += 1
        row["wall_s"] += r["dur"] / 1e6
        row["busy_s"] += union_length(spans, lo, hi) / 1e6
        row["launched_device_s"] += (cumulative[bisect_right(launch_times, hi)]
                                     - cumulative[bisect_left(launch_times, lo)]) / 1e6
    for row in per_region.values():
        row["idle_frac"] = 1 - row["busy_s"] / row["wall_s"] if row["wall_s"] > 0 else 0.0
    by_kind, by_name, counts = defaultdict(float), defaultdict(float), defaultdict(int)
    for s, e, name, _ in device:
        by_kind[kernel_kind(name)] += (e - s) / 1e6
        by_name[name] += (e - s) / 1e6
        counts[name] += 1
    host = defaultdict(float)
    for e in complete:
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"):
            host[e["name"]] += e["dur"] / 1e6
    # device time by the innermost host op that launched it (e.g. which op's copies sync the host)
    ops_by_thread = defaultdict(list)
    for e in complete:
        if e.get("cat") == "cpu_op":
            ops_by_thread[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    starts_by_thread = {}
    for tid, ops in ops_by_thread.items():
        ops.sort()
        starts_by_thread[tid] = [s for s, _, _ in ops]
    by_launcher, launcher_counts = defaultdict(float), defaultdict(int)
    for s, e, name, c in device:
        launch = launches.get(c)
        op = "(no host op)"
        if launch is not None and launch.get("tid") in ops_by_thread:
            ops, starts = ops_by_thread[launch["tid"]], starts_by_thread[launch["tid"]]
            i = bisect_right(starts, launch["ts"]) - 1
            while i >= 0 and ops[i][1] < launch["ts"]:  # the latest-starting op still open at the launch
                i -= 1
            if i >= 0:
                op = ops[i][2]
        key = f"{op} -> {kernel_kind(name) if not name.startswith('Memcpy') else name}"
        by_launcher[key] += (e - s) / 1e6
        launcher_counts[key] += 1
    return {
        "regions": per_region,
        "device_s": sum(by_kind.values()),
        "kinds_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"name": n, "s": t, "count": counts[n]}
                        for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]],
        # the small kinds' kernels hide below the largest ones: list each kind's own largest
        "top_kernels_by_kind": {kind: [{"name": n, "s": t, "count": counts[n]}
                                       for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])
                                       if kernel_kind(n) == kind][:8] for kind in by_kind},
        "top_host_ops": [{"name": n, "s": t} for n, t in sorted(host.items(), key=lambda kv: -kv[1])[:top]],
        "top_launchers": [{"name": n, "s": t, "count": launcher_counts[n]}
                          for n, t in sorted(by_launcher.items(), key=lambda kv: -kv[1])[:top]],
    }


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda's sync debug mode, "warn"


@contextmanager
def counted_syncs(counts: Counter, depth: int = 8):
    """Inside the block every call that synchronises the host with the device adds 1 to `counts[stack]` (its Python
    stack, innermost frame first, `depth` frames) instead of warning. Nothing synchronises off a GPU: `counts` stays
    empty there."""
    cuda = torch.cuda.is_available()
    mode = torch.cuda.get_sync_debug_mode() if cuda else 0
    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        original = warnings.showwarning

        def count(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING not in str(message):
                return original(message, category, filename, lineno, file, line)
            frames = [f for f in traceback.extract_stack()[:-1] if os.path.basename(f.filename) != "warnings.py"]
            counts[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-depth:]))] += 1

        warnings.simplefilter("always")
        warnings.showwarning = count
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(mode)


def sync_lines(syncs: dict) -> list[str]:
    lines = ["", f"host-device synchronisations: {syncs['total']} (by Python stack, innermost frame first)", "",
             "| count | stack |", "|---|---|"]
    return lines + [f"| {n} | {stack} |" for stack, n in syncs["stacks"]]


def report(summary: dict) -> str:
    """The summary as markdown tables (host seconds only when the trace has no device events: a CPU run)."""
    text = _tables(summary)
    return text + ("\n".join(sync_lines(summary["syncs"])) + "\n" if summary.get("syncs") else "")


def _tables(summary: dict) -> str:
    regions = sorted(summary["regions"].items(), key=lambda kv: -kv[1]["wall_s"])
    if not summary["device_s"]:
        lines = ["| region | calls | wall s |", "|---|---|---|"]
        lines += [f"| {name} | {r['calls']} | {r['wall_s']:.3f} |" for name, r in regions]
        lines += ["", "| largest host ops (inclusive) | s |", "|---|---|"]
        return "\n".join(lines + [f"| {k['name'][:120]} | {k['s']:.3f} |" for k in summary["top_host_ops"]]) + "\n"
    lines = ["| region | calls | wall s | device busy s | idle | device s launched |", "|---|---|---|---|---|---|"]
    for name, r in regions:
        lines.append(f"| {name} | {r['calls']} | {r['wall_s']:.3f} | {r['busy_s']:.3f} | {100 * r['idle_frac']:.1f}% "
                     f"| {r['launched_device_s']:.3f} |")
    total = summary["device_s"] or 1.0
    lines += ["", f"device time {summary['device_s']:.3f} s by kind:", "", "| kind | s | share |", "|---|---|---|"]
    lines += [f"| {k} | {t:.3f} | {100 * t / total:.1f}% |" for k, t in summary["kinds_s"].items()]
    lines += ["", "| largest kernels | s | count |", "|---|---|---|"]
    lines += [f"| {k['name'][:120]} | {k['s']:.3f} | {k['count']} |" for k in summary["top_kernels"]]
    for kind in ("copy", "fused elementwise", "other"):
        if summary.get("top_kernels_by_kind", {}).get(kind):
            lines += ["", f"| largest {kind} kernels | s | count |", "|---|---|---|"]
            lines += [f"| {k['name'][:120]} | {k['s']:.3f} | {k['count']} |" for k in summary["top_kernels_by_kind"][kind]]
    lines += ["", "| launching host op -> device work | s | count |", "|---|---|---|"]
    lines += [f"| {k['name'][:120]} | {k['s']:.3f} | {k['count']} |" for k in summary["top_launchers"]]
    lines += ["", "| largest host ops (inclusive) | s |", "|---|---|"]
    lines += [f"| {k['name'][:120]} | {k['s']:.3f} |" for k in summary["top_host_ops"]]
    return "\n".join(lines) + "\n"


@contextmanager
def profiled(out_dir):
    """Profile the body (host and device); write `profile.md` and `profile.json` into `out_dir` (the Chrome trace
    they are read from holds every op and kernel of the epoch, so it is not kept)."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    out_dir = Path(out_dir)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    syncs = Counter()
    with profile(activities=activities) as prof, counted_syncs(syncs):
        yield
    trace = out_dir / "profile_trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    summary = summarize_trace(events)
    if torch.cuda.is_available():
        summary["syncs"] = {"total": sum(syncs.values()), "stacks": syncs.most_common(20)}
    (out_dir / "profile.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "profile.md").write_text(report(summary))
    trace.unlink()
