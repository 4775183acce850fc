"""graphopt.cost.all_reduce: NCCL against the one-shot kernel, held to the in-graph all-reduce
timings its coefficients were fitted to, and to the data files' provenance."""

import json
from pathlib import Path

import pytest

from graphopt.cost import all_reduce as cost
from graphopt.cost import coefficients
from graphopt.hardware import SPECS

ROOT = Path(__file__).resolve().parents[2]
NAMES = [f"all_reduce.{impl}_{what}" for impl in cost.IMPLEMENTATIONS for what in ("latency_s", "bytes_per_s")]


def _rows() -> list[dict]:
    source = coefficients.load("h200").entries[NAMES[0]]["source"]
    return json.loads((ROOT / source).read_text())["rows"]


@pytest.mark.parametrize("impl, column", [("nccl", "nccl_graph_us"), ("one_shot", "one_shot_graph_us")])
def test_predictions_follow_the_measured_rows(impl, column):
    rows = _rows()
    assert [r["bytes"] for r in rows] == [8192, 65536, 262144, 2097152]
    for row in rows:
        predicted_us = cost.estimate_all_reduce(SPECS["h200"], row["bytes"], 2, impl).ms * 1e3
        assert predicted_us == pytest.approx(row[column], rel=0.10), (impl, row)


def test_one_shot_wins_at_two_ranks_and_loses_large_tensors_at_eight():
    h200 = SPECS["h200"]
    for nbytes in (8192, 2**20, 4 * 2**20):
        assert cost.estimate_all_reduce(h200, nbytes, 2, "one_shot").ms < cost.estimate_all_reduce(h200, nbytes, 2, "nccl").ms
    assert cost.estimate_all_reduce(h200, 8192, 8, "one_shot").ms < cost.estimate_all_reduce(h200, 8192, 8, "nccl").ms
    assert cost.estimate_all_reduce(h200, 4 * 2**20, 8, "one_shot").ms > cost.estimate_all_reduce(h200, 4 * 2**20, 8, "nccl").ms
    small = cost.estimate_all_reduce(h200, 8192, 2, "one_shot")
    assert small.bound == "launch" and small.launches == 1


def test_h100_carries_the_h200_figures_and_says_so():
    """No H100 pair was measured: h100.json holds the H200's values with the reason."""
    h100, h200 = coefficients.load("h100"), coefficients.load("h200")
    for name in NAMES:
        assert h100[name] == h200[name]
        assert h200.entries[name]["measured_on"] == "h200" and "not_refit" not in h200.entries[name]
        assert h100.entries[name]["measured_on"] == "h200"
        assert "no H100 pair was measured" in h100.entries[name]["not_refit"]


def test_bad_arguments_name_the_valid_choices():
    with pytest.raises(ValueError, match="unknown all-reduce implementation 'ring'; valid choices: nccl, one_shot"):
        cost.estimate_all_reduce(SPECS["h200"], 8192, 2, "ring")
    with pytest.raises(ValueError, match="at least one rank"):
        cost.estimate_all_reduce(SPECS["h200"], 8192, 0, "nccl")
