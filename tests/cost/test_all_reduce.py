"""graphopt.cost.all_reduce: NCCL against the one-shot kernel, held to the in-graph all-reduce
timings its coefficients were fitted to (two ranks), to held-out four-rank timings, and to the data
files' provenance."""

import json
from pathlib import Path

import pytest

from graphopt.cost import all_reduce as cost
from graphopt.cost import coefficients
from graphopt.hardware import SPECS

ROOT = Path(__file__).resolve().parents[2]
NAMES = [f"all_reduce.{impl}_{what}" for impl in cost.IMPLEMENTATIONS for what in ("latency_s", "bytes_per_s")]


def _rows(name: str | None = None) -> list[dict]:
    source = name or coefficients.load("h200").entries[NAMES[0]]["source"]
    return json.loads((ROOT / source).read_text())["rows"]


@pytest.mark.parametrize("impl, column", [("nccl", "nccl_graph_us"), ("one_shot", "one_shot_graph_us")])
def test_fit_regression_predictions_follow_the_two_rank_rows(impl, column):
    rows = _rows()
    assert [(r["tp"], r["bytes"]) for r in rows] == [(2, 8192), (2, 65536), (2, 262144), (2, 2097152)]
    for row in rows:
        predicted_us = cost.estimate_all_reduce(SPECS["h200"], row["bytes"], 2, impl).ms * 1e3
        assert predicted_us == pytest.approx(row[column], rel=0.10), (impl, row)


def test_held_out_four_rank_rows():
    """The rank scaling was fitted on no four-rank row: most of them within 25%, and up to 256 KB
    (a decode step's all-reduces) the one-shot kernel is picked, as measured."""
    rows = _rows("bench/results/all_reduce_h200_tp4.json")
    ratios = []
    for row in rows:
        assert row["tp"] == 4
        predicted = {impl: cost.estimate_all_reduce(SPECS["h200"], row["bytes"], 4, impl).ms * 1e3
                     for impl in cost.IMPLEMENTATIONS}
        ratios += [predicted["nccl"] / row["nccl_graph_us"], predicted["one_shot"] / row["one_shot_graph_us"]]
        if row["bytes"] <= 262144:
            assert row["one_shot_graph_us"] < row["nccl_graph_us"] and predicted["one_shot"] < predicted["nccl"]
    assert sum(0.8 <= r <= 1.25 for r in ratios) >= 7, ratios


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
