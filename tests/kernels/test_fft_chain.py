"""FFT-chain layer: dense equivalence, projection, gradients, distillation, Triton kernels."""

import pytest
import torch

import graphopt  # noqa: F401  (registers graphopt::fft_chain_linear)
from graphopt.kernels import fft_chain as fft

# (in, out, B, K): divisible sizes, and odd sizes that B does not divide (zero padding)
SHAPES = [(64, 32, 16, 1), (64, 48, 16, 2), (40, 56, 16, 3), (30, 20, 8, 4)]


def _explicit_dense(layer: fft.FFTChainLinear) -> torch.Tensor:
    """sum_k BC(C_k) P_k built from explicit circulant blocks (no FFT)."""
    dense = torch.zeros(layer.out_features, layer.in_features, dtype=torch.float64)
    for k in range(layer.k):
        bc = fft.block_circulant_dense(layer.coeffs[k].detach().double())[: layer.out_features, : layer.in_features]
        channel = torch.zeros_like(dense)
        channel[:, layer.perms[k]] = bc  # column a multiplies (P_k x)_a = x[perm_k[a]]
        dense += channel
    return dense


@pytest.mark.parametrize("in_f,out_f,b,k", SHAPES)
def test_dense_equivalent_is_sum_of_permuted_block_circulants(in_f, out_f, b, k):
    torch.manual_seed(0)
    layer = fft.FFTChainLinear(in_f, out_f, b, k, seed=3)
    dense = layer.to_dense()  # materialized on the identity
    torch.testing.assert_close(dense, _explicit_dense(layer), rtol=1e-10, atol=1e-12)
    x = torch.randn(7, in_f, dtype=torch.float64)
    torch.testing.assert_close(layer.double()(x), x @ dense.T + layer.bias.double(), rtol=1e-10, atol=1e-12)


def test_k1_dense_equivalent_is_block_circulant():
    torch.manual_seed(1)
    layer = fft.FFTChainLinear(64, 32, 16, 1)
    dense = layer.to_dense()
    for i in range(2):
        for j in range(4):
            block = dense[16 * i: 16 * i + 16, 16 * j: 16 * j + 16]
            for r in range(16):  # each row is the previous one rotated right by one
                torch.testing.assert_close(block[r], torch.roll(block[0], r), rtol=0, atol=1e-12)
            torch.testing.assert_close(block[:, 0], layer.coeffs[0, i, j].double(), rtol=0, atol=1e-6)


def test_layer_float32_against_float64_reference():
    torch.manual_seed(2)
    layer = fft.FFTChainLinear(100, 70, 32, 2)  # padded on both sides
    x = torch.randn(2, 5, 100)
    ref = x.double() @ layer.to_dense().T + layer.bias.double()
    y = layer(x)
    assert y.shape == (2, 5, 70) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-5)


def test_k1_projection_is_the_explicit_diagonal_average():
    torch.manual_seed(3)
    w = torch.randn(32, 48, dtype=torch.float64)
    layer = fft.project_dense(w, 16, 1)
    expected = torch.empty(2, 3, 16, dtype=torch.float64)
    for i in range(2):
        for j in range(3):
            block = w[16 * i: 16 * i + 16, 16 * j: 16 * j + 16]
            for d in range(16):  # wrapped diagonal r - s = d (mod B)
                expected[i, j, d] = torch.stack([block[r, (r - d) % 16] for r in range(16)]).mean()
    torch.testing.assert_close(layer.coeffs[0].double(), expected, rtol=1e-6, atol=1e-7)


def test_projection_is_least_squares_optimal():
    """Perturbing the K=1 fit in any block-circulant direction cannot lower the error."""
    torch.manual_seed(4)
    w = torch.randn(24, 40)  # padded: 24 = 1.5 blocks, 40 = 2.5 blocks of 16
    layer = fft.project_dense(w, 16, 1)
    base = fft.relative_error(layer.to_dense(), w)
    for _ in range(3):
        probe = fft.FFTChainLinear(40, 24, 16, 1, bias=False)
        probe.coeffs.data = layer.coeffs.data + 1e-3 * torch.randn_like(layer.coeffs)
        assert fft.relative_error(probe.to_dense(), w) > base


def test_projection_error_strictly_decreases_with_k():
    torch.manual_seed(5)
    w = torch.randn(64, 96)
    errors = [fft.relative_error(fft.project_dense(w, 16, k).to_dense(), w) for k in (1, 2, 4)]
    assert errors[0] > errors[1] > errors[2], errors


def test_gradients_flow_and_match_dense():
    torch.manual_seed(6)
    layer = fft.FFTChainLinear(40, 24, 8, 2).double()
    x = torch.randn(5, 40, dtype=torch.float64, requires_grad=True)
    layer(x).square().sum().backward()
    assert layer.coeffs.grad is not None and layer.coeffs.grad.abs().sum() > 0
    assert layer.bias.grad is not None and x.grad is not None
    # x.grad against the dense equivalent
    xd = x.detach().clone().requires_grad_()
    (xd @ layer.to_dense().T + layer.bias.detach()).square().sum().backward()
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-9, atol=1e-10)


def test_op_gradcheck_spectral_inputs():
    torch.manual_seed(7)
    layer = fft.FFTChainLinear(20, 12, 8, 2).double()
    cr, ci = fft.spectral_coefficients(layer.coeffs.detach())
    inputs = (torch.randn(3, 20, dtype=torch.float64, requires_grad=True), cr.requires_grad_(), ci.requires_grad_(),
              layer.bias.detach().clone().requires_grad_())
    perms = layer.perms[1:]
    assert torch.autograd.gradcheck(lambda x, a, b, c: torch.ops.graphopt.fft_chain_linear(x, a, b, perms, c, 8, 12, "auto"), inputs)


def test_distillation_lowers_heldout_error():
    from graphopt.fft_distill import fit_layer

    torch.manual_seed(8)
    dense = torch.nn.Linear(64, 32)
    basis = torch.randn(12, 64)  # activations live in a low-dimensional subspace, as real ones do
    x = torch.randn(600, 12) @ basis
    layer, errs = fit_layer(dense, x[:450], x[450:], 16, 2, steps=150, lr=1e-2)
    assert errs["rel_error"] < 0.7 * errs["projection_rel_error"], errs
    with torch.no_grad():
        held = fft.relative_error(layer(x[450:]), dense(x[450:]))
    assert abs(held - errs["rel_error"]) < 1e-6


def test_invalid_arguments_name_the_valid_choices():
    layer = fft.FFTChainLinear(32, 16, 16, 2)
    cr, ci = fft.spectral_coefficients(layer.coeffs.detach())
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="valid choices"):
        fft.fft_chain_linear(x, cr, ci, layer.perms[1:], None, 16, 16, "cufft")
    with pytest.raises(ValueError, match="frequencies"):
        fft.fft_chain_linear(x, cr, ci, layer.perms[1:], None, 8, 16, "auto")


# Triton kernels in the interpreter (TRITON_INTERPRET=1 set by conftest without CUDA)
@pytest.mark.skipif(not fft.HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("impl", ["triton", "dft"])
@pytest.mark.parametrize("in_f,out_f,b,k,tokens", [(40, 56, 16, 1, 5), (40, 56, 16, 3, 17), (48, 20, 32, 2, 3)])
def test_triton_kernels_match_float64_reference(impl, in_f, out_f, b, k, tokens):
    torch.manual_seed(9)
    layer = fft.FFTChainLinear(in_f, out_f, b, k, seed=1)
    x = torch.randn(tokens, in_f)
    cr, ci = fft.spectral_coefficients(layer.coeffs.detach())
    ref = fft.reference_fft_chain(x.double(), layer.coeffs.detach().double(), layer.perms, layer.bias.detach().double(), b, out_f)
    y = fft._LAUNCHERS[impl](x, cr, ci, layer.perms[1:], layer.bias.detach(), b, out_f)
    assert y.shape == (tokens, out_f) and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-5)


def test_cost_model_prefers_fused_dft_for_few_tokens_on_h100():
    from graphopt import cost_model
    from graphopt.hardware import get_spec

    hw = get_spec("h100")
    impl, est = fft.choose_implementation(hw, 16, 5120, 13824, 512, 2)
    assert impl == "dft"
    assert est.ms < cost_model.linear(hw, 16, 5120, 13824).ms
    # a huge K makes the FFT chain slower than dense at many tokens
    _, big = fft.choose_implementation(hw, 4096, 13824, 5120, 256, 16)
    assert big.ms > cost_model.linear(hw, 4096, 13824, 5120).ms
