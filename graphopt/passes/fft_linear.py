"""The `fft_linear` pass (opt-in): FFT-chain (block-circulant) linear layers.

Two kinds of match, one Decision each:

1. `graphopt::fft_chain_linear` nodes. `FFTChainLinear.forward` calls the op directly (with
   `impl="auto"`), so a Dynamo graph of a trained structured layer already holds it; matching the
   op is exact, whereas re-discovering an rfft -> einsum -> irfft chain would be fragile for no
   gain. The pass (a) picks the implementation the cost model predicts fastest for this call
   site's token count and writes it into the node, (b) when the coefficients are an inference
   graph's parameter (`ctx.can_freeze`), folds the coefficient spectrum (rfft -> permute -> real /
   imag in the graph) into constants, removing those kernels from every call, and (c) builds the
   chosen implementation's operand tables (fft_chain.operand_tables) as constants: the DFT
   matrices always, the gather's source index from the permutation buffer, G from folded
   coefficients. A table whose source is not constant (trainable coefficients) is built by the op
   at each call. Lossless: always applied.
2. Dense linears (`find_linears`). Rewritten only through a plan: the plan's "fft_linear" section
   (written by `graphopt fftchain distill`) names fitted coefficients for the layer at that
   module path, in a safetensors file beside the plan, with the relative output error measured on
   held-out calibration activations. The layer is rewritten only if that error is within
   `error_budget["fft_linear"]`, the shapes match, the weight can be frozen (inference), and the
   cost model predicts a win (`config.force` overrides only the last). Every other dense linear
   is declined with its reason. Where the chain beats cuBLAS, by token count and projection, is
   in bench/RESULTS.md section 7. The estimates are those of graphopt.cost.fft_chain, fitted to
   H100 runs; they assume CUDA-graph replay and decide per token count.

Plan section format:
    "fft_linear": {"file": "<name>.safetensors",
                   "layers": {"<module path>": {"in_features": .., "out_features": .., "block_size": ..,
                                                 "k": .., "seed": .., "rel_error": .., "bias": true}},
                   "suggested": [...]}   # explorer output: per-layer-range configs, read by distill
Tensors in the file: "<module path>.coeffs" (K, N, n_in, B), "<module path>.perms" (K, in),
optional "<module path>.bias".
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.fx as fx

from graphopt import cost_model
from graphopt.cost import fft_chain as fft_cost
from graphopt.kernels import fft_chain as fft
import graphopt.ops  # noqa: F401  (registers the graphopt::* ops this module names)
from graphopt.onnx_registry import register_onnx_translation
from graphopt.passes.base import GraphPass, PassContext
from graphopt.passes.fx_utils import arg, bias_problem, device, dtype, find_linears, replace_with_call, shape, tokens
from graphopt.plan import plan_section, same_weights

OP = torch.ops.graphopt.fft_chain_linear.default


def _device_type(node) -> str:
    dev = device(node)
    return dev.type if dev is not None else "cpu"


def _constant_ancestors(node: fx.Node, ctx: PassContext, allow=None):
    """Nodes computing `node` from model state only, in graph order, and the placeholders they
    read; None if anything else feeds it. `allow(placeholder)` says which state counts (default:
    parameters that can be frozen, `ctx.can_freeze`), so a user input never does."""
    allow = allow or (lambda p: ctx.can_freeze(p)[0])
    seen: dict[fx.Node, None] = {}
    params: list[fx.Node] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen[cur] = None
        if cur.op == "placeholder":
            if not allow(cur):
                return None
            params.append(cur)
            continue
        if cur.op == "get_attr":
            continue
        if cur.op not in ("call_function", "call_method"):
            return None
        stack.extend(n for n in cur.all_input_nodes)
    order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
    return sorted((n for n in seen if n.op in ("call_function", "call_method")), key=order.__getitem__), params


def _evaluate(nodes: list[fx.Node], values: dict[fx.Node, object], ctx: PassContext):
    """Run a small constant subgraph on concrete values (placeholders given in `values`)."""
    def load(n):
        if n in values:
            return values[n]
        if n.op == "get_attr":
            return getattr(ctx.gm, n.target)
        raise KeyError(n)

    for n in nodes:
        args = fx.map_arg(n.args, load)
        kwargs = fx.map_arg(n.kwargs, load)
        if n.op == "call_function":
            values[n] = n.target(*args, **kwargs)
        else:
            self_obj, *rest = args
            values[n] = getattr(self_obj, n.target)(*rest, **kwargs)
    return values


def _graph_constant(ctx: PassContext, node) -> torch.Tensor | None:
    """The tensor a get_attr node reads (a constant of the graph), else None."""
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return getattr(ctx.gm, node.target)
    return None


def _state_value(ctx: PassContext, node) -> torch.Tensor | None:
    """The compile-time value of `node` when it is computed from the model's parameters and
    buffers only (FFTChainLinear's `perms[1:]`), guarded so that a change recompiles; else None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        return getattr(ctx.gm, node.target)
    found = _constant_ancestors(node, ctx, allow=ctx.is_model_state)
    if found is None:
        return None
    nodes, placeholders = found
    values: dict = {p: ctx.guard_tensor(p) for p in placeholders}
    if any(v is None for v in values.values()):
        return None
    with torch.no_grad():
        _evaluate(nodes, values, ctx)
    value = values.get(node)
    return value if isinstance(value, torch.Tensor) else None


def _operand_tables(ctx: PassContext, shared: dict, impl: str, x, in_features: int, block_size: int, coeff_real,
                    coeff_imag, perms) -> dict[str, fx.Node]:
    """get_attr nodes of the operand tables of `impl` that can be built at compile time (see
    fft_chain.operand_tables); none for an exported graph (ONNX has its own form of the op). The
    DFT matrices, and source indices of equal permutations, are one constant per graph (`shared`)."""
    dev, dt = device(x), dtype(x)
    if ctx.for_export or dev is None or dt is None:
        return {}
    with torch.no_grad():
        tables = fft.operand_tables(impl, dt, block_size, in_features, dev, perms=perms,
                                    coeff_real=coeff_real, coeff_imag=coeff_imag)
    nodes = {}
    for name, table in tables.items():
        if name in ("dft_forward", "dft_inverse"):
            key = (name, block_size, table.dtype, table.device)
        elif name == "source_index":
            key = (name, impl, block_size, in_features, table.device, perms.detach().cpu().numpy().tobytes())
        else:  # G: one per layer
            nodes[name] = ctx.add_constant(table, f"fft_{name}")
            continue
        if key not in shared:
            shared[key] = ctx.add_constant(table, f"fft_{name}")
        nodes[name] = shared[key]
    return nodes


def _tables_note(ctx: PassContext, impl: str, k: int, tables: dict) -> str:
    read = () if ctx.for_export else fft.tables_read(impl, k)
    if not read:
        return ""
    per_call = [name for name in read if name not in tables]
    return (f"; operand tables {', '.join(n for n in read if n in tables) or 'none'} as constants"
            + (f", {', '.join(per_call)} built per call" if per_call else ""))


def _set_tables(node: fx.Node, tables: dict[str, fx.Node]) -> None:
    """Give the op node exactly `tables` (any table it had before was built for another choice)."""
    for position, name in enumerate(fft.TABLE_NAMES, start=8):
        value = tables.get(name)
        if len(node.args) > position:
            node.update_arg(position, value)
        elif value is not None or name in node.kwargs:
            node.update_kwarg(name, value)


class FFTLinearPass(GraphPass):
    name = "fft_linear"
    lossless = False  # dense linears through a plan change numerics (FFTChainLinear ops do not)

    def run(self, ctx: PassContext) -> None:
        shared: dict = {}  # operand tables one graph's call sites share
        for node in [n for n in ctx.gm.graph.nodes if n.op == "call_function" and n.target in (OP, torch.ops.graphopt.fft_chain_linear)]:
            self._lower_structured(ctx, node, shared)
        section = plan_section(ctx, self.name)
        for match in find_linears(ctx):
            self._dense(ctx, match, section, shared)

    # -- 1. FFTChainLinear: pick the kernel, fold the spectrum ------------------------------
    def _lower_structured(self, ctx: PassContext, node: fx.Node, shared: dict) -> None:
        x, coeff_real, coeff_imag, perms, bias = (arg(node, i, n) for i, n in enumerate(("x", "coeff_real", "coeff_imag", "perms", "bias")))
        block_size, out_features = arg(node, 5, "block_size"), arg(node, 6, "out_features")
        x_shape, c_shape, p_shape = shape(x), shape(coeff_real), shape(perms)
        rows = tokens(x)
        if None in (x_shape, c_shape, p_shape, rows):
            ctx.record(self.name, False, "shapes of the fft_chain_linear inputs are unknown (dynamic shapes); left at impl='auto'", node=node)
            return
        in_features, k = x_shape[-1], p_shape[0] + 1
        dt = dtype(x)
        dtype_bytes = torch.empty((), dtype=dt).element_size() if dt is not None else 4
        has_bias = bias is not None
        impl, after = fft_cost.choose_implementation(ctx.hardware, rows, in_features, out_features, block_size, k,
                                                device_type=_device_type(x), dtype_bytes=dtype_bytes, bias=has_bias)
        before = fft_cost.estimate_fft_chain(ctx.hardware, rows, in_features, out_features, block_size, k, "torch",
                                        dtype_bytes=dtype_bytes, bias=has_bias)
        folded = self._fold_spectrum(ctx, node, coeff_real, coeff_imag)
        coeff_real, coeff_imag = arg(node, 1, "coeff_real"), arg(node, 2, "coeff_imag")  # the constants, when folded
        read = () if ctx.for_export else fft.tables_read(impl, k)
        # the permutation buffer is read (and guarded) only when the chosen kernel gathers through it
        perms_value = _state_value(ctx, perms) if "source_index" in read else None
        tables = _operand_tables(ctx, shared, impl, x, in_features, block_size, _graph_constant(ctx, coeff_real),
                                 _graph_constant(ctx, coeff_imag), perms_value) if read else {}
        reason = (f"FFTChainLinear {in_features}->{out_features} B={block_size} K={k}: {impl} kernel for {rows} tokens "
                  f"(predicted {before.ms:.4f} ms with the torch path -> {after.ms:.4f} ms)"
                  + ("; coefficient spectrum folded into constants" if folded else "; spectrum computed per call (trainable)")
                  + _tables_note(ctx, impl, k, tables))
        ctx.record(self.name, True, reason, node=node, before=before, after=after, implementation=f"fft_chain[{impl}]",
                   block_size=block_size, k=k, spectrum_folded=folded, operand_tables=sorted(tables))
        if len(node.args) > 7:
            node.update_arg(7, impl)
        else:
            node.update_kwarg("impl", impl)
        _set_tables(node, tables)

    def _fold_spectrum(self, ctx: PassContext, node: fx.Node, coeff_real, coeff_imag) -> bool:
        found = {}
        for which in (coeff_real, coeff_imag):
            if not isinstance(which, fx.Node) or which.op == "get_attr":
                return False
            anc = _constant_ancestors(which, ctx)
            if anc is None or not anc[1]:
                return False
            found[which] = anc
        values: dict = {}
        for nodes, params in found.values():
            for p in params:
                values[p] = ctx.freeze(p)
            with torch.no_grad():
                _evaluate(nodes, values, ctx)
        real = ctx.add_constant(values[coeff_real].detach().contiguous(), "fft_coeff_real")
        imag = ctx.add_constant(values[coeff_imag].detach().contiguous(), "fft_coeff_imag")
        node.replace_input_with(coeff_real, real)
        node.replace_input_with(coeff_imag, imag)
        dead = [n for nodes, _ in found.values() for n in reversed(nodes)]
        for n in dead:
            if n.graph is ctx.gm.graph and not n.users:
                ctx.gm.graph.erase_node(n)
        return True

    # -- 2. dense linears through a plan -------------------------------------------------------
    def _dense(self, ctx: PassContext, m, section, shared: dict) -> None:
        location = m.location
        if section is None:
            ctx.record(self.name, False, "dense linear: no fft_linear plan section (fit one with `graphopt fftchain distill`)", node=m.node)
            return
        entry = section.get("layers", {}).get(location)
        if entry is None:
            # name a few planned layers: a plan distilled from another model (or another wrapping
            # of it, with other module paths) shows up here
            planned = sorted(section.get("layers", {}))
            named = ", ".join(planned[:3]) + (", ..." if len(planned) > 3 else "") if planned else "none"
            ctx.record(self.name, False, f"dense linear {location or '?'}: the plan has no fitted FFT-chain coefficients "
                       f"for it (its layers: {named})", node=m.node)
            return
        if m.shard is not None:
            why = m.problem or (f"{m.shard.describe()}: a plan's FFT chain is fitted to the whole weight of a "
                                "single-device model and does not split into per-rank shards")
            ctx.record(self.name, False, f"tensor-parallel linear: {why}", node=m.node)
            return
        budget = ctx.config.error_budget["fft_linear"]
        err = entry.get("rel_error")
        if err is None or not err <= budget:  # NaN never passes
            ctx.record(self.name, False, f"fitted error {err} exceeds error_budget['fft_linear']={budget}", node=m.node, rel_error=err)
            return
        if (entry.get("in_features"), entry.get("out_features")) != (m.in_features, m.out_features):
            ctx.record(self.name, False, f"plan shape {entry.get('in_features')}x{entry.get('out_features')} does not match the layer "
                       f"{m.in_features}x{m.out_features}", node=m.node)
            return
        ok, why = ctx.can_freeze(m.weight_node)
        if not ok:
            ctx.record(self.name, False, why, node=m.node)
            return
        recorded = entry.get("weight_fingerprint")
        if recorded is not None and not same_weights(recorded, ctx.example_value(m.weight_node)):
            # the weight changed since the fit (an update, another checkpoint): the coefficients
            # approximate the old one; the frozen-weight guard brings a changed weight back here
            ctx.record(self.name, False, f"the plan's coefficients were fitted to other weights than {location}'s "
                       "current ones (fit again with graphopt fftchain distill)", node=m.node)
            return
        if (why := bias_problem(m)) is not None:
            ctx.record(self.name, False, why, node=m.node)
            return
        tokens = m.tokens()
        if tokens is None:
            ctx.record(self.name, False, "token count unknown (dynamic shapes)", node=m.node)
            return
        block_size, k = int(entry["block_size"]), int(entry["k"])
        dt = dtype(m.input)
        dtype_bytes = torch.empty((), dtype=dt).element_size() if dt is not None else 4
        has_bias = m.bias_node is not None
        before = cost_model.linear(ctx.hardware, tokens, m.in_features, m.out_features, dtype_bytes=dtype_bytes, bias=has_bias)
        impl, after = fft_cost.choose_implementation(ctx.hardware, tokens, m.in_features, m.out_features, block_size, k,
                                                device_type=_device_type(m.input), dtype_bytes=dtype_bytes, bias=has_bias)
        ok, why = self.accept(ctx, before, after)
        if not ok:
            ctx.record(self.name, False, why, node=m.node, before=before, after=after)
            return
        from safetensors.torch import load_file

        tensors = load_file(str(Path(section["_dir"]) / section["file"]))
        coeffs = tensors[f"{location}.coeffs"]
        perms = tensors[f"{location}.perms"]
        dev = device(m.input) or torch.device("cpu")
        cr, ci = fft.spectral_coefficients(coeffs.to(dev))
        m.weight(ctx)  # freeze: a changed dense weight recompiles (the plan then no longer matches it)
        args = [m.input, ctx.add_constant(cr, "fft_coeff_real"), ctx.add_constant(ci, "fft_coeff_imag"),
                ctx.add_constant(perms[1:].to(dev).contiguous(), "fft_perms")]
        if has_bias:  # keep the model's own bias (unchanged by the fit)
            args.append(m.bias_node)
        elif entry.get("bias") and f"{location}.bias" in tensors:
            args.append(ctx.add_constant(tensors[f"{location}.bias"].to(dev), "fft_bias"))
        else:
            args.append(None)
        args += [block_size, m.out_features, impl]
        tables = _operand_tables(ctx, shared, impl, m.input, m.in_features, block_size, cr, ci, perms[1:])
        ctx.record(self.name, True, f"{why}; fitted B={block_size} K={k}, held-out rel. error {err:.4f} <= {budget}"
                   + _tables_note(ctx, impl, k, tables), node=m.node,
                   before=before, after=after, implementation=f"fft_chain[{impl}]", rel_error=err,
                   memory_saved_bytes=(m.in_features * m.out_features - coeffs.numel()) * dtype_bytes,
                   operand_tables=sorted(tables))
        replace_with_call(ctx, m.node, OP, tuple(args), tables, matched=list(m.extra_nodes))


PASS = FFTLinearPass()


# =============================================================================================
# ONNX: standard DFT (opset 20) + real MatMuls for the contraction + inverse DFT
# =============================================================================================
def _onnx_fft_chain(x, coeff_real, coeff_imag, perms, bias, block_size: int, out_features: int, impl: str = "auto",
                    dft_forward=None, dft_inverse=None, source_index=None, coeff_operand=None):
    """rfft as DFT(onesided) on the permuted, padded blocks; the complex contraction as four real
    MatMuls per frequency batch; the inverse as a full-length inverse DFT of the Hermitian-extended
    spectrum (real part), then crop and bias. The Triton kernels' operand tables play no part."""
    from onnxscript import opset20 as op

    c_len, n_out, freqs = coeff_real.shape
    k = perms.shape[0] + 1
    in_features = x.shape[-1]
    n_in = c_len // k
    pad = n_in * block_size - in_features
    xf = op.Cast(x, to=1)  # FLOAT
    x2d = op.Reshape(xf, op.Constant(value_ints=[-1, in_features]))  # (T, in)
    channels = [op.Unsqueeze(x2d, op.Constant(value_ints=[1]))]
    if k > 1:
        channels.append(op.Gather(x2d, perms, axis=1))  # (T, K-1, in)
    xk = op.Concat(*channels, axis=1) if k > 1 else channels[0]  # (T, K, in)
    if pad:
        xk = op.Pad(xk, op.Constant(value_ints=[0, 0, 0, 0, 0, pad]))
    blocks = op.Reshape(xk, op.Constant(value_ints=[-1, c_len, block_size, 1]))  # (T, C, B, 1) real signal
    spec = op.DFT(blocks, op.Constant(value_int=block_size), op.Constant(value_int=2), onesided=1)  # (T, C, F, 2)
    xr = op.Transpose(op.Squeeze(op.Slice(spec, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), op.Constant(value_ints=[3])), op.Constant(value_ints=[3])), perm=[2, 0, 1])  # (F, T, C)
    xi = op.Transpose(op.Squeeze(op.Slice(spec, op.Constant(value_ints=[1]), op.Constant(value_ints=[2]), op.Constant(value_ints=[3])), op.Constant(value_ints=[3])), perm=[2, 0, 1])
    cr = op.Transpose(op.Cast(coeff_real, to=1), perm=[2, 0, 1])  # (F, C, N)
    ci = op.Transpose(op.Cast(coeff_imag, to=1), perm=[2, 0, 1])
    yr = op.Sub(op.MatMul(xr, cr), op.MatMul(xi, ci))  # (F, T, N)
    yi = op.Add(op.MatMul(xr, ci), op.MatMul(xi, cr))
    # Hermitian extension: bins F .. B-1 are conj of bins B-F .. 1 (reverse of 1 .. B-F)
    tail = block_size - freqs  # number of mirrored bins
    starts, ends = op.Constant(value_ints=[tail]), op.Constant(value_ints=[0])
    step, axis0 = op.Constant(value_ints=[-1]), op.Constant(value_ints=[0])
    full_r = op.Concat(yr, op.Slice(yr, starts, ends, axis0, step), axis=0)  # (B, T, N)
    full_i = op.Concat(yi, op.Neg(op.Slice(yi, starts, ends, axis0, step)), axis=0)
    full = op.Concat(op.Unsqueeze(op.Transpose(full_r, perm=[1, 2, 0]), op.Constant(value_ints=[3])),
                     op.Unsqueeze(op.Transpose(full_i, perm=[1, 2, 0]), op.Constant(value_ints=[3])), axis=3)  # (T, N, B, 2)
    inv = op.DFT(full, op.Constant(value_int=block_size), op.Constant(value_int=2), inverse=1, onesided=0)  # (T, N, B, 2)
    y = op.Squeeze(op.Slice(inv, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), op.Constant(value_ints=[3])), op.Constant(value_ints=[3]))
    y = op.Reshape(y, op.Constant(value_ints=[-1, n_out * block_size]))
    y = op.Slice(y, op.Constant(value_ints=[0]), op.Constant(value_ints=[out_features]), op.Constant(value_ints=[1]))
    if bias is not None:
        y = op.Add(y, op.Cast(bias, to=1))
    out_shape = op.Concat(op.Slice(op.Shape(x), op.Constant(value_ints=[0]), op.Constant(value_ints=[-1])),
                          op.Constant(value_ints=[out_features]), axis=0)
    return op.CastLike(op.Reshape(y, out_shape), x)


register_onnx_translation(OP, form="standard")(_onnx_fft_chain)
