"""tests/tools/ncu_source_report.py on a real profile: an `ncu` source-page export of the fp8 D=128 forward
(tests/data/ncu_fp8_d128_sass.csv.gz, 4096 CTAs of two consumer warpgroups, 32 key tiles each, the
first peeled: 31 loop iterations a warp)."""

import importlib.util
import sys
from pathlib import Path

import pytest

PROFILE = Path(__file__).parent / "data" / "ncu_fp8_d128_sass.csv.gz"


def _tool():
    path = Path(__file__).parent / "tools" / "ncu_source_report.py"
    spec = importlib.util.spec_from_file_location("ncu_source_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report():
    tool = _tool()
    return tool, tool.read(str(PROFILE))


def test_columns_line_up_with_the_samples(report):
    _, instructions = report
    assert len(instructions) > 5000 and instructions[0].offset == 0
    # every sample has one stall reason, a few reasons (of wgmma) are not exported: never more reasons than samples
    assert all(sum(i.stalls.values()) <= i.samples for i in instructions)
    exact = sum(sum(i.stalls.values()) == i.samples for i in instructions)
    assert exact >= 0.99 * len(instructions)


def test_the_key_loops_are_the_two_consumer_regions(report):
    tool, instructions = report
    found = tool.regions(instructions)
    loops = [r for r in found if r.executed == 4096 * 4 * 31]  # CTAs x warps of a warpgroup x iterations
    assert len(loops) == 2  # one per consumer warpgroup, each with its untaken masked branch inside
    for loop in loops:
        ops = [i.opcode for i in loop.instructions if i.executed]
        assert ops.count("QGMMA") == 12 and ops.count("MUFU") == 130
        assert any(i.executed == 0 for i in loop.instructions)
    hottest = tool.hottest_product_loop(found)
    assert hottest in loops and hottest.samples == max(r.samples for r in loops)
    shares = tool.opcode_shares(hottest)
    assert shares[0][0] == "MUFU" and abs(sum(s for _, _, s in shares) - 1) < 1e-9
    assert tool.stall_shares(hottest)[0][0] == "wait"


def test_regions_keep_unexecuted_instructions_in_the_run(report):
    tool, _ = report
    make = lambda off, ex: tool.Instruction(off, "FADD R1, R2, R3", 1, ex, {})  # noqa: E731
    found = tool.regions([make(0, 5), make(16, 7), make(32, 0), make(48, 7), make(64, 5)])
    assert [(r.executed, len(r.instructions)) for r in found] == [(5, 1), (7, 3), (5, 1)]


def test_the_cli_details_a_range(report, capsys):
    tool, _ = report
    assert tool.main([str(PROFILE), "--range", "4330", "7db0", "--listing", "--min-samples", "1000"]) == 0
    out = capsys.readouterr().out
    assert "region 04330-07db0" in out and "FENCE.VIEW.ASYNC.S" in out and "MUFU" in out
