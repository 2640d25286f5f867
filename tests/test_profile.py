"""`polyrl bench --profile`'s trace summary: device-busy time is the union of kernel intervals inside a region, and a
kernel's time counts for the region that launched it (matched by correlation id), whenever it ran."""

import random

import pytest

from polyrl.perf.profile import kernel_kind, report, summarize_trace, union_length


def brute_union(intervals, lo, hi, step=0.5):
    """Covered length on a grid fine enough for the half-integer test intervals."""
    n = int((hi - lo) / step)
    return step * sum(any(s <= lo + (i + 0.5) * step < e for s, e in intervals) for i in range(n))


def test_union_length_matches_a_grid_count():
    rng = random.Random(0)
    for _ in range(50):
        intervals = sorted((a, a + rng.randint(1, 12)) for a in (rng.randint(0, 60) for _ in range(rng.randint(0, 9))))
        lo, hi = rng.randint(0, 30), rng.randint(30, 80)
        assert union_length(intervals, lo, hi) == pytest.approx(brute_union(intervals, lo, hi))


def region(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"polyrl/{name}", "ts": ts, "dur": dur}


def launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": 1,
            "args": {"correlation": corr}}


def op(name, ts, dur):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": 1}


def kernel(name, ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_regions_report_wall_busy_idle_and_the_device_time_they_launched():
    # a stage of 1000 µs; inside, phase A launches two kernels early and phase B one kernel that runs after A ends
    events = [
        region("train", 0, 1000), region("A", 0, 100), region("B", 100, 50),
        launch(10, 1), launch(20, 2), launch(120, 3),
        kernel("sm90_xmma_gemm_bf16", 200, 300, 1),   # launched in A, runs 200..500
        kernel("triton_poi_fused_mul_0", 400, 200, 2),  # launched in A, overlaps the gemm: busy union 200..600
        kernel("cudnn_flash_attn_fwd", 700, 100, 3),   # launched in B, runs 700..800
        op("aten::linear", 5, 40), op("aten::mm", 10, 30),  # mm (inside linear) launched kernels 1 and 2
        op("aten::item", 125, 5), launch(127, 4),  # a device-to-host copy launched by item
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "ts": 800, "dur": 10,
         "args": {"correlation": 4}},
    ]
    s = summarize_trace(events)
    train, a, b = s["regions"]["train"], s["regions"]["A"], s["regions"]["B"]
    assert train["wall_s"] == pytest.approx(1e-3) and train["busy_s"] == pytest.approx(510e-6)
    assert train["idle_frac"] == pytest.approx(0.49)
    assert train["launched_device_s"] == pytest.approx(610e-6)
    # A's host interval saw no kernel run, but it launched 500 µs of device work; B launched 100 µs
    assert a["busy_s"] == 0 and a["launched_device_s"] == pytest.approx(500e-6)
    assert b["launched_device_s"] == pytest.approx(110e-6)
    assert s["kinds_s"] == pytest.approx({"matmul": 300e-6, "fused elementwise": 200e-6, "attention": 100e-6,
                                          "copy": 10e-6})
    seconds = {k["name"]: k["s"] for k in s["top_launchers"]}
    assert seconds == pytest.approx({"aten::mm -> matmul": 300e-6, "aten::mm -> fused elementwise": 200e-6,
                                     "(no host op) -> attention": 100e-6,
                                     "aten::item -> Memcpy DtoH (Device -> Pageable)": 10e-6})
    assert all(k["count"] == 1 for k in s["top_launchers"])
    assert s["top_kernels"][0]["name"] == "sm90_xmma_gemm_bf16" and s["top_host_ops"][0]["name"] == "aten::linear"
    assert [k["name"] for k in s["top_kernels_by_kind"]["copy"]] == ["Memcpy DtoH (Device -> Pageable)"]
    text = report(s)
    assert "| train | 1 | 0.001 | 0.001 | 49.0% | 0.001 |" in text
    assert "| largest copy kernels | s | count |\n|---|---|---|\n| Memcpy DtoH (Device -> Pageable) | 0.000 | 1 |" in text


def test_kernel_kinds():
    assert kernel_kind("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>") == "matmul"
    assert kernel_kind("triton_red_fused_native_layer_norm_0") == "fused elementwise"
    assert kernel_kind("triton_poi_fused__to_copy_add_cat_mul_6") == "fused elementwise"  # not a copy
    assert kernel_kind("void at::native::elementwise_kernel<copy>") == "copy"
    assert kernel_kind("flash_fwd_kernel") == "attention"
    assert kernel_kind("void at::native::reduce_kernel<512>") == "other"


def test_synchronising_calls_are_counted_by_their_python_stack():
    """`counted_syncs` turns torch.cuda's sync-debug warnings into counts per Python stack (innermost first); other
    warnings still warn, and the report lists the stacks. The warning is raised here by hand: a CPU never syncs."""
    import warnings
    from collections import Counter

    from polyrl.perf.profile import SYNC_WARNING, counted_syncs

    def copy_in_a_loop():
        warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)

    def item_once():
        warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)

    counts, shown = Counter(), []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
        with counted_syncs(counts):
            for _ in range(3):
                copy_in_a_loop()
            item_once()
            warnings.warn("unrelated", DeprecationWarning, stacklevel=1)
    assert shown == ["unrelated"]  # passed on to the warning display in place before
    assert sorted(counts.values()) == [1, 3]
    stacks = {stack.split(" <- ")[0].split(" ")[1]: n for stack, n in counts.items()}
    assert stacks == {"copy_in_a_loop": 3, "item_once": 1}
    assert all(" <- " in stack and "test_synchronising_calls" in stack for stack in counts)
    text = report({"regions": {}, "device_s": 0.0, "top_host_ops": [],
                   "syncs": {"total": 4, "stacks": counts.most_common()}})
    assert "host-device synchronisations: 4" in text and "copy_in_a_loop | 3" not in text
    assert any(line.startswith("| 3 | test_profile.py:") and "copy_in_a_loop" in line for line in text.splitlines())
