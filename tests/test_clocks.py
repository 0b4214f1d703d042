"""Clock readings from ``nvidia-smi`` lines: fields the GPU does not report are left
out, and a cut-off line is refused rather than read with fields in the wrong place."""

from __future__ import annotations

import pytest

from tidearray.bench.device import CLOCK_FIELDS, _reading


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
