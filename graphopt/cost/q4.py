"""Cost model of the Q4 ops (graphopt.kernels.q4): the predicted time of the fused and the
separate mode on a HardwareSpec, per tile config or as the best candidate the tuner would pick, and
the mode the q4_linear pass chooses (`predict_linear`).

The estimates are built on graphopt.cost_model.roofline (family q4_gemv for the gemv/dp4a
kernels, q4_swap for the operand-swapped decode GEMM, q4_tma for q4_tma's decode, q4_gemm for the
int8 GEMM otherwise):
the fused kernel reads bf16 activations once per N tile and quantizes them again in every N tile
(CUDA-core work that grows with M*K*N/BLOCK_N), and stages bf16 rather than int8 activation tiles
in shared memory; when that leaves one resident CTA per SM, its memory rate is derated
(q4.fused_single_cta_derate), and a tile that does not fit at all is infeasible. The separate path
pays one more launch and a write+read of the Q8_1 activations (1.125 bytes per value).
"""

from __future__ import annotations

import math

from graphopt import cost_model
from graphopt.cost import coefficients
from graphopt.cost_model import Estimate, roofline
from graphopt.hardware import HardwareSpec
from graphopt.kernels import fp4_tma, q4_tma
from graphopt.kernels import q4 as q4k

# Operation counts read off the kernels' code (not fitted):
# CUDA-core operations per activation value to quantize it to Q8_1 in registers (abs, max-reduce
# share, multiply, round via truncation + compare, convert, sum-reduce share, int8 pack).
QUANT_OPS_PER_VALUE = 12
# CUDA-core operations per (row, column, 32-block) of the per-block epilogue d4*(d8*dot - 8*s8) + acc
# (int32 -> fp32 by the exact IADD + FADD trick, then two FMAs).
EPILOGUE_OPS_PER_BLOCK = 4
# CUDA-core operations per weight value in the gemv decode kernel besides one FMA per token row:
# half a byte extract, one LOP3 (nibble | exponent bits) and one FADD (remove the offset).
GEMV_UNPACK_OPS_PER_VALUE = 2.5
# Q8_1 blocks in: a block's sum(q) is one dp4a per 4 values, per program.
PREQUANT_SUM_OPS_PER_VALUE = 0.25
# The dp4a decode kernel: the nibble masks/shift of a word, 3 ops per 8 values.
DP4A_UNPACK_OPS_PER_VALUE = 0.375
# Fitted, the "q4.*" coefficients of the GPU's data file (graphopt.cost.coefficients):
#  - fused_requant_ops_per_value: the fused GEMM re-quantizes its activation tile in every N tile;
#    effective ops per value and N tile (most of QUANT_OPS_PER_VALUE overlaps the MMA);
#  - gemm_unpack_ops_per_weight: the int8 GEMM unpacks each 4-bit weight once per BLOCK_M rows;
#  - dp4a_ops_per_value_and_row: the dp4a decode's effective ops per weight value and token row
#    (each block's eight dp4a form one accumulating chain);
#  - tma_ops_per_weight, tma_ops_per_weight_and_token_row: q4_tma's Gluon decode (the separate path
#    on sm_90+, <= 16 tokens), at the q4_tma efficiency: nibble masks, and the per-block epilogue
#    on every token column of the 8- or 16-token block;
#  - fused_single_cta_derate: memory-rate factor of a fused tile that leaves a single resident CTA
#    per SM (nothing overlaps its own quantization with another CTA's loads).
Q4_TMA_ESTIMATE = "Q4 separate (quantize + TMA decode)"


def _fitted(hw: HardwareSpec, name: str) -> float:
    return coefficients.value(hw, f"q4.{name}")


def _weight_bytes(n: int, k: int) -> float:
    kp = 64 * math.ceil(k / 64)
    return n * kp / 2 + n * (kp // 32) * 2


def ctas_per_sm(hw: HardwareSpec, config: q4k.TileConfig, act_bytes: int) -> int:
    """Resident CTAs per SM allowed by shared memory (the fused kernel stages bf16 tiles)."""
    need = config.shared_memory_bytes(act_bytes)
    if need == 0 or not hw.is_gpu:
        return 8
    return hw.shared_memory_per_sm // need


def _output_tiles(config: q4k.TileConfig, tokens: int, out_features: int) -> int:
    rows = (config.block_m or min(q4k.GEMV_MAX_ROWS, 1 << max(tokens - 1, 0).bit_length())) \
        if config.kernel in ("gemv", "dp4a") else config.block_m
    return math.ceil(tokens / rows) * math.ceil(out_features / config.block_n)


def split_k(hw: HardwareSpec, config: q4k.TileConfig, tokens: int, in_features: int, out_features: int) -> int:
    """Programs along K that the launcher gives `config` (q4k._split_k with this GPU's SM count)."""
    if config.split_k == 1:
        return 1
    tiles = _output_tiles(config, tokens, out_features)
    pairs = math.ceil(in_features / 64)
    steps = math.ceil(pairs / config.pairs)
    wanted = config.split_k or math.ceil(q4k.PROGRAMS_PER_SM * hw.sm_count / tiles)
    per_split = config.pairs * math.ceil(steps / max(1, min(wanted, steps)))
    return math.ceil(pairs / per_split)


def _gemm_family(config: q4k.TileConfig) -> str:
    """Cost-model family of a tensor-core config: the operand-swapped decode kernel streams its
    weights through a cp.async pipeline into registers and has its own fitted rates."""
    return "q4_swap" if config.kernel == "swap" else "q4_gemm"


def _launches(config: q4k.TileConfig, splits: int) -> int:
    """Launches of a config: + the split-K sum kernel, except with reduce="last"."""
    return 1 if splits == 1 or config.reduce == "last" else 2


def _fill(hw: HardwareSpec, config: q4k.TileConfig, m: int, n: int, splits: int) -> float:
    """Fewer programs than SMs leave SMs idle: the memory rate scales with the filled fraction."""
    return min(1.0, _output_tiles(config, m, n) * splits / hw.sm_count) if hw.is_gpu else 1.0


def _partial_bytes(config: q4k.TileConfig, splits: int, m: int, n: int) -> float:
    """fp32 split-K partials: atomics into one (M, N) buffer read back once ("last"), or written
    per split and read back by the sum kernel."""
    if splits == 1:
        return 0.0
    return 4 * (splits + 2) * m * n if config.reduce == "last" else 2 * 4 * splits * m * n


def _kernel(hw: HardwareSpec, name: str, family: str, *, int8_ops: float, fp32_ops: float, moved: float,
            launches: int = 1, memory_derate: float = 1.0) -> Estimate:
    """One kernel doing tensor-core int8 work, CUDA-core fp32 work and memory traffic."""
    compute_ms = 0.0
    if int8_ops:
        compute_ms += roofline(hw, name, flops=int8_ops, family=family, unit="int8", launches=0).ms
    if fp32_ops:
        compute_ms += roofline(hw, name, flops=fp32_ops, family=family, unit="fp32", launches=0).ms
    memory_ms = roofline(hw, name, bytes_moved=moved, family=family, launches=0).ms / memory_derate
    launch_ms = launches * hw.launch_overhead * 1e3
    body = max(compute_ms, memory_ms)
    bound = "launch" if launch_ms > body else ("compute" if compute_ms >= memory_ms else "memory")
    return Estimate(name, body + launch_ms, int8_ops + fp32_ops, moved, launches, bound)


def _decode_estimate(hw: HardwareSpec, config: q4k.TileConfig, m: int, k: int, n: int, *, act_in_bytes: float,
                     act_bytes: int, bias: bool, per_program_ops_per_value: float, label: str) -> Estimate:
    """The decode kernel ("gemv" fp32 FMAs or "dp4a"), reading act_in_bytes of activations. Every
    one of the ceil(N / BLOCK_N) programs along N redoes per_program_ops_per_value ops per
    activation value: the Q8_1 quantization (fused), or the sum of each block (Q8_1 blocks in)."""
    splits = split_k(hw, config, m, k, n)
    moved = _weight_bytes(n, k) + act_in_bytes + m * n * act_bytes + (n * act_bytes if bias else 0) \
        + _partial_bytes(config, splits, m, n)
    per_value = GEMV_UNPACK_OPS_PER_VALUE + m if config.kernel == "gemv" \
        else DP4A_UNPACK_OPS_PER_VALUE + _fitted(hw, "dp4a_ops_per_value_and_row") * m
    fp32 = per_value * n * k + EPILOGUE_OPS_PER_BLOCK * m * n * (k / 32) \
        + per_program_ops_per_value * m * k * math.ceil(n / config.block_n)
    return _kernel(hw, f"{label}, {config.name})", "q4_gemv", int8_ops=0.0, fp32_ops=fp32, moved=moved,
                   launches=_launches(config, splits), memory_derate=_fill(hw, config, m, n, splits))


def estimate_q4_fused(hw: HardwareSpec, tokens: int, in_features: int, out_features: int, *,
                      act_bytes: int = 2, bias: bool = False, config: q4k.TileConfig | None = None) -> Estimate:
    """The fused kernel (decode GEMV at <= GEMV_MAX_TOKENS tokens, tiled int8 GEMM above, both with
    split-K where the config asks), quantizing in registers."""
    m, k, n = tokens, in_features, out_features
    if config is None:  # the launcher times the candidates on the GPU; predict the best of them
        return min((estimate_q4_fused(hw, m, k, n, act_bytes=act_bytes, bias=bias, config=c)
                    for c in q4k.candidate_configs(m, fused=True)), key=lambda e: e.ms)
    if config.kernel in ("gemv", "dp4a"):
        return _decode_estimate(hw, config, m, k, n, act_in_bytes=m * k * act_bytes, act_bytes=act_bytes, bias=bias,
                                per_program_ops_per_value=QUANT_OPS_PER_VALUE, label="Q4 fused GEMV (decode")
    splits = split_k(hw, config, m, k, n)
    launches = _launches(config, splits)
    fill = _fill(hw, config, m, n, splits)
    moved = _weight_bytes(n, k) + m * k * act_bytes + m * n * act_bytes + (n * act_bytes if bias else 0) \
        + _partial_bytes(config, splits, m, n)
    family = _gemm_family(config)
    m_pad = config.block_m * math.ceil(m / config.block_m)
    occupancy = ctas_per_sm(hw, config, act_bytes)
    if occupancy < 1:
        return Estimate("Q4 fused GEMM (tile exceeds shared memory)", math.inf, 0.0, moved, 1, "memory")
    derate = (_fitted(hw, "fused_single_cta_derate") if occupancy == 1 else 1.0) * fill
    fp32 = EPILOGUE_OPS_PER_BLOCK * m_pad * n * (k / 32) \
        + _fitted(hw, "fused_requant_ops_per_value") * m_pad * k * math.ceil(n / config.block_n) \
        + _fitted(hw, "gemm_unpack_ops_per_weight") * n * k * (m_pad // config.block_m)
    return _kernel(hw, f"Q4 fused GEMM ({config.name}, {occupancy} CTA/SM)", family,
                   int8_ops=2.0 * m_pad * n * k, fp32_ops=fp32, moved=moved, memory_derate=derate, launches=launches)


def tma_decode_applies(hw: HardwareSpec, tokens: int, in_features: int, out_features: int) -> bool:
    """Whether the separate path can run q4_tma's decode on `hw` (q4k._tma_runs' rules): Gluon in this
    Triton, an sm_90+ GPU, <= 16 tokens, K steps of 256 over the padded K, N a multiple of 8."""
    return (fp4_tma.runs_on_spec(hw) and 0 < tokens <= q4k.DECODE_MAX_TOKENS
            and q4_tma.tiles_k(64 * math.ceil(in_features / 64)) and out_features % 8 == 0)


def estimate_q4_tma(hw: HardwareSpec, tokens: int, in_features: int, out_features: int, *, act_bytes: int = 2,
                    bias: bool = False) -> Estimate:
    """The separate path on q4_tma: q4k.quantize_for_tma (int8 values and fp32 d, s per block), then
    the Gluon decode over 8- or 16-token blocks."""
    m, k, n = tokens, in_features, out_features
    kp = 64 * math.ceil(k / 64)
    act_out = m * kp + 8 * m * kp / q4k.QK
    quant = roofline(hw, "Q8_1 quantize (TMA layout)", flops=QUANT_OPS_PER_VALUE * m * k,
                     bytes_moved=m * k * act_bytes + act_out, family="pointwise", unit="fp32")
    block_m = 8 if m <= 8 else 16
    ops = _fitted(hw, "tma_ops_per_weight") + _fitted(hw, "tma_ops_per_weight_and_token_row") * block_m
    moved = _weight_bytes(n, k) + act_out + m * n * act_bytes + (n * act_bytes if bias else 0)
    kernel = _kernel(hw, f"Q4xQ8_1 TMA decode (Gluon, {block_m}-token blocks)", "q4_tma", int8_ops=0.0,
                     fp32_ops=ops * n * kp, moved=moved)
    return cost_model.chain(Q4_TMA_ESTIMATE, quant, kernel)


def estimate_q4_separate(hw: HardwareSpec, tokens: int, in_features: int, out_features: int, *,
                         act_bytes: int = 2, bias: bool = False, config: q4k.TileConfig | None = None,
                         tma: bool = True) -> Estimate:
    """Q8_1 quantization kernel, then the int8 GEMM reading Q8_1 activations (or, with `tma` on sm_90+
    at decode sizes, q4_tma's decode where it is predicted faster: the tuner times both)."""
    m, k, n = tokens, in_features, out_features
    q8_bytes = m * k * q4k.Q8_1_BLOCK_BYTES / q4k.QK
    quant = roofline(hw, "Q8_1 quantize", flops=QUANT_OPS_PER_VALUE * m * k, bytes_moved=m * k * act_bytes + q8_bytes,
                     family="pointwise", unit="fp32")
    if config is None:
        candidates = [estimate_q4_separate(hw, m, k, n, act_bytes=act_bytes, bias=bias, config=c)
                      for c in q4k.candidate_configs(m, fused=False)]
        if tma and tma_decode_applies(hw, m, k, n):
            candidates.append(estimate_q4_tma(hw, m, k, n, act_bytes=act_bytes, bias=bias))
        return min(candidates, key=lambda e: e.ms)
    if config.kernel == "tma":
        return estimate_q4_tma(hw, m, k, n, act_bytes=act_bytes, bias=bias)
    if config.kernel == "dp4a":  # the blocks' words straight into dp4a; one more dp4a per word for sum(q)
        gemv = _decode_estimate(hw, config, m, k, n, act_in_bytes=q8_bytes, act_bytes=act_bytes, bias=bias,
                                per_program_ops_per_value=PREQUANT_SUM_OPS_PER_VALUE, label="Q4xQ8_1 dp4a GEMV (decode")
        return cost_model.chain("Q4 separate (quantize + dp4a GEMV)", quant, gemv)
    m_pad = config.block_m * math.ceil(m / config.block_m)
    family = _gemm_family(config)
    splits = split_k(hw, config, m, k, n)
    moved = _weight_bytes(n, k) + q8_bytes + m * n * act_bytes + (n * act_bytes if bias else 0) \
        + _partial_bytes(config, splits, m, n)
    fp32 = EPILOGUE_OPS_PER_BLOCK * m_pad * n * (k / 32) + m_pad * k * math.ceil(n / config.block_n) \
        + _fitted(hw, "gemm_unpack_ops_per_weight") * n * k * (m_pad // config.block_m)  # + row sums, + nibble unpack
    gemm = _kernel(hw, f"Q4xQ8_1 GEMM ({config.name})", family, int8_ops=2.0 * m_pad * n * k, fp32_ops=fp32, moved=moved,
                   launches=_launches(config, splits), memory_derate=_fill(hw, config, m, n, splits))
    return cost_model.chain("Q4 separate (quantize + GEMM)", quant, gemm)


def predict_linear(hw: HardwareSpec, tokens: int, in_features: int, out_features: int, *, act_bytes: int = 2,
                   bias: bool = False, mode: str = "auto", tma: bool = True) -> tuple[Estimate, Estimate, str, Estimate, Estimate]:
    """(dense linear, chosen q4 estimate, chosen mode, fused, separate): what the plain-linear rewrite
    compares (it rewrites when the chosen estimate is faster than the dense one, unless forced).
    tma: whether the separate mode may run q4_tma's decode (estimate_q4_separate)."""
    before = cost_model.linear(hw, tokens, in_features, out_features, dtype_bytes=act_bytes, bias=bias)
    if not hw.is_gpu:
        # No Q4 kernel off the GPU: the op runs its torch reference, which dequantizes the weight
        # and then does the dense product, so it can only be slower than the dense linear.
        dequant = cost_model.roofline(hw, "Q4_0 dequantize (torch)", family="pointwise",
                                      bytes_moved=_weight_bytes(out_features, in_features) + 4 * in_features * out_features)
        reference = cost_model.chain("Q4 reference (dequantize + dense linear)", dequant, before)
        return before, reference, "reference", reference, reference
    fused = estimate_q4_fused(hw, tokens, in_features, out_features, act_bytes=act_bytes, bias=bias)
    separate = estimate_q4_separate(hw, tokens, in_features, out_features, act_bytes=act_bytes, bias=bias, tma=tma)
    if mode == "auto":
        mode = "fused" if fused.ms <= separate.ms else "separate"
    return before, (fused if mode == "fused" else separate), mode, fused, separate

