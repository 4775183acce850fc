"""The cost model's per-GPU data files (graphopt/cost/data/*.json) and how the estimates read them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import graphopt
from graphopt import cost_model as cm
from graphopt.cost import coefficients
from graphopt.cost import all_reduce, fft_chain, fp4, q4
from graphopt.cost import sparse_attention as sparse_cost
from graphopt.hardware import SPECS

ROOT = Path(__file__).resolve().parents[2]
NEVER_MEASURED = ("a100", "rtx3060", "rtx4090", "h100_pcie", "cpu")


def test_each_measured_gpu_has_a_file_with_the_same_coefficients():
    assert coefficients.measured_gpus() == ("h100", "h200")
    h100, h200 = coefficients.load("h100"), coefficients.load("h200")
    assert set(h100.values) == set(h200.values)
    assert len(h100.values) >= 50


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_every_coefficient_names_the_run_it_came_from(gpu):
    """measured_on is a measured GPU; source is a committed result file (or null where the run's
    output was not kept, which the fit text says); command runs a script of the checkout."""
    for name, entry in coefficients.load(gpu).entries.items():
        assert entry["measured_on"] in coefficients.measured_gpus(), name
        if entry["source"] is None:
            assert "not kept" in entry["fit"], name
        else:
            assert (ROOT / entry["source"]).is_file(), (name, entry["source"])
            assert entry["source"].startswith("bench/results/") and entry["measured_on"] in Path(entry["source"]).name
        # python or torchrun (with its options), after any environment settings
        script = re.match(r"(?:[A-Z_]+=\S+ )*(?:python|torchrun(?: --[\w-]+ \S+)*) (\S+\.py)", entry["command"])
        assert script and (ROOT / script.group(1)).is_file(), (name, entry["command"])
        assert len(entry["fit"]) > 20, name


def test_every_h200_coefficient_is_fitted_there_or_says_why_not():
    """An h200.json entry is measured on the H200, from a committed H200 result file, or it is the
    H100 value carried over with the reason no H200 run could refit it (not_refit)."""
    carried = 0
    for name, entry in coefficients.load("h200").entries.items():
        if entry["measured_on"] == "h200":
            assert "not_refit" not in entry, name
            assert entry["source"] and (ROOT / entry["source"]).is_file() and "h200" in Path(entry["source"]).name, name
        else:
            carried += 1
            assert entry["measured_on"] == "h100", name
            assert len(entry.get("not_refit", "")) > 40, (name, "an H100 value in h200.json needs its not_refit reason")
    assert 0 < carried < len(coefficients.load("h200").entries)


class _Recording(dict):
    """The values mapping of a Coefficients, noting each name read."""

    read: set = set()

    def __getitem__(self, name):
        _Recording.read.add(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        _Recording.read.add(name)
        return super().get(name, default)


def _estimate_everything(hw) -> None:
    """Every estimate family on `hw`, over paths that read every coefficient."""
    for tokens in (1, 2, 16, 64, 4096):
        for k, n in ((4096, 4096), (5120, 13824)):
            cm.linear(hw, tokens, k, n)
            for path in ("gemv", "gemm", "dequant"):
                fp4.estimate_fp4_linear(hw, tokens, k, n, path=path)
            q4.predict_linear(hw, tokens, k, n)
            for impl in fft_chain.IMPLEMENTATIONS:
                fft_chain.estimate_fft_chain(hw, tokens, k, n, 512, 2, impl)
    for lq, lk in ((1, 8192), (4096, 4096)):
        for family in ("triton_flash", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"):
            cm.fused_attention(hw, 1, 32, lq, lk, 128, family=family, kv_heads=8)
        cm.naive_attention(hw, 1, 32, lq, lk, 128)
        cm.decode_attention(hw, 1, 32, 1, lk, 128, kv_heads=8)
        sparse_cost.estimate_sparse_attention(hw, 1, 32, 32, lk, lk, 128, causal=True, sparsity=0.5)
    for impl in all_reduce.IMPLEMENTATIONS:
        all_reduce.estimate_all_reduce(hw, 8192, 2, impl)
    cm.attention_op_host_launches(hw, "triton"), cm.attention_op_host_launches(hw, "cudnn")
    cm.sparse_attention_op_host_launches(hw)
    for family in cm.kernel_families(hw):
        cm.family_efficiency(hw, family)


def test_the_estimates_read_every_coefficient_of_the_file(monkeypatch):
    """No coefficient in a data file is dead, and none the code reads is missing (a missing one
    raises KeyError naming the file)."""
    base = coefficients.load("h100")
    recording = coefficients.Coefficients(base.gpu, base.path, _Recording(base.values), base.entries)
    monkeypatch.setattr(coefficients, "for_hardware", lambda hw: recording)
    _Recording.read = set()
    _estimate_everything(SPECS["h100"])
    assert _Recording.read == set(base.values), set(base.values) - _Recording.read


def test_a_missing_coefficient_is_a_clear_error():
    table = coefficients.load("h100")
    with pytest.raises(KeyError, match=r"h100\.json has no cost-model coefficient 'fp4\.nonexistent'"):
        table["fp4.nonexistent"]
    with pytest.raises(ValueError, match="valid choices: h100, h200"):
        coefficients.load("rtx3060")
    with pytest.raises(ValueError, match="unknown kernel family 'warp_drive'; valid choices: .*cublas_gemm"):
        cm.family_efficiency(SPECS["h100"], "warp_drive")


@pytest.mark.parametrize("problem,message", [
    ({"value": "fast", "measured_on": "h100", "source": None, "command": "python x.py", "fit": "f"}, "expected a finite number"),
    ({"value": [1.0, float("nan")], "measured_on": "h100", "source": None, "command": "python x.py", "fit": "f"},
     "expected a finite number"),
    ({"value": 1.0, "measured_on": "h100", "command": "python x.py"}, "lacks source, fit"),
])
def test_a_damaged_data_file_is_refused_with_the_entry_named(tmp_path, monkeypatch, problem, message):
    doc = json.loads((coefficients.DATA_DIR / "h100.json").read_text())
    doc["coefficients"]["gemm.partial_overlap"] = problem
    (tmp_path / "h100.json").write_text(json.dumps(doc))
    monkeypatch.setattr(coefficients, "DATA_DIR", tmp_path)
    coefficients.load.cache_clear()
    try:
        with pytest.raises(ValueError, match=rf"gemm\.partial_overlap.*{message}"):
            coefficients.load("h100")
    finally:
        coefficients.load.cache_clear()


def test_measured_gpus_read_their_own_file_and_others_are_unvalidated():
    for gpu in ("h100", "h200"):
        assert coefficients.for_hardware(SPECS[gpu]).gpu == gpu
        assert coefficients.validated(SPECS[gpu])
        assert "unvalidated" not in coefficients.describe(SPECS[gpu])
    for target in NEVER_MEASURED:
        hw = SPECS[target]
        assert coefficients.for_hardware(hw).gpu == coefficients.FALLBACK_GPU
        assert not coefficients.validated(hw)
        text = coefficients.describe(hw)
        assert text.startswith(f"cost model for {hw.name}: unvalidated")
        assert ("graphopt/cost/data/h100.json" in text) == hw.is_gpu


def test_with_values_changes_one_variant_and_leaves_the_spec_alone():
    hw = SPECS["h100"]
    before = fp4.estimate_fp4_linear(hw, 16, 5120, 13824, path="gemv").ms
    slower = coefficients.with_values(hw, {"fp4.tma_decode_ops_per_weight": 4.6}, "test")
    assert fp4.estimate_fp4_linear(slower, 16, 5120, 13824, path="gemv").ms > before
    assert fp4.estimate_fp4_linear(hw, 16, 5120, 13824, path="gemv").ms == before
    assert coefficients.validated(slower) and coefficients.value(slower, "gemm.partial_overlap") == \
        coefficients.value(hw, "gemm.partial_overlap")
    # another GPU's coefficients on this GPU's rates: the cross-GPU check of the validation script
    h200_rates = coefficients.with_values(SPECS["h200"], coefficients.load("h100").values, "h100 coefficients")
    assert coefficients.for_hardware(h200_rates).values == coefficients.load("h100").values
    with pytest.raises(KeyError, match="unknown cost-model coefficient.*fp4.tma_speed"):
        coefficients.with_values(hw, {"fp4.tma_speed": 1.0}, "bad")


def test_explain_says_when_the_target_was_never_measured():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    for target, validated in (("rtx3060", False), ("h200", True)):
        report = graphopt.explain(model, x, target=target, downstream="eager")
        assert report.cost_model_validated is validated
        assert ("unvalidated" in str(report)) is not validated
        assert SPECS[target].name in str(report)
