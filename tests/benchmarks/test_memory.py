"""``python -m benchmarks.memory``: the reduce-scatter's buffers stay flat across nodes,
``layout.memory_report`` reads the plans, and docs/memory.md's section is what the
planner gives. CPU only, one process."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks import memory
from tests.support import units
from tidearray import TideInvalid
from tidearray._schedule import plan_reduce_scatter
from tidearray._topology import Topology
from tidearray.layout import memory_report, plan_unit

ROOT = Path(__file__).resolve().parents[2]
SCALING = memory.Settings(ranks=(16, 32, 64, 128, 512), local_size=8)
UNITS = {u.name: u for u in units()}


@pytest.mark.parametrize("name", ["llama3.1-70b", "qwen3-30b-a3b", "wan2.2-dit"])
def test_tide_rs_buffers_stay_flat_while_stock_grows(name):
    """At a fixed output per rank, 2 to 64 nodes: TIDE's reduce-scatter buffers are
    bounded by the chunk and the depth, FSDP2's fp32 input by the unit."""
    rows = memory.rows(UNITS[name], SCALING)
    assert [r.nodes for r in rows] == [2, 4, 8, 16, 64]
    totals = [r.report.rs_nbytes for r in rows]
    assert max(totals) <= 1.10 * min(totals), totals
    assert memory.spread(rows) <= 0.10
    assert rows[-1].report.stock_rs_input > 20 * rows[0].report.stock_rs_input


def test_the_page_section_is_not_stale():
    assert not memory.stale(str(ROOT)), f"{memory.PAGE} is stale: run `{memory.COMMAND} --write`"
    assert memory.main(["--check", "--root", str(ROOT)]) == 0


def test_an_edited_number_is_caught_and_write_mends_it(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / memory.PAGE
    shutil.copy(ROOT / memory.PAGE, page)
    text = page.read_text()
    page.write_text(text.replace("| 608.0 |", "| 609.0 |", 1))
    assert memory.main(["--check", "--root", str(tmp_path)]) == 1
    assert memory.main(["--write", "--root", str(tmp_path)]) == 0
    assert page.read_text() == text


def test_write_and_check_refuse_what_if_options():
    with pytest.raises(SystemExit):
        memory.main(["--check", "--depth", "1"])


def test_memory_report_reads_the_plans():
    shapes, world, local = [(300, 40), (17,), (5, 3, 8)], 8, 2
    r = memory_report(shapes, 2, world, local, chunk_nbytes=4096, depth=2)
    unit = plan_unit(shapes, 2, world)
    plan = plan_reduce_scatter(unit, Topology(world, 0, local), 4096, 2)
    assert len(plan.chunks) > 2 and plan.num_nodes == 4
    assert (r.slot, r.staging, r.partial, r.receive, r.output) == (
        unit.nbytes, plan.local_nbytes, plan.partial_nbytes, plan.receive_nbytes,
        plan.block_numel * 4)
    assert r.rs_nbytes == plan.staging_nbytes and r.partial > 0 and r.receive > 0
    # FSDP2 pads every parameter to rows_per_shard * world rows: 38, 3 and 1 rows here
    padded = (38 * 8 * 40) + (3 * 8) + (1 * 8 * 24)
    assert r.stock_ag_output == 2 * padded and r.stock_rs_input == 4 * padded
    assert r.stock_ag_input == 2 * padded // world and r.stock_rs_output == 4 * padded // world


def test_memory_report_on_one_node_has_no_inter_node_buffers():
    r = memory_report(UNITS["llama3.1-8b"].shapes, 2, 8, 8)
    assert r.partial == r.receive == 0
    # Two chunks, evened out: under the bound of two full buffers of 7 sources.
    assert r.staging == r.rs_nbytes < 2 * 7 * (32 << 20)
    r = memory_report(UNITS["llama3.1-70b"].shapes, 2, 8, 8)  # many chunks: full buffers
    assert r.partial == r.receive == 0
    assert r.staging == r.rs_nbytes == 2 * 7 * (32 << 20)


def test_memory_report_refuses_what_the_planner_refuses():
    with pytest.raises(TideInvalid):
        memory_report([(8, 8)], 2, 6, 4)
    with pytest.raises(TideInvalid):
        memory_report([(8, 8)], 2, 0, 1)
    with pytest.raises(TideInvalid):
        memory_report([(8, 8)], 2, 4, 2, depth=0)
