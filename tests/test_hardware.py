import json

import pytest

from graphopt import hardware
from graphopt.hardware import SPECS, get_spec, spec_for_device_name


def test_every_spec_has_positive_rates():
    for key, spec in SPECS.items():
        assert spec.bf16_flops > 0 and spec.memory_bandwidth > 0 and spec.launch_overhead_s > 0, key
        assert spec.matrix_ceiling < spec.bf16_flops or not spec.is_gpu


def test_h200_has_h100_compute_and_more_bandwidth():
    assert SPECS["h200"].bf16_flops == SPECS["h100"].bf16_flops
    assert SPECS["h200"].memory_bandwidth > SPECS["h100"].memory_bandwidth


def test_device_name_detection_prefers_h200_over_h100():
    assert spec_for_device_name("NVIDIA H200") is SPECS["h200"]
    assert spec_for_device_name("NVIDIA H100 80GB HBM3") is SPECS["h100"]
    assert spec_for_device_name("NVIDIA GeForce RTX 3060") is SPECS["rtx3060"]
    assert spec_for_device_name("NVIDIA H100 PCIe") is SPECS["h100_pcie"]  # 2.0 TB/s, not the SXM part's 3.35
    assert spec_for_device_name("Some Other GPU") is None


def test_every_spec_is_a_valid_target():
    from graphopt.config import TARGETS

    assert set(TARGETS) == {"auto", *SPECS}


def test_target_overrides_detection_and_rejects_unknown():
    assert get_spec("rtx3060") is SPECS["rtx3060"]
    with pytest.raises(ValueError, match="valid choices"):
        get_spec("h300")


def test_calibration_round_trip_sets_measured_ceilings(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    hardware.save_calibration("NVIDIA H100 80GB HBM3", {"bf16_flops": 700e12, "memory_bandwidth": 2.9e12,
                                                         "launch_overhead_s": 5e-6})
    stored = json.loads((tmp_path / "calibration.json").read_text())
    assert "NVIDIA H100 80GB HBM3" in stored
    spec = hardware._with_calibration(SPECS["h100"], "NVIDIA H100 80GB HBM3")
    assert spec.calibrated and spec.matrix_ceiling == 700e12 and spec.memory_ceiling == 2.9e12
    assert spec.launch_overhead == 5e-6
    assert not hardware._with_calibration(SPECS["h100"], "NVIDIA H200").calibrated


@pytest.mark.parametrize("content", [
    "[1, 2, 3]",  # not a table
    '{"NVIDIA H100 80GB HBM3": [1]}',  # not an entry
    '{"NVIDIA H100 80GB HBM3": {"bf16_flops": "7e14", "memory_bandwidth": NaN, "launch_overhead_s": -1}}',
    "{not json",
])
def test_a_damaged_calibration_file_falls_back_to_the_datasheet(tmp_path, monkeypatch, caplog, content):
    """The calibration file is read on every GPU compile, outside any pass: a damaged one used to
    raise (AttributeError, TypeError) or feed NaN / negative ceilings to the cost model. Invalid
    values are now dropped with a warning, and saving over a damaged file starts a new table."""
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    (tmp_path / "calibration.json").write_text(content)
    hardware._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="graphopt"):
        spec = hardware._with_calibration(SPECS["h100"], "NVIDIA H100 80GB HBM3")
    assert not spec.calibrated and spec.memory_ceiling == SPECS["h100"].memory_ceiling
    assert spec.launch_overhead == SPECS["h100"].launch_overhead_s
    if content.startswith('{"NVIDIA H100 80GB HBM3": {'):
        assert "no valid (finite, positive) bf16_flops, launch_overhead_s, memory_bandwidth" in caplog.text
    hardware.save_calibration("NVIDIA H100 80GB HBM3", {"bf16_flops": 700e12, "memory_bandwidth": 2.9e12,
                                                         "launch_overhead_s": 5e-6})
    assert hardware._with_calibration(SPECS["h100"], "NVIDIA H100 80GB HBM3").matrix_ceiling == 700e12


def test_an_unknown_gpu_is_named_as_priced_on_placeholder_rates(tmp_path, monkeypatch, caplog):
    """Decision reasons quote the spec's name: for a GPU graphopt has no rates for, the name says the
    ceilings are placeholders, and a warning says how to measure them."""
    import types

    import torch

    props = types.SimpleNamespace(name="NVIDIA L40S", L2_cache_size=96 * 2**20, multi_processor_count=142,
                                  shared_memory_per_multiprocessor=100 * 1024, major=8, minor=9)
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    hardware._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="graphopt"):
        spec = hardware.detect()
    assert spec.name == "NVIDIA L40S (placeholder rates: run graphopt calibrate)" and spec.sm_count == 142
    assert "no datasheet rates for 'NVIDIA L40S'" in caplog.text and "target=" in caplog.text
    hardware.save_calibration("NVIDIA L40S", {"bf16_flops": 300e12, "memory_bandwidth": 0.8e12, "launch_overhead_s": 8e-6})
    calibrated = hardware.detect()
    assert calibrated.name == "NVIDIA L40S" and calibrated.calibrated and calibrated.host_op_overhead == 8e-6


def test_device_spec_is_cached_until_a_calibration_is_saved(tmp_path, monkeypatch):
    """The kernel launchers ask for the device's spec on every call: device_spec detects once per
    device, and saving a calibration makes the next call detect again (with the new ceilings)."""
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_detect(device=None):
        calls.append(device)
        return hardware._with_calibration(SPECS["h100"], "NVIDIA H100 80GB HBM3")

    monkeypatch.setattr(hardware, "detect", fake_detect)
    hardware.device_spec.cache_clear()
    try:
        first = hardware.device_spec(0)
        assert hardware.device_spec(0) is first and calls == ["cuda:0"]
        assert not first.calibrated
        hardware.save_calibration("NVIDIA H100 80GB HBM3", {"bf16_flops": 700e12, "memory_bandwidth": 2.9e12,
                                                             "launch_overhead_s": 5e-6})
        again = hardware.device_spec(0)
        assert calls == ["cuda:0", "cuda:0"] and again.calibrated and again.memory_ceiling == 2.9e12
    finally:
        hardware.device_spec.cache_clear()


def test_auto_target_follows_the_device_of_the_graph_inputs():
    """A model run on the CPU of a GPU host is priced as a CPU model, not as the GPU beside it."""
    import torch

    from graphopt.hardware import detect

    assert get_spec("auto", [torch.ones(2), 3]) is SPECS["cpu"]
    assert get_spec("auto", []).name == detect().name  # nothing to go by: the present device
    assert get_spec("h100", [torch.ones(2)]).name == SPECS["h100"].name  # a named target stays named
    if torch.cuda.is_available():
        assert get_spec("auto", [torch.ones(2, device="cuda")]).name == detect().name
