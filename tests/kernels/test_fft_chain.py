"""FFT-chain layer: dense equivalence, projection, gradients, distillation, Triton kernels."""

import gc
from pathlib import Path

import pytest
import torch

import graphopt  # noqa: F401  (registers graphopt::fft_chain_linear)
from graphopt.cost import fft_chain as fft_cost
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


@pytest.mark.parametrize("k", [1, 2])
def test_inductor_gradients_match_eager(k):
    """Under torch.compile (Inductor) the input and coefficient gradients equal eager's. With K=1
    the spectral planes came from a strided complex view, whose real/imag Inductor got wrong in
    the backward graph: the input gradient was off by more than its norm."""
    torch.manual_seed(0)
    layer = fft.FFTChainLinear(128, 64, 32, k, bias=False)
    x = torch.randn(3, 128, requires_grad=True)
    layer(x).square().mean().backward()
    ref_x, ref_c = x.grad.clone(), layer.coeffs.grad.clone()
    x.grad, layer.coeffs.grad = None, None
    torch._dynamo.reset()
    torch.compile(layer, backend="inductor")(x).square().mean().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(x.grad, ref_x, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(layer.coeffs.grad, ref_c, rtol=1e-4, atol=1e-6)


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


def test_distillation_that_ends_worse_keeps_the_projection():
    """A learning rate far too high wrecks the fit; the projection it started from is kept."""
    from graphopt.fft_distill import fit_layer

    torch.manual_seed(9)
    dense = torch.nn.Linear(64, 32)
    x = torch.randn(300, 64)
    layer, errs = fit_layer(dense, x[:200], x[200:], 16, 2, steps=20, lr=10.0)
    assert errs["kept"] == "projection" and errs["rel_error"] == errs["projection_rel_error"]
    with torch.no_grad():
        assert abs(fft.relative_error(layer(x[200:]), dense(x[200:])) - errs["rel_error"]) < 1e-6


def test_auto_runs_a_fixed_rule_without_the_cost_model():
    """impl="auto" at call time (eager, or a graph the fft_linear pass did not lower): dft2_pregather
    for 16-bit and fp32 CUDA inputs where it runs, else the torch path; the kernel package never
    asks the cost model (the pass writes the cost model's choice into the op at compile time)."""
    import ast
    from pathlib import Path

    class OnCuda:  # the rule reads only these two attributes
        is_cuda, dtype = True, torch.bfloat16

    assert fft.default_implementation(OnCuda, 512) == ("dft2_pregather" if fft.HAS_TRITON else "torch")
    assert fft.default_implementation(OnCuda, 9) == "torch"  # odd block: no packed spectrum
    OnCuda.dtype = torch.float64
    assert fft.default_implementation(OnCuda, 512) == "torch"
    assert fft.default_implementation(torch.randn(2, 8), 512) == "torch"
    package = Path(fft.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
                assert not any(n.startswith(("graphopt.cost", "graphopt.passes")) for n in names), (path.name, names)


def test_invalid_arguments_name_the_valid_choices():
    layer = fft.FFTChainLinear(32, 16, 16, 2)
    cr, ci = fft.spectral_coefficients(layer.coeffs.detach())
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="valid choices"):
        fft.fft_chain_linear(x, cr, ci, layer.perms[1:], None, 16, 16, "cufft")
    with pytest.raises(ValueError, match="frequencies"):
        fft.fft_chain_linear(x, cr, ci, layer.perms[1:], None, 8, 16, "auto")


# Triton kernels on the GPU when there is one, else in the interpreter (TRITON_INTERPRET=1 set by
# conftest without CUDA).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


@pytest.mark.skipif(not fft.HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("impl", ["triton", "dft", "dft2", "dft2_pregather"])
@pytest.mark.parametrize("in_f,out_f,b,k,tokens", [(40, 56, 16, 1, 5), (40, 56, 16, 3, 17), (48, 20, 32, 2, 3), (30, 20, 8, 4, 2)])
def test_triton_kernels_match_float64_reference(impl, in_f, out_f, b, k, tokens):
    torch.manual_seed(9)
    layer = fft.FFTChainLinear(in_f, out_f, b, k, seed=1)
    x = torch.randn(tokens, in_f)
    cr, ci = fft.spectral_coefficients(layer.coeffs.detach())
    ref = fft.reference_fft_chain(x.double(), layer.coeffs.detach().double(), layer.perms, layer.bias.detach().double(), b, out_f)
    y = fft._LAUNCHERS[impl](*_on_device(x, cr, ci, layer.perms[1:], layer.bias.detach()), b, out_f).cpu()
    assert y.shape == (tokens, out_f) and y.dtype == x.dtype
    # On a GPU the dft kernels run fp32 GEMMs as TF32 (10-bit mantissa, documented); the
    # interpreter and the cuFFT-based `triton` path stay in full fp32.
    tf32 = impl.startswith("dft") and DEVICE == "cuda"
    torch.testing.assert_close(y.double(), ref, rtol=5e-3 if tf32 else 1e-4, atol=5e-3 if tf32 else 1e-5)


def test_packed_dft_tables_are_rfft_and_its_inverse():
    """Forward table: the packed spectrum (Re X_0..Re X_{Q-1}, Re X_Q, Im X_1..Im X_{Q-1});
    inverse table: irfft of it. Odd block sizes are refused with the valid choices."""
    b, q = 12, 6
    fwd, inv = (t.double() for t in fft._dft_tables(b, "cpu", torch.float64))
    x = torch.randn(5, b, dtype=torch.float64)
    spec = torch.fft.rfft(x, dim=-1)
    packed = x @ fwd
    torch.testing.assert_close(packed[:, :q], spec.real[:, :q])
    torch.testing.assert_close(packed[:, q], spec.real[:, q])
    torch.testing.assert_close(packed[:, q + 1:], spec.imag[:, 1:q])
    torch.testing.assert_close(packed @ inv, x)
    with pytest.raises(ValueError, match="even block_size"):
        fft._dft_tables(9, "cpu")
    layer = fft.FFTChainLinear(18, 9, 9, 2)
    cr, ci = fft.spectral_coefficients(layer.coeffs.detach())
    with pytest.raises(ValueError, match="valid choices"):
        fft.fft_chain_dft(torch.randn(2, 18), cr, ci, layer.perms[1:], None, 9, 9)
    for impl in ("dft2", "dft2_pregather"):
        with pytest.raises(ValueError, match="valid choices"):
            fft._LAUNCHERS[impl](torch.randn(2, 18), cr, ci, layer.perms[1:], None, 9, 9)
    assert not {"dft", "dft2", "dft2_pregather"} & set(fft.available_implementations("cuda", 9))


@pytest.mark.skipif(not fft.HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("impl", ["dft", "dft2", "dft2_pregather"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_f,out_f,b,k,tokens,bias", [(40, 56, 16, 2, 7, True), (64, 24, 32, 4, 3, False)])
def test_dft_kernels_16bit_inputs(impl, in_dtype, in_f, out_f, b, k, tokens, bias):
    """16-bit inputs: bf16 DFT operands and spectra, fp32 accumulation; the error against the
    float64 layer (on the same rounded inputs) stays within a few bf16 roundings of the output."""
    torch.manual_seed(10)
    layer = fft.FFTChainLinear(in_f, out_f, b, k, bias=bias, seed=2)
    x = (3 * torch.randn(tokens, in_f)).to(in_dtype)
    bias_t = layer.bias.detach().to(in_dtype) if bias else None
    cr, ci = fft.spectral_coefficients(layer.coeffs.detach())
    ref = fft.reference_fft_chain(x.double(), layer.coeffs.detach().double(), layer.perms,
                                  bias_t.double() if bias else None, b, out_f)
    y = fft._LAUNCHERS[impl](*_on_device(x, cr, ci, layer.perms[1:], bias_t), b, out_f).cpu()
    assert y.dtype == in_dtype and y.shape == (tokens, out_f)
    rounding = fft.relative_error(ref.to(torch.bfloat16), ref)  # bf16-rounding the exact output (fp16 runs in bf16 inside)
    err = fft.relative_error(y, ref)
    # GPU casts round to nearest (~2x `rounding`, see the module docstring); the CPU interpreter
    # truncates its fp32 -> bf16 casts (spectra, output), which alone costs ~2.5x more. A wrong
    # slot, sign or table entry gives errors of order 1.
    bound = (8 if fft._INTERPRET else 4) * rounding
    assert err < bound, (err, rounding)


# Implementations with recorded H200 timings (the dft2 ones are checked against an H100 sweep in
# tests/cost/test_fit_regression.py).
MEASURED = ("torch", "triton", "dft")


def test_cost_model_beats_cublas_only_at_few_tokens_on_h100():
    """16 tokens on 5120->13824, B=512, K=2: every implementation measured faster than cuBLAS on the
    H200 (CUDA graph: torch 1.17x, dft 1.22x); the model picks a cuFFT path there (it predicts the
    latency-bound dft 1.5x slower than torch: the one dft win it misses). Many tokens lose."""
    from graphopt import cost_model
    from graphopt.hardware import get_spec

    hw = get_spec("h100")
    impl, est = fft_cost.choose_implementation(hw, 16, 5120, 13824, 512, 2, implementations=MEASURED)
    assert impl in ("torch", "triton")
    assert est.ms < cost_model.linear(hw, 16, 5120, 13824).ms
    assert fft_cost.estimate_fft_chain(hw, 16, 5120, 13824, 512, 2, "dft").launches == 3
    # 256 and 4096 tokens: every implementation measured 0.31-0.64x cuBLAS on the H200
    for tokens in (256, 4096):
        _, best = fft_cost.choose_implementation(hw, tokens, 5120, 13824, 512, 2, implementations=MEASURED)
        assert best.ms > cost_model.linear(hw, tokens, 5120, 13824).ms
    # a huge K makes the FFT chain slower than dense at many tokens
    _, big = fft_cost.choose_implementation(hw, 4096, 13824, 5120, 256, 16, implementations=MEASURED)
    assert big.ms > cost_model.linear(hw, 4096, 13824, 5120).ms
    # the torch path is launch-bound at 16 tokens: ~13 launches
    assert fft_cost.estimate_fft_chain(hw, 16, 5120, 13824, 512, 2, "torch").launches >= 12


# ---- dft2: frequency-major spectra, tensor-core contraction -------------------------------------
def test_dft2_coefficient_operands_reproduce_the_packed_complex_product():
    """[Yr | Yi] = Xr @ G[q,0] + Xi @ G[q,1] is the complex product per frequency, and at q = 0
    (DC in the real slot, the real Nyquist bin in the imaginary slot) the two real products."""
    torch.manual_seed(11)
    c_len, n_out, q_len, t = 5, 3, 4, 2
    cr, ci = torch.randn(c_len, n_out, q_len + 1, dtype=torch.float64), torch.randn(c_len, n_out, q_len + 1, dtype=torch.float64)
    g = fft._dft2_coefficient_operands(cr, ci, torch.float64)
    cp, np_ = 16, 8
    assert g.shape == (q_len, 2, cp, 2 * np_) and g[:, :, c_len:].abs().sum() == 0
    xr, xi = torch.randn(q_len, t, cp, dtype=torch.float64), torch.randn(q_len, t, cp, dtype=torch.float64)
    xr[:, :, c_len:] = 0
    xi[:, :, c_len:] = 0
    out = xr @ g[:, 0] + xi @ g[:, 1]  # (Q, T, 2NP)
    yr, yi = out[..., :n_out], out[..., np_:np_ + n_out]
    assert out[..., n_out:np_].abs().sum() == 0 and out[..., np_ + n_out:].abs().sum() == 0
    cs = torch.complex(cr, ci)
    for q in range(1, q_len):
        y = torch.complex(xr[q, :, :c_len], xi[q, :, :c_len]) @ cs[:, :, q]
        torch.testing.assert_close(yr[q], y.real)
        torch.testing.assert_close(yi[q], y.imag)
    torch.testing.assert_close(yr[0], xr[0, :, :c_len] @ cr[:, :, 0])  # DC
    torch.testing.assert_close(yi[0], xi[0, :, :c_len] @ cr[:, :, q_len])  # Nyquist


@pytest.mark.skipif(not fft.HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("impl", ["dft2", "dft2_pregather"])
@pytest.mark.parametrize("in_f,out_f,b,k,tokens,bias", [
    (37, 29, 16, 1, 1, False),      # T = 1, K = 1, both sides padded
    (100, 70, 32, 2, 6, True),      # padded, T not a power of two
    (350, 1115, 16, 3, 3, False),   # C = 66 -> two 64-channel chunks; N = 70 -> two output tiles of [Yr | Yi]
    (1117, 45, 16, 1, 19, True),    # K = 1 reading x directly (no gather), T over one 16-token tile
])
def test_dft2_kernels_match_float64_reference_odd_shapes(impl, in_f, out_f, b, k, tokens, bias):
    torch.manual_seed(12)
    layer = fft.FFTChainLinear(in_f, out_f, b, k, bias=bias, seed=4)
    x = torch.randn(tokens, in_f)
    cr, ci = fft.spectral_coefficients(layer.coeffs.detach())
    bias_t = layer.bias.detach() if bias else None
    ref = fft.reference_fft_chain(x.double(), layer.coeffs.detach().double(), layer.perms, bias_t.double() if bias else None, b, out_f)
    y = fft._LAUNCHERS[impl](*_on_device(x, cr, ci, layer.perms[1:], bias_t), b, out_f).cpu()
    assert y.shape == (tokens, out_f) and y.dtype == x.dtype
    tf32 = DEVICE == "cuda"  # TF32 GEMMs and contraction on a GPU; exact fp32 in the interpreter
    torch.testing.assert_close(y.double(), ref, rtol=5e-3 if tf32 else 1e-4, atol=5e-3 if tf32 else 1e-5)


@pytest.mark.skipif(not fft.HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("tokens,in_f,width", [
    (1, 37, 50),      # one token: its columns split over several programs
    (5, 200, 333),    # several row chunks (64 features each in the interpreter, 16384 on a GPU), ragged last chunk
    (3, 64, 64),      # exactly one chunk
])
@pytest.mark.parametrize("dtype,index_dtype", [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)])
def test_gather_columns_kernel_is_an_exact_gather(tokens, in_f, width, dtype, index_dtype):
    """The staged gather copies x[:, src] bit for bit, every source position reachable from
    every output column, including sources in later row chunks."""
    torch.manual_seed(21)
    x = torch.randn(tokens, in_f).to(dtype)
    src = torch.randint(0, in_f, (width,), dtype=index_dtype)
    src[:2] = torch.tensor([in_f - 1, 0])  # both ends of the row
    xd, srcd = _on_device(x, src)
    out = torch.empty(tokens, width, dtype=dtype, device=xd.device)
    fft._launch_gather_columns(xd, srcd, out)
    assert torch.equal(out.cpu(), x[:, src.long()])


# ---- operand tables: given by the fft_linear pass, else built per call ----------------------------
TABLED = ("dft", "dft2", "dft2_pregather")


def _chain(in_f, out_f, b, k, bias, seed):
    layer = fft.FFTChainLinear(in_f, out_f, b, k, bias=bias, seed=seed)
    cr, ci = fft.spectral_coefficients(layer.coeffs.detach())
    return layer, cr, ci, layer.perms[1:].contiguous(), layer.bias.detach() if bias else None


@pytest.mark.skipif(not fft.HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("impl", TABLED)
@pytest.mark.parametrize("in_f,out_f,b,k,tokens,bias,dtype", [
    (100, 70, 32, 2, 6, True, torch.float32),      # padded on both sides, T not a power of two
    (37, 29, 16, 1, 1, False, torch.float32),      # K = 1: no source index
    (40, 56, 16, 3, 5, True, torch.bfloat16),      # 16-bit: bf16 DFT tables
])
def test_given_tables_give_the_per_call_result_and_the_float64_reference(impl, in_f, out_f, b, k, tokens, bias, dtype):
    """A launcher given the tables `operand_tables` builds (what the fft_linear pass makes graph
    constants) computes bit for bit what it computes building them itself, and both match the
    float64 layer; `tables_read` names exactly the tables built."""
    torch.manual_seed(14)
    layer, cr, ci, perms, bias_t = _chain(in_f, out_f, b, k, bias, seed=6)
    x = (2 * torch.randn(tokens, in_f)).to(dtype)
    bias_t = bias_t.to(dtype) if bias else None
    xd, crd, cid, permsd, biasd = _on_device(x, cr, ci, perms, bias_t)
    tables = fft.operand_tables(impl, dtype, b, in_f, xd.device, perms=permsd, coeff_real=crd, coeff_imag=cid)
    assert set(tables) == set(fft.tables_read(impl, k)) and ("source_index" in tables) == (impl != "dft" and k > 1)
    given = fft._LAUNCHERS[impl](xd, crd, cid, permsd, biasd, b, out_f, **tables).cpu()
    built = fft._LAUNCHERS[impl](xd, crd, cid, permsd, biasd, b, out_f).cpu()
    assert given.dtype == dtype and given.shape == (tokens, out_f)
    assert torch.equal(given, built)
    ref = fft.reference_fft_chain(x.double(), layer.coeffs.detach().double(), layer.perms,
                                  bias_t.double() if bias else None, b, out_f)
    if dtype == torch.float32:
        tol = 5e-3 if DEVICE == "cuda" else 1e-4  # TF32 on a GPU; exact fp32 in the interpreter
        torch.testing.assert_close(given.double(), ref, rtol=tol, atol=tol)
    else:  # a few bf16 roundings (see test_dft_kernels_16bit_inputs)
        assert fft.relative_error(given, ref) < (8 if fft._INTERPRET else 4) * fft.relative_error(ref.to(torch.bfloat16), ref)
    # the op: on a GPU the kernel with the given tables; on the CPU the torch reference, which ignores them
    op = torch.ops.graphopt.fft_chain_linear
    with_tables = op(xd, crd, cid, permsd, biasd, b, out_f, impl, **tables)
    torch.testing.assert_close(with_tables, op(xd, crd, cid, permsd, biasd, b, out_f, impl), rtol=0, atol=0)


@pytest.mark.skipif(not fft.HAS_TRITON, reason="triton not installed")
def test_tables_of_another_implementation_or_shape_are_refused_by_name():
    """A table built for another implementation, dtype or layer is a clear error naming the table
    and the form it must have, never a silent misread."""
    torch.manual_seed(15)
    _, cr, ci, perms, _ = _chain(40, 24, 8, 2, False, seed=5)
    x, cr, ci, perms = _on_device(torch.randn(3, 40), cr, ci, perms)
    pregather = fft.operand_tables("dft2_pregather", torch.float32, 8, 40, x.device, perms=perms, coeff_real=cr, coeff_imag=ci)
    with pytest.raises(ValueError, match=r"source_index for impl='dft2' must be a contiguous \(10, 8\) torch.int32"):
        fft.fft_chain_dft2(x, cr, ci, perms, None, 8, 24, source_index=pregather["source_index"])
    bf16 = fft.operand_tables("dft", torch.bfloat16, 8, 40, x.device)
    with pytest.raises(ValueError, match=r"dft_forward for impl='dft' must be a contiguous \(8, 8\) torch.float32"):
        fft.fft_chain_dft(x, cr, ci, perms, None, 8, 24, **bf16)
    _, cr2, ci2, _, _ = _chain(40, 80, 8, 2, False, seed=5)  # 10 output blocks: a wider G
    other = fft.operand_tables("dft2", torch.float32, 8, 40, x.device, coeff_real=cr2.to(x.device), coeff_imag=ci2.to(x.device))
    with pytest.raises(ValueError, match="coeff_operand for impl='dft2'"):
        fft.fft_chain_dft2(x, cr, ci, perms, None, 8, 24, coeff_operand=other["coeff_operand"])
    with pytest.raises(ValueError, match="valid choices: torch, triton, dft"):
        fft.operand_tables("cufft", torch.float32, 8, 40, x.device)


def _live_tensors() -> dict[int, torch.Tensor]:
    gc.collect()
    return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor)}


@pytest.mark.skipif(not fft.HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("impl", TABLED)
def test_a_call_without_tables_leaves_no_tensor_behind_but_its_output(impl):
    """Nothing is cached across calls: the tensors alive after a call are those alive before it
    plus its output (a CUDA-graph capture refuses allocations that outlive a call). The kernels
    are compiled on another block size first, so the measured call is one a cache would miss."""
    torch.manual_seed(16)
    _, *warm = _chain(40, 24, 8, 2, False, seed=1)
    fft._LAUNCHERS[impl](*_on_device(torch.randn(3, 40), *warm[:3]), None, 8, 24)
    _, cr, ci, perms, _ = _chain(40, 24, 16, 2, False, seed=2)
    x, cr, ci, perms = _on_device(torch.randn(3, 40), cr, ci, perms)
    before = _live_tensors()
    y = fft._LAUNCHERS[impl](x, cr, ci, perms, None, 16, 24)
    left = {i: t for i, t in _live_tensors().items() if i not in before}
    assert list(left) == [id(y)], [(tuple(t.shape), t.dtype) for t in left.values()]


@pytest.mark.skipif(not fft.HAS_TRITON, reason="triton not installed")
def test_dft2_without_tables_follows_in_place_updates():
    """Built per call, the tables follow an in-place update of the coefficients and permutations."""
    torch.manual_seed(13)
    layer = fft.FFTChainLinear(40, 24, 8, 2, bias=False, seed=5)
    cr, ci = _on_device(*fft.spectral_coefficients(layer.coeffs.detach()))
    perms = _on_device(layer.perms[1:].clone())[0]
    x = _on_device(torch.randn(3, 40))[0]
    y1 = fft.fft_chain_dft2(x, cr, ci, perms, None, 8, 24)
    cr.mul_(-2.0)
    ci.mul_(-2.0)
    torch.testing.assert_close(fft.fft_chain_dft2(x, cr, ci, perms, None, 8, 24), -2.0 * y1, rtol=1e-5, atol=1e-5)
    perms.copy_(perms.flip(-1))
    all_perms = torch.cat([torch.arange(40)[None], perms.cpu()])
    coeffs = -2.0 * layer.coeffs.detach().double()
    ref = fft.reference_fft_chain(x.cpu().double(), coeffs, all_perms, None, 8, 24)
    tol = 5e-3 if DEVICE == "cuda" else 1e-4  # TF32 contraction on a GPU; exact fp32 in the interpreter
    torch.testing.assert_close(fft.fft_chain_dft2(x, cr, ci, perms, None, 8, 24).cpu().double(), ref, rtol=tol, atol=tol)


def test_dft2_estimates_and_choice():
    """dft2 is a candidate of choose_implementation on CUDA for even B: 3 launches (dft2), one
    more for the torch gather when K > 1 (dft2_pregather); the choice is the cheapest estimate."""
    from graphopt.hardware import get_spec

    hw = get_spec("h100")
    assert {"dft2", "dft2_pregather"} <= set(fft.available_implementations("cuda", 512))
    assert fft_cost.estimate_fft_chain(hw, 16, 5120, 13824, 512, 2, "dft2").launches == 3
    assert fft_cost.estimate_fft_chain(hw, 16, 5120, 13824, 512, 2, "dft2_pregather").launches == 4
    assert fft_cost.estimate_fft_chain(hw, 16, 5120, 13824, 512, 1, "dft2_pregather").launches == 3
    for tokens in (1, 16, 256, 4096):
        impl, est = fft_cost.choose_implementation(hw, tokens, 13824, 5120, 512, 2)
        cheapest = min(fft_cost.estimate_fft_chain(hw, tokens, 13824, 5120, 512, 2, i).ms for i in fft.IMPLEMENTATIONS)
        assert est.ms == cheapest and fft_cost.estimate_fft_chain(hw, tokens, 13824, 5120, 512, 2, impl).ms == cheapest
    only, _ = fft_cost.choose_implementation(hw, 16, 13824, 5120, 512, 2, implementations=("dft2",))
    assert only == "dft2"


RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _measured_h200():
    """The H200 of bench/results, with the ceilings `graphopt calibrate` measured on it."""
    import dataclasses

    from graphopt.hardware import SPECS

    return dataclasses.replace(SPECS["h200"], measured_bf16_flops=690e12, measured_memory_bandwidth=4.22e12,
                               measured_launch_overhead_s=6e-6)


def _recorded_h200_rows():
    """The H200 FFT-chain timings of the current kernels (bench/validate_cost_model.py reads the same)."""
    from bench.validate_cost_model import fft_h200_records

    return fft_h200_records()


_HAVE_RESULTS = (RESULTS / "fft_chain_h200.json").exists() and (RESULTS / "fft_chain_torch_triton_h200.json").exists()


@pytest.mark.skipif(not _HAVE_RESULTS, reason="recorded H200 results not in this checkout")
def test_fit_regression_cost_model_tracks_recorded_h200_timings():
    """The roofline (fitted constants above estimate_fft_chain) against every recorded H200 row it
    can explain (_recorded_h200_rows, all three implementations): each predicted time within 0.65-1.7x
    of the measured one, and faster/slower-than-cuBLAS agreement >= 90% per implementation (the
    dense side is cost_model.linear)."""
    from graphopt import cost_model

    hw = _measured_h200()
    rows = _recorded_h200_rows()
    assert len(rows) >= 80 and {r[5] for r in rows} == set(MEASURED)
    agree: dict[str, list[int]] = {}
    for in_f, out_f, b, k, t, impl, bias, fft_ms, dense_ms in rows:
        pred = fft_cost.estimate_fft_chain(hw, t, in_f, out_f, b, k, impl, bias=bias).ms
        assert 0.65 < pred / fft_ms < 1.7, (in_f, out_f, b, k, t, impl, pred, fft_ms)
        dense_pred = cost_model.linear(hw, t, in_f, out_f, bias=bias).ms
        agree.setdefault(impl, []).append((dense_pred > pred) == (dense_ms > fft_ms))
    for impl, hits in agree.items():
        assert sum(hits) / len(hits) >= 0.9, (impl, f"{sum(hits)}/{len(hits)}")


@pytest.mark.skipif(not _HAVE_RESULTS, reason="recorded H200 results not in this checkout")
@pytest.mark.parametrize("calibrated", [True, False])
def test_fit_regression_never_chooses_an_implementation_measured_slower_than_cublas_on_h200(calibrated):
    """No implementation measured > 5% slower than cuBLAS at a shape is predicted to beat cuBLAS
    there, so neither choose_implementation nor the fft_linear pass (which rewrites a dense linear
    only when the chosen estimate beats cost_model.linear) can pick it. Holds with the measured
    ceilings and with the uncalibrated datasheet ones."""
    from graphopt import cost_model
    from graphopt.hardware import SPECS

    hw = _measured_h200() if calibrated else SPECS["h200"]
    losers = 0
    for in_f, out_f, b, k, t, impl, bias, fft_ms, dense_ms in _recorded_h200_rows():
        dense_pred = cost_model.linear(hw, t, in_f, out_f, bias=bias).ms
        chosen, best = fft_cost.choose_implementation(hw, t, in_f, out_f, b, k, bias=bias)
        if fft_ms > 1.05 * dense_ms:
            losers += 1
            pred = fft_cost.estimate_fft_chain(hw, t, in_f, out_f, b, k, impl, bias=bias).ms
            assert pred >= dense_pred, (in_f, out_f, b, k, t, impl, fft_ms, dense_ms, pred, dense_pred)
            assert not (chosen == impl and best.ms < dense_pred)
    assert losers >= 70  # most recorded rows lose: the check is not vacuous
