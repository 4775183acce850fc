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
