"""Clock readings from ``nvidia-smi`` lines: fields the GPU does not report are left
out, and a cut-off line is refused rather than read with fields in the wrong place."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks.harness.device import CLOCK_FIELDS, _reading


def test_a_full_line_gives_every_field():
    got = _reading("1980, 2619, 512.34, 45, 700.00")
    assert got == {"sm_mhz": 1980.0, "mem_mhz": 2619.0, "power_w": 512.34, "temp_c": 45.0,
                   "power_limit_w": 700.0}
    assert len(got) == len(CLOCK_FIELDS)


def test_fields_not_reported_are_left_out():
    assert _reading("1410, 2619, [N/A], 38, [Not Supported]") == {
        "sm_mhz": 1410.0, "mem_mhz": 2619.0, "temp_c": 38.0}


def test_a_cut_off_line_is_refused():
    with pytest.raises(ValueError):
        _reading("1980, 26")


def _wait_for_output(log, nbytes: int, limit_s: float = 120.0) -> None:
    """Until the stand-in has written ``nbytes`` (polled: how long its start takes depends
    on the machine's load; the limit is for a stand-in that never writes)."""
    deadline = time.monotonic() + limit_s
    while os.fstat(log._file.fileno()).st_size < nbytes:
        assert time.monotonic() < deadline, f"the stand-in wrote under {nbytes} bytes"
        time.sleep(0.05)


def test_a_clock_log_reads_lines_until_closed_and_stops_its_process(monkeypatch):
    import sys

    from benchmarks.harness import device

    stand_in = ("import sys, time\n"
                "while True:\n"
                "    print('1980, 2619, 512.3, 45, 700.00', flush=True)\n"
                "    time.sleep(0.02)\n")
    monkeypatch.setattr(device, "_smi_args", lambda dev: [sys.executable, "-c", stand_in])
    log = device.ClockLog(0, period_ms=20)
    proc = log._proc
    _wait_for_output(log, 3 * 30)  # three lines
    readings = log.close()
    assert readings and all(r["sm_mhz"] == 1980.0 for r in readings)
    assert proc.poll() is not None  # the process is gone
    assert log.close() == []


def test_a_clock_log_keeps_every_reading_of_a_long_run(monkeypatch):
    """More output than a pipe buffer holds (64 KiB) must neither stall nor be lost."""
    import sys

    from benchmarks.harness import device

    lines = 4000  # about 130 KB
    stand_in = ("import sys, time\n"
                f"sys.stdout.write('1980, 2619, 512.3, 45, 700.00\\n' * {lines})\n"
                "sys.stdout.flush()\n"
                "time.sleep(60)\n")
    monkeypatch.setattr(device, "_smi_args", lambda dev: [sys.executable, "-c", stand_in])
    log = device.ClockLog(0)
    _wait_for_output(log, lines * 30)
    assert len(log.close()) == lines
