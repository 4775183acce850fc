import torch

from graphopt.hardware.timing import COLD_BYTES, cold_copies, cold_graph_ms, copies_for


def test_copies_for_covers_the_cold_set():
    assert copies_for(COLD_BYTES) == 2  # never fewer than two
    assert copies_for(COLD_BYTES // 10) == 10
    assert copies_for(COLD_BYTES // 10 + 1) * (COLD_BYTES // 10 + 1) >= COLD_BYTES


def test_cold_copies_are_distinct_equal_clones():
    codes = torch.randint(0, 255, (64, 32), dtype=torch.uint8)
    scales = torch.randn(64, 4)
    copies = cold_copies((codes, scales))
    assert len(copies) == 16  # tiny weight: capped at max_copies
    assert copies[0][0] is codes and copies[0][1] is scales  # the original is the first set
    for c, s in copies[1:]:
        assert torch.equal(c, codes) and torch.equal(s, scales)
        assert c.data_ptr() != codes.data_ptr() and s.data_ptr() != scales.data_ptr()
    assert len(cold_copies((codes, scales), max_copies=3)) == 3


def test_cold_graph_ms_runs_every_call():
    seen = []
    ms = cold_graph_ms([lambda i=i: seen.append(i) for i in range(4)])
    assert ms >= 0.0 and sorted(seen[-4:]) == [0, 1, 2, 3]


def test_timed_ms_reports_the_spread_of_the_calls():
    """CPU: the median and quartiles of the same calls; a function whose calls alternate between
    about 1 and 3 ms has a spread near 1 (interquartile range / median), a steady one a small one."""
    import itertools
    import time

    from graphopt.hardware.timing import Timing, timed_ms

    durations = itertools.cycle([0.001, 0.003])
    noisy = timed_ms(lambda: time.sleep(next(durations)), rep_ms=60, device="cpu")
    assert noisy.q25_ms <= noisy.median_ms <= noisy.q75_ms
    assert 0.4 < noisy.spread < 2.0, noisy
    steady = timed_ms(lambda: time.sleep(0.002), rep_ms=40, device="cpu")
    assert steady.spread < noisy.spread
    assert Timing(2.0, 1.5, 2.5).spread == 0.5
    assert Timing(0.0, 0.0, 0.0).spread == 0.0


def test_noisy_timings_are_flagged_in_the_ablation_table():
    from rich.console import Console

    from graphopt.ablation import NOISY_SPREAD, VariantResult, noise_warning, results_table

    def result(name, spread):
        return VariantResult(name, [], 1.0, 0.0, 0.0, 0.0, 0.0, speedup_vs_eager=1.0, speedup_vs_inductor=1.0,
                             spread=spread)

    quiet = [result("eager", 0.02), result("inductor", 0.03)]
    assert noise_warning(quiet) is None
    noisy = quiet + [result("graphopt", 4 * NOISY_SPREAD)]
    warning = noise_warning(noisy)
    assert warning.startswith("timings are noisy: the calls of graphopt vary by up to ±20%") and "can flip" in warning
    console = Console(width=200, record=True)
    console.print(results_table(noisy, "t"))
    text = console.export_text()
    assert "spread" in text and "±20%" in text and "±1%" in text
