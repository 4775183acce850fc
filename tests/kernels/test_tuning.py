"""The tuners' check of a tile's output against the reference product (graphopt.kernels.tuning)."""

import pytest
import torch

from graphopt.kernels import tuning


def _product(seed: int, m: int = 16, n: int = 200, k: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g, dtype=torch.float64) @ torch.randn(n, k, generator=g, dtype=torch.float64).T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_output_rounded_to_its_dtype_computes_the_product(dtype):
    reference = _product(1)
    summed_in_fp32 = reference.float()  # one rounding per element, as an fp32 accumulator's final sum
    assert tuning.computes_product(summed_in_fp32.to(dtype), reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_scaled_or_non_finite_output_does_not(dtype):
    reference = _product(2)
    assert not tuning.computes_product((reference * 1.5).to(dtype), reference)
    assert not tuning.computes_product((reference * (1 + 2**-5)).to(dtype), reference)
    broken = reference.to(dtype)
    broken[3, 7] = float("nan")
    assert not tuning.computes_product(broken, reference)
    broken[3, 7] = float("inf")
    assert not tuning.computes_product(broken, reference)


def test_fp32_output_is_held_to_fp32_and_a_stated_rounding_widens_it():
    """A product rounded through bf16 is not an fp32 one, unless the kernel states that rounding."""
    reference = _product(3)
    through_bf16 = reference.to(torch.bfloat16).float()
    assert tuning.computes_product(through_bf16.to(torch.bfloat16), reference)
    assert not tuning.computes_product(through_bf16, reference)
    assert tuning.computes_product(through_bf16, reference, extra_rtol=2**-8)


def test_the_candidates_fingerprint_changes_when_a_tile_is_offered_or_dropped():
    """The tuners put it in their stored keys: a choice made among other tiles is not reused."""
    from graphopt.kernels import fp4, q4

    tiles = q4.persistent_configs(1)
    assert tuning.candidates_tag(tiles) == tuning.candidates_tag(list(tiles))
    assert tuning.candidates_tag(tiles) != tuning.candidates_tag(tiles[:-1])
    assert tuning.candidates_tag(tiles) != tuning.candidates_tag(q4.persistent_configs(2))
    assert tuning.candidates_tag(fp4.DECODE_CONFIGS) != tuning.candidates_tag(fp4.DECODE_CONFIGS[1:])
    assert len(tuning.candidates_tag([])) == 8


def test_the_stored_keys_change_with_the_kernels_source(tmp_path):
    """A kernel edited without a version change is tuned again: the kernels' fingerprint is part of
    every stored key."""
    (tmp_path / "family").mkdir()
    (tmp_path / "family" / "kernel.py").write_text("TILE = 1\n")
    (tmp_path / "launch.py").write_text("x = 0\n")
    before = tuning.kernels_fingerprint(tmp_path)
    assert tuning.kernels_fingerprint(tmp_path) == before
    (tmp_path / "family" / "kernel.py").write_text("TILE = 2\n")
    edited = tuning.kernels_fingerprint(tmp_path)
    assert edited != before
    (tmp_path / "family" / "kernel.py").rename(tmp_path / "family" / "other.py")  # same bytes, other file
    assert tuning.kernels_fingerprint(tmp_path) not in (before, edited)
    assert f"|kernels {tuning.kernels_fingerprint(tuning.KERNELS_DIR)}" in tuning.software_key()
