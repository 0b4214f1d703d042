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


def test_the_report_gives_the_collectives_time_beside_the_gemms():
    import json
    from pathlib import Path

    from benchmarks.harness import report
    from benchmarks.harness.tables import Results

    recs = [json.loads(line) for line in
            (Path(__file__).resolve().parents[2] / "benchmarks/results/run14/records.jsonl").open()]
    for r in recs:
        if r["suite"] == "interference" and r["impl"] == "tide" and r["metric"].startswith("rs:"):
            r["extra"]["collective_beside_s"] = 900e-6  # alone: 785 us in run 14
    res = Results(recs)
    text = report.render(res)
    assert "### The collective's own time per call" in text and "| 785 -> 900" in text


def test_busy_counts_overlapping_work_once_and_the_gaps_as_waiting():
    events = [{"ts_us": 0.0, "dur_us": 10.0}, {"ts_us": 5.0, "dur_us": 10.0},  # 0-15
              {"ts_us": 40.0, "dur_us": 5.0},  # a gap of 25 before it
              {"ts_us": 41.0, "dur_us": 2.0},  # inside the one before
              {"ts_us": 60.0, "dur_us": 40.0}]  # 60-100
    busy, span = timeline.busy(list(reversed(events)))  # any order
    assert busy == 15.0 + 5.0 + 40.0 and span == 100.0
