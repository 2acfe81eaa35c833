"""``experiments/bench/cp_documents.py`` (part of ``make bench``) in its smoke sizes: every table is
filled in, the plans' visible pairs are the ideal, the ring's trace equals its plan, ring and
all-to-all attention agree, and the cp bytes the comm accounting charged are the planner's. No
timing is asserted."""

from __future__ import annotations

import pytest

from experiments.bench import cp_documents


@pytest.mark.slow
def test_cp_documents_bench_smoke_fills_every_table(capsys):
    result = cp_documents.run(smoke=True)
    assert len(result["work"]) == len(cp_documents.MIXES) * len(cp_documents.TILES)
    for row in result["work"]:
        assert row["visible = ideal"] == "yes"
        assert row["computed / visible"] >= 1.0 and 0 < row["computed / causal"] <= 1.0
    assert len(result["checks"]) == len(result["work"])
    assert all(row["trace = plan (fwd, bwd, all ranks)"] == "yes" for row in result["checks"])
    shapes = len(cp_documents.SMOKE["heads_kv"])
    assert len(result["timings"]) == shapes
    for timing in result["timings"]:
        assert timing["trace_matches"]
        assert max(timing["difference"].values()) < 1e-4  # ring and all-to-all: one attention
    cases = len(cp_documents.CASES) * shapes
    assert [row["measured / planner"] for row in result["bytes"]] == [1.0] * cases
    assert [row["cp calls"] for row in result["bytes"]] == [row["planner calls"] for row in result["bytes"]]
    assert len(result["times"]) == cases and all(row["ring s"] > 0 and row["a2a s"] > 0 for row in result["times"])
    out = capsys.readouterr().out
    assert "computed / visible" in out and "a2a / ring" in out
