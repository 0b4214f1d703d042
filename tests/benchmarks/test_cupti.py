"""The CUPTI record parsing and SM-time arithmetic, on synthetic Chrome traces (no GPU)."""

from __future__ import annotations

import pytest

from benchmarks.harness import cupti, timeline


def _trace():
    return {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "tide_accumulate_bf16", "ts": 100.0, "dur": 50.0,
         "args": {"grid": [66, 1, 1], "block": [512, 1, 1], "stream": 16}},
        {"ph": "X", "cat": "kernel", "name": "big_gemm", "ts": 10.0, "dur": 20.0,
         "args": {"grid": [528, 2, 1], "block": [128, 1, 1], "stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 5.0, "dur": 400.0,
         "args": {"stream": 14, "bytes": 1 << 20}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 3.0},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 2.0},
    ]}


def test_events_keep_device_activity_only_in_time_order():
    events = cupti.events_from_chrome(_trace())
    assert [e["name"] for e in events] == ["Memcpy PtoP", "big_gemm", "tide_accumulate_bf16"]
    assert events[2]["blocks"] == 66 and events[2]["stream"] == 16
    assert events[0]["blocks"] is None


def test_sm_time_weights_each_kernel_by_the_sms_its_grid_can_fill():
    events = cupti.events_from_chrome(_trace())
    # 132 SMs: the accumulate (66 blocks) fills half for 50 us, the GEMM all for 20 us;
    # copies cost no SM time.
    assert cupti.sm_seconds(events, 132) == pytest.approx(25e-6 + 20e-6)


def test_roles_name_collective_and_layout_kernels():
    events = cupti.events_from_chrome(_trace())
    roles = timeline.roles(events)
    assert roles["accumulate"] == 50.0 and roles["compute"] == 20.0 and roles["copy"] == 400.0
    assert timeline.role({"cat": "kernel", "name": "pack_bf16_f32"}) == "layout"
    assert timeline.role({"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL"}) == "nccl"


def test_same_device_copies_are_told_from_peer_copies():
    raw = _trace()
    raw["traceEvents"].append({"ph": "X", "cat": "gpu_memcpy",
                               "name": "Memcpy DtoD (Device -> Device)", "ts": 3.0, "dur": 70.0,
                               "args": {"stream": 15, "bytes": 1 << 20}})
    events = cupti.events_from_chrome(raw)
    local = cupti.same_device_copies(events)
    assert [e["dur_us"] for e in local] == [70.0]  # not the PtoP copy, not the kernels
    assert cupti.sm_seconds(events, 132) == pytest.approx(25e-6 + 20e-6)  # grid unknown


def test_kernels_keep_their_footprint_per_cta():
    raw = _trace()
    raw["traceEvents"][0]["args"].update({"registers per thread": 40, "shared memory": 0})
    raw["traceEvents"][1]["args"].update({"registers per thread": 168,
                                          "shared memory": 200704})
    by = {e["name"]: e for e in cupti.events_from_chrome(raw)}
    assert (by["tide_accumulate_bf16"]["registers"], by["tide_accumulate_bf16"]["shared_bytes"]) \
        == (40, 0)
    assert (by["big_gemm"]["registers"], by["big_gemm"]["shared_bytes"]) == (168, 200704)
    assert by["Memcpy PtoP"]["registers"] is None  # a copy has no footprint


def _kernel(name, ts, dur, blocks=132, registers=168):
    return {"name": name, "cat": "kernel", "stream": 7, "ts_us": ts, "dur_us": dur,
            "blocks": blocks, "threads": 384, "registers": registers,
            "shared_bytes": 200704, "bytes": None}


def _copy(name, ts, dur):
    return {"name": name, "cat": "gpu_memcpy", "stream": 9, "ts_us": ts, "dur_us": dur,
            "blocks": None, "threads": None, "registers": None, "shared_bytes": None,
            "bytes": 1 << 20}


def test_gemms_are_grouped_by_the_collectives_sm_work_beside_them():
    from benchmarks.harness.interference import describe, pool, split_gemms

    # Alone: the GEMM's main kernel (100 us) and a short epilogue kernel of its own.
    alone = [_kernel("gemm", 0, 100), _kernel("gemm_epilogue", 100, 5),
             _kernel("gemm", 200, 102), _kernel("gemm_epilogue", 302, 5)]
    beside = [
        _copy("Memcpy PtoP (Device -> Device)", 0, 1000),   # copy engines: not SM work
        _kernel("gemm", 0, 104),                             # clear: copies only
        _kernel("gemm_epilogue", 104, 5),                    # the GEMM's own: not SM work
        _kernel("tide_accumulate_bf16", 150, 100, blocks=66, registers=40),
        _kernel("gemm", 120, 150),                           # 100 of 150 us held
        _kernel("gemm", 280, 110),                           # clear
        _copy("Memcpy DtoD (Device -> Device)", 400, 20),    # run on the SMs
        _kernel("gemm", 390, 120),                           # 20 of 120 us: partial
    ]
    part = split_gemms(alone, beside)
    assert part["gemm"]["name"] == "gemm" and part["gemm"]["registers"] == 168
    assert part["alone"] == [100, 102]
    assert part["clear"] == [104, 110] and part["held"] == [150] and part["partial"] == [120]
    assert list(part["kernels"]) == ["tide_accumulate_bf16"]
    assert part["kernels"]["tide_accumulate_bf16"]["count"] == 1
    assert part["kernels"]["tide_accumulate_bf16"]["blocks"] == 66
    assert part["same_device_copies"] == 1

    both = pool([part, {}, split_gemms(alone, beside[:2])])  # a rank without a GEMM: left out
    assert both["clear"] == {"n": 3, "median_us": 104.0}
    assert both["held"] == {"n": 1, "median_us": 150.0}
    assert both["alone"]["n"] == 4 and both["same_device_copies"] == 1
    line = describe(both)
    assert "half or more 150.0 us (n=1)" in line and "66 CTAs x 384 threads, 40 registers" in line
    assert pool([{}, {}]) is None


def test_the_report_gives_the_gemm_groups_and_the_collectives_time_beside_them():
    import json
    from pathlib import Path

    from benchmarks.harness import report
    from benchmarks.harness.interference import pool, split_gemms
    from benchmarks.harness.tables import Results

    alone = [_kernel("nvjet_gemm", 0, 93)]
    beside = [_kernel("tide_accumulate_bf16", 0, 200, blocks=66, registers=40),
              _kernel("nvjet_gemm", 10, 180), _kernel("nvjet_gemm", 300, 95)]
    traced = pool([split_gemms(alone, beside)])
    recs = [json.loads(line) for line in
            (Path(__file__).resolve().parents[2] / "benchmarks/results/run14/records.jsonl").open()]
    for r in recs:
        if r["suite"] == "interference" and r["impl"] == "tide" and r["metric"].startswith("rs:"):
            r["extra"]["cupti"] = traced
            r["extra"]["collective_beside_s"] = 900e-6  # alone: 785 us in run 14
    res = Results(recs)
    text = report.render(res, [])
    assert "### The GEMM kernel under CUPTI" in text
    assert "| tide" in text and "180.0 (1)" in text and "95.0 (1)" in text
    assert "### The collective's own time per call" in text and "| 785 -> 900" in text
