"""explore-fft on CPU at tiny sizes: report lines, analysis, JSON, plot, plan."""

import argparse
import json

from graphopt import fft_explorer
from graphopt.plan import load_plan


def test_explorer_cpu_small(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    fft_explorer.add_arguments(parser)
    args = parser.parse_args(["--quick", "--device", "cpu", "--hidden", "64", "--intermediate", "96", "--layers", "0", "3",
                              "--block-sizes", "16", "32", "--ks", "1", "2", "--runs", "3", "--warmup", "1",
                              "--seq-len", "4", "--out", str(tmp_path), "--plan", str(tmp_path / "plan.json")])
    assert fft_explorer.run(args) == 0
    text = capsys.readouterr().out
    assert "layer   0 down_proj" in text and "predicted" in text and "Cost model agreement" in text
    assert "timed once" in text
    data = json.loads((tmp_path / "explore_fft_quick_4tok.json").read_text())
    assert len(data["rows"]) == 2 * 2 * 4  # layers x matrices x combos
    row = data["rows"][0]
    assert row["dense_ms"] > 0 and row["fft_ms"] > 0 and row["predicted_speedup"] > 0
    assert set(data["analysis"]["success_rate"]) == {"B=16,K=1", "B=16,K=2", "B=32,K=1", "B=32,K=2"}
    assert (tmp_path / "explore_fft_quick_4tok.png").stat().st_size > 1000
    assert "suggested" in load_plan(tmp_path / "plan.json")["fft_linear"]


def test_analysis_groups_layer_ranges():
    rows = []
    for layer in (0, 1, 2):
        for b, sp in ((16, 1.5 if layer < 2 else 0.5), (32, 1.2 if layer < 2 else 0.8)):
            rows.append({"layer": layer, "matrix": "up_proj", "block_size": b, "k": 2, "speedup": sp, "faster": sp > 1,
                         "predicted_faster": True, "projection_rel_error": None, "tokens": 4})
    a = fft_explorer.analyze(rows)
    assert a["success_rate"]["B=16,K=2"] == {"faster": 2, "total": 3}
    assert a["suggested"] == [{"matrix": "up_proj", "layer_start": 0, "layer_end": 1, "block_size": 16, "k": 2,
                               "measured_speedup": 1.5, "tokens": 4}]
    assert a["no_winner"][0]["layer_start"] == 2
    assert a["agreement"] == {"agree": 4, "total": 6, "rate": 4 / 6}
