"""bench/validate_cost_model.py: the held-out split, the refit, and the committed report."""

from __future__ import annotations

import json
import math

import pytest

from bench import validate_cost_model as vcm
from graphopt.cost import coefficients

FAMILIES = {"fft_chain", "fp4_linear", "q4_linear", "gemm_and_attention", "decode_attention", "sdpa_decode",
            "sparse_attention"}


@pytest.fixture(scope="module")
def report():
    return vcm.validate()


def test_every_fitted_family_is_reported_on_both_gpus(report):
    sweeps = {(r["family"], r["gpu"]) for r in report["sweeps"]}
    assert {f for f, _ in sweeps} == FAMILIES
    for family in FAMILIES:
        assert {(family, "h100"), (family, "h200")} <= sweeps
        for r in report["sweeps"]:
            if r["family"] == family:
                assert r["other_gpu"]["gpu"] != r["gpu"] and r["other_gpu"]["rows"] > 0


def test_held_out_rows_share_neither_a_layer_size_nor_a_token_count_with_the_fit_set():
    sweeps = (vcm.fft_sweeps() + vcm.fp4_sweeps() + vcm.q4_sweeps() + vcm.dense_sweeps() + vcm.decode_sweeps()
              + vcm.sparse_sweeps())
    for sweep in sweeps:
        fit = [r for r in sweep.rows if sweep.split(r) == "fit"]
        held = [r for r in sweep.rows if sweep.split(r) == "held_out"]
        assert fit and held, (sweep.family, sweep.gpu)
        assert not {r.layer for r in fit} & {r.layer for r in held}, (sweep.family, sweep.gpu)
        assert not {r.size for r in fit} & {r.size for r in held}, (sweep.family, sweep.gpu)
        # every refit name is a coefficient the data file has, and one the sweep's predictions depend on
        table = coefficients.for_hardware(sweep.hw).values
        for name in sweep.refit:
            value = vcm._get(table, name)
            moved = [coefficients.with_values(sweep.hw, vcm._apply(table, name, value * f), f"probe {f}")
                     for f in (0.5, 2)]
            assert any(sweep.predict(hw, r) != sweep.predict(sweep.hw, r) for hw in moved for r in sweep.rows), \
                (sweep.family, name)


def test_sdpa_decode_sweep_checks_its_fit_at_cache_lengths_it_was_not_fitted_on():
    """Both batches are needed to fit SDPA's decode coefficients (batch 1 binds the step, batch 8 the
    streaming rate), so its other rows are partly held out: other cache lengths, the same batches."""
    for sweep in vcm.sdpa_decode_sweeps():
        fit = [r for r in sweep.rows if sweep.split(r) == "fit"]
        other = [r for r in sweep.rows if sweep.split(r) == "partly_held_out"]
        assert len(fit) == 4 and len(other) == 4, sweep.gpu
        assert not {r.size for r in fit} & {r.size for r in other}
        table = coefficients.for_hardware(sweep.hw).values
        for name in sweep.refit:
            moved = coefficients.with_values(sweep.hw, vcm._apply(table, name, vcm._get(table, name) * 2), "probe")
            assert any(sweep.predict(moved, r) != sweep.predict(sweep.hw, r) for r in sweep.rows), name


def test_refit_lowers_the_fit_error_and_changes_only_the_sweeps_coefficients():
    sweep = vcm.fft_sweeps()[0]
    fit_rows = [r for r in sweep.rows if sweep.split(r) == "fit"]
    shipped = dict(coefficients.for_hardware(sweep.hw).values)
    refit = vcm.refit(sweep, fit_rows)
    changed = {n for n in shipped if refit[n] != shipped[n]}
    assert changed and changed <= set(sweep.refit)
    before = vcm._objective(sweep, sweep.hw, fit_rows)
    after = vcm._objective(sweep, coefficients.with_values(sweep.hw, refit, "test"), fit_rows)
    assert after < before
    for name in changed:
        assert 0.25 - 1e-9 <= refit[name] / shipped[name] <= 4 + 1e-9


def test_score_counts_times_within_25_percent_and_ranked_pairs():
    row = vcm.Row("a", 1, {"x": 1.0, "y": 2.0, "z": 2.05})
    sweep = vcm.Sweep("t", "h100", [], "", None, [row], lambda hw, r: {"x": 1.2, "y": 1.1, "z": 3.0}, [],
                      (set(), set()), (set(), set()))
    m = vcm.score(sweep, None, [row])
    # x within 25% (1.2), y off (0.55), z off (1.46); pairs: x<y wrong, x<z right, y~z a tie (2.5%)
    assert m["times"] == 3 and m["within_25pct"] == pytest.approx(1 / 3)
    assert m["pairs"] == 2 and m["ranked_as_measured"] == 0.5


def test_the_committed_report_is_what_the_script_computes(report):
    """bench/results/cost_model_validation.json (quoted by bench/RESULTS.md) matches the data files
    and result files of this checkout: rerun the script after changing either."""
    committed = json.loads(vcm.OUT.read_text())

    def close(a, b):
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
        if isinstance(a, float) and isinstance(b, float):
            return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
        return a == b

    assert close(json.loads(json.dumps(report["sweeps"])), committed["sweeps"]), "rerun python bench/validate_cost_model.py"


def test_held_out_rankings_agree_with_the_measurements(report):
    """On rows the refit never saw (held out or partly), the model orders the candidates as measured
    on >= 85% of the pairs, on each GPU and across GPUs."""
    for r in report["sweeps"]:
        for subset in ("held_out", "partly_held_out"):
            ranked = r["refit"][subset]["ranked_as_measured"]
            assert ranked is None or ranked >= 0.85, (r["family"], r["gpu"], subset, ranked)
        if "other_gpu" in r:
            assert r["other_gpu"]["ranked_as_measured"] >= 0.8, (r["family"], r["gpu"], r["other_gpu"])
