"""graphopt on tensor-parallel models: two CPU processes (gloo) split a tiny LLaMA with PyTorch's
own tensor parallelism (torch.distributed.tensor.parallel.parallelize_module, ColwiseParallel on
q/k/v and gate/up, RowwiseParallel on o and down), compile it with graphopt, and compare with the
same model in one process compiled with the same options.

One spawn runs every case (module fixture `runs`); the tests read what each rank recorded. Lossy
passes are compared against the single-process model with the same pass: a rank quantizes its own
shard, with block boundaries inside the shard and (NVFP4) the whole weight's global scale, so its
blocks are the single-process model's blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graphopt.passes.base import GraphPass
from tests.conftest import free_port

pytestmark = [pytest.mark.slow,  # one two-process spawn for the module
              pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")]

WORLD = 2
VOCAB = 128
LAYERS = 1  # every split linear and the attention once: a DTensor graph traces slowly on CPU
LINEARS = 7 * LAYERS + 1  # q/k/v/o, gate/up/down per layer, and lm_head (replicated)
FORCED = dict(force=True, target="h100")  # the GPU cost model's candidates; on CPU every op runs its reference
EAGER = dict(downstream="eager")  # the passes and the rewritten graph are the same; Inductor in one case only (time)
CASES: dict[str, dict] = {
    "attention": dict(**FORCED, **EAGER),  # the default passes
    "fp4_linear": dict(passes={"fp4_linear": True}, **FORCED),  # NVFP4; Inductor traces the rewritten DTensor graph
    "attention-inductor": dict(**FORCED),  # DTensor parameters handed to Inductor's graph as local shards
    "fp4_linear-mxfp4": dict(passes={"fp4_linear": True}, fp4_format="mxfp4", **FORCED, **EAGER),
    "q4_linear": dict(passes={"q4_linear": True}, **FORCED, **EAGER),
    # with a plan tuned on the whole model (write_plan): 4 heads per layer, a dense FFT chain for gate_proj
    "sparse_attention+fft_linear": dict(passes={"sparse_attention": True, "fft_linear": True}, **FORCED, **EAGER),
    # the all-reduces after o_proj and down_proj as graphopt::all_reduce (on CPU its functional all-reduce)
    "all_reduce": dict(passes={"all_reduce": True}, **FORCED),
    "fp4_linear+all_reduce": dict(passes={"fp4_linear": True, "all_reduce": True}, **FORCED, **EAGER),
}
ALL_REDUCE_CASES = ("all_reduce", "fp4_linear+all_reduce")
PLANNED = "sparse_attention+fft_linear"
SIM = [0.1, 0.2, 0.3, 0.4]  # the plan's per-head simthreshd1: rank r gets heads 2r, 2r+1
LOSSLESS = ("attention", "attention-inductor")


def tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         num_hidden_layers=LAYERS, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


def parallelize_llama(model, mesh):
    """The tensor-parallel plan gpt-fast and torchtitan use for a LLaMA decoder layer."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def transformers_parallelize(model, mesh):
    """The split transformers' own tensor parallelism (from_pretrained(tp_plan="auto"), which needs
    accelerate) applies to the model: its tp_plan through apply_tensor_parallelism. DTensor
    parameters, plain local activations, its hooks doing the collectives. None where this
    transformers has no such API."""
    try:
        from transformers.integrations.tensor_parallel import apply_tensor_parallelism

        plan = model._expand_parallel_plan(model._tp_plan)
    except (ImportError, AttributeError):
        return None
    return apply_tensor_parallelism(model, mesh, plan)


class BiasedMLP(torch.nn.Module):
    """A column-parallel linear with a bias (split with the weight) and a row-parallel one with a
    bias (added once to the partial sums: by mesh index 0)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def write_plan(directory: Path) -> Path:
    """A plan as the tuners write it for the single-device model: per-head sparse thresholds for
    every attention, fitted FFT-chain coefficients for layer 0's gate_proj."""
    from safetensors.torch import save_file

    from graphopt.kernels.sparse_attention import BLOCK_M, BLOCK_N
    from graphopt.plan import save_plan

    head = dict(heads=4, is_causal=True, head_dim=16, simthreshd1=SIM, cdfthreshd=[0.9] * 4, pvthreshd=[None] * 4,
                dense=[False] * 4, sparsity=[0.5] * 4, l1=[0.01] * 4)
    save_file({"model.layers.0.mlp.gate_proj.coeffs": torch.zeros(2, 2, 1, 64)}, str(directory / "fft.safetensors"))
    layer = dict(in_features=64, out_features=128, block_size=64, k=2, rel_error=0.01)
    return save_plan(directory / "plan.json", {
        "sparse_attention": dict(block_m=BLOCK_M, block_n=BLOCK_N, l1=0.06,
                                 layers={f"model.layers.{i}.self_attn": head for i in range(LAYERS)}),
        "fft_linear": dict(file="fft.safetensors", layers={"model.layers.0.mlp.gate_proj": layer})})


class _AllReduceNodes(GraphPass):
    """Runs after the registry's passes: notes, per compiled graph, what each graphopt::all_reduce
    node reads and its slot."""

    name = "test_all_reduce_nodes"
    seen: list = []

    def run(self, ctx) -> None:
        _AllReduceNodes.seen.append([(str(n.args[0].target), n.args[2]) for n in ctx.gm.graph.nodes
                                     if n.op == "call_function" and str(n.target) == "graphopt.all_reduce.default"])


def _decisions(report) -> list[dict]:
    return [dict(pass_name=d.pass_name, applied=d.applied, location=d.location, reason=d.reason, rank=d.rank,
                 shard=d.details.get("shard"), simthreshd1=d.details.get("simthreshd1"),
                 implementation=d.implementation, slot=d.details.get("slot")) for d in report.decisions]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import graphopt
        from graphopt.passes import register_extra_pass, unregister_extra_pass
        from graphopt.quant import quantized_layers
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (WORLD,))
        ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
        results: dict = {}
        plan_dir = Path(out_dir) / f"plan{rank}"
        plan_dir.mkdir(exist_ok=True)
        plan = str(write_plan(plan_dir))
        register_extra_pass(_AllReduceNodes())
        for name, options in CASES.items():
            options = {**options, "plan": plan} if name == PLANNED else options
            _AllReduceNodes.seen = []
            report = graphopt.explain(parallelize_llama(tiny_llama(), mesh), ids, **options)
            gathered = report.all_ranks()
            entry = dict(logits=report.output.logits, decisions=_decisions(report), table=str(report),
                         gathered=[(r.rank, r.world_size, r.counts) for r in gathered],
                         all_reduce_nodes=list(_AllReduceNodes.seen))
            if list(CASES).index(name) % WORLD == rank:  # the single-process runs, shared out between the ranks
                entry["single"] = graphopt.explain(tiny_llama(), ids, **options).output.logits
                if name in LOSSLESS:
                    with torch.no_grad():
                        entry["float64"] = tiny_llama(torch.float64)(ids).logits
            results[name] = entry
        unregister_extra_pass(_AllReduceNodes.name)
        # transformers' own split: each rank's shard multiplied as weight.to_local()
        hf_model = transformers_parallelize(tiny_llama(), mesh)
        if hf_model is not None:
            options = dict(passes={"fp4_linear": True}, **FORCED, **EAGER)
            report = graphopt.explain(hf_model, ids, **options)
            results["transformers"] = dict(logits=report.output.logits, decisions=_decisions(report))
            if rank == 0:
                results["transformers"]["single"] = graphopt.explain(tiny_llama(), ids, **options).output.logits
            try:
                graphopt.quantize_(hf_model, format="nvfp4")
            except ValueError as exc:
                results["transformers"]["quantize_error"] = str(exc)
        # graphopt.quantize_ on the split model: each rank packs its shards, and the layers keep the split's hooks
        for fmt in ("nvfp4", "q4_0"):
            quantized = graphopt.quantize_(parallelize_llama(tiny_llama(), mesh), format=fmt)
            entry = dict(layers={name: repr(m) for name, m in quantized_layers(quantized).items()})
            with torch.no_grad():
                entry["eager"] = quantized(ids).logits
            if fmt == "nvfp4":
                report = graphopt.explain(quantized, ids, passes={"fp4_linear": True}, **EAGER)
                entry.update(logits=report.output.logits, decisions=_decisions(report))
            if rank == 0:
                with torch.no_grad():
                    entry["single"] = graphopt.quantize_(tiny_llama(), format=fmt)(ids).logits
            results[f"quantize_{fmt}"] = entry
        # biases: the column-parallel one split with its weight, the row-parallel one added by rank 0
        mlp = parallelize_module(BiasedMLP().eval(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2))
        options = dict(passes={"fp4_linear": True}, **FORCED, **EAGER)
        report = graphopt.explain(mlp, x, **options)
        with torch.no_grad():  # clone: the outputs end in DTensor's async all-reduce, which torch.save does not wait for
            results["biased_mlp"] = dict(output=report.output.clone(), decisions=_decisions(report),
                                         single=graphopt.explain(BiasedMLP().eval(), x, **options).output,
                                         float64=BiasedMLP().double()(x.double()), eager=mlp(x).clone())
        # q4_linear where only rank 1's tuner finds no tile computing the product: every rank keeps both layers dense
        results["q4_no_tile_on_rank_1"] = _q4_without_tiles_on_rank_1(rank, mlp, x)
        # sequence parallel: the input arrives split over tokens and is all-gathered before the linear
        sp = parallelize_module(BiasedMLP().eval(), mesh, {"up": ColwiseParallel(input_layouts=Shard(1)),
                                                           "down": RowwiseParallel()})
        x_local = x[:, :4].chunk(WORLD, dim=1)[rank]  # this rank's 2 of 4 tokens
        report = graphopt.explain(sp, x_local, **options)
        with torch.no_grad():
            results["sequence_parallel"] = dict(output=report.output.clone(), decisions=_decisions(report),
                                                eager=sp(x_local).clone())
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _q4_without_tiles_on_rank_1(rank: int, model, x) -> dict:
    """graphopt.explain of the split `model` with q4_linear forced, its tiles tuned as on a GPU,
    where rank 1's tuner finds no tile computing the product and rank 0's keeps the untuned default."""
    import graphopt
    from graphopt.kernels.tuning import NoCorrectTile
    from graphopt.passes import q4_linear as q4_pass

    def tune(x_shape, qweight, scales, bias, dtype, mode, allow_gluon):
        if rank == 1:
            raise NoCorrectTile(f"no Q4 {mode} tile computed the product for {x_shape}")
        return ""

    saved = q4_pass._tunable, q4_pass.q4k.tune_q4_linear
    q4_pass._tunable, q4_pass.q4k.tune_q4_linear = (lambda ctx, info, qweight: True), tune
    try:
        report = graphopt.explain(model, x, passes={"q4_linear": True}, **FORCED, **EAGER)
    finally:
        q4_pass._tunable, q4_pass.q4k.tune_q4_linear = saved
    with torch.no_grad():
        return dict(output=report.output.clone(), decisions=_decisions(report), eager=model(x).clone())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """What each rank recorded, by rank. One spawn per pytest run: under pytest-xdist the workers
    share the run's base temporary directory, and the first to take the lock runs it for all."""
    import torch.multiprocessing as mp
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this pytest run's base directory, not an earlier run's
    out_dir = shared / "tensor_parallel"
    with FileLock(str(shared / "tensor_parallel.lock")):
        if not (out_dir / "done").exists():
            out_dir.mkdir(exist_ok=True)
            mp.spawn(_worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
            (out_dir / "done").touch()
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    reference = reference.double()
    return float(10 * torch.log10(reference.pow(2).sum() / (reference - approximation.double()).pow(2).sum()))


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_logits_equal_single_process(runs, case):
    """Every rank's logits equal the single-process model's with the same options, within fp32
    tolerance; the lossless case also equals the float64 model."""
    reference = runs[list(CASES).index(case) % WORLD][case]
    for rank in range(WORLD):
        torch.testing.assert_close(runs[rank][case]["logits"], reference["single"])
    if case in LOSSLESS:
        torch.testing.assert_close(runs[0][case]["logits"].double(), reference["float64"], rtol=1e-5, atol=1e-5)


def test_dtensor_parameters_reach_inductor_as_local_shards(runs):
    """Compiled by Inductor under no_grad, the graph takes each DTensor parameter as its local shard
    (one Decision per rank); its logits equal the single-process model's (the test above). The
    eager downstream keeps the DTensor inputs."""
    for rank in range(WORLD):
        local = [d for d in runs[rank]["attention-inductor"]["decisions"] if d["pass_name"] == "tensor_parallel"]
        assert len(local) == 1 and local[0]["applied"] and local[0]["rank"] == rank
        assert local[0]["reason"].startswith(f"{7 * LAYERS} DTensor inputs")
        assert not any(d["pass_name"] == "tensor_parallel" for d in runs[rank]["attention"]["decisions"])


def test_attention_rewrites_each_ranks_local_heads(runs):
    """Each rank rewrites the attention over its local heads (2 of 4 query heads, 1 of 2 KV heads:
    GQA within the rank)."""
    for rank in range(WORLD):
        applied = [d for d in runs[rank]["attention"]["decisions"] if d["pass_name"] == "attention" and d["applied"]]
        assert [d["location"] for d in applied] == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
        assert all(d["rank"] == rank for d in applied)


@pytest.mark.parametrize("case", ["fp4_linear", "fp4_linear-mxfp4", "q4_linear"])
def test_weight_passes_rewrite_every_shard(runs, case):
    """The seven split linears of each layer are rewritten on their local shards (q/k/v and
    gate/up as sibling groups of local shards, o and down alone), and the replicated lm_head whole;
    each decision names the rank and the shard."""
    pass_name = case.split("-")[0]
    for rank in range(WORLD):
        decisions = [d for d in runs[rank][case]["decisions"] if d["pass_name"] == pass_name]
        assert len(decisions) == LINEARS and all(d["applied"] for d in decisions), decisions
        by_location = {d["location"]: d for d in decisions}
        q = by_location["model.layers.0.self_attn.q_proj"]
        down = by_location[f"model.layers.{LAYERS - 1}.mlp.down_proj"]
        assert q["shard"] == f"column-parallel shard 32x64 of 64x64 (mesh index {rank} of 2)"
        assert down["shard"] == f"row-parallel shard 64x64 of 64x128 (mesh index {rank} of 2)"
        assert "row-parallel shard 64x64 of 64x128" in down["reason"]
        assert "with its siblings" in q["reason"]
        assert by_location["lm_head"]["shard"] is None
        assert all(d["rank"] == rank for d in decisions)


def test_explain_report_names_the_rank_and_gathers_every_rank(runs):
    for rank in range(WORLD):
        entry = runs[rank]["fp4_linear"]
        assert f"rank {rank} of 2" in entry["table"]
        assert "column-parallel shard" in entry["table"]
        assert [(r, w) for r, w, _ in entry["gathered"]] == [(0, 2), (1, 2)]
        assert all(counts["fp4_linear"] == LINEARS for _, _, counts in entry["gathered"])


def test_fft_linear_declines_shards_with_the_reason(runs):
    """The plan's FFT chain for gate_proj was fitted to the whole weight: each rank declines it
    for its shard, saying so; nothing is rewritten."""
    for rank in range(WORLD):
        decisions = [d for d in runs[rank][PLANNED]["decisions"] if d["pass_name"] == "fft_linear"]
        assert decisions and not any(d["applied"] for d in decisions)
        gate = next(d for d in decisions if d["location"] == "model.layers.0.mlp.gate_proj")
        assert gate["reason"].startswith(f"tensor-parallel linear: column-parallel shard 64x64 of 128x64 (mesh index {rank}")
        assert "does not split into per-rank shards" in gate["reason"]


def test_sparse_attention_takes_each_ranks_heads_from_the_plan(runs):
    """A plan tuned on the single-device model (4 heads) gives each rank the thresholds of its two
    local heads."""
    for rank in range(WORLD):
        applied = [d for d in runs[rank][PLANNED]["decisions"] if d["pass_name"] == "sparse_attention" and d["applied"]]
        assert len(applied) == LAYERS
        for d in applied:
            assert d["simthreshd1"] == pytest.approx(SIM[2 * rank:2 * rank + 2])
            assert f"heads {2 * rank}-{2 * rank + 1} of 4: this tensor-parallel rank's" in d["reason"]


def test_biases_of_column_and_row_parallel_linears(runs):
    """Both biased linears are rewritten; the row-parallel bias counts once in the all-reduced sum."""
    for rank in range(WORLD):
        entry = runs[rank]["biased_mlp"]
        by_location = {d["location"]: d for d in entry["decisions"] if d["pass_name"] == "fp4_linear"}
        assert by_location["up"]["applied"] and by_location["up"]["shard"].startswith("column-parallel")
        assert by_location["down"]["applied"] and by_location["down"]["shard"].startswith("row-parallel")
        torch.testing.assert_close(entry["output"], entry["single"])
        assert _sqnr_db(entry["float64"], entry["output"]) > 15.0  # two NVFP4 layers
        assert not torch.equal(entry["output"], entry["eager"])  # the rewrite ran


def test_q4_layers_stay_dense_on_every_rank_when_one_rank_has_no_correct_tile(runs):
    """Rank 1 finds no Q4 tile computing the product, rank 0 does: the ranks agree, both keep both
    split linears dense (each saying where the tile was missing), and the output is the split
    model's eager output on every rank."""
    for rank in range(WORLD):
        entry = runs[rank]["q4_no_tile_on_rank_1"]
        decisions = [d for d in entry["decisions"] if d["pass_name"] == "q4_linear"]
        assert [(d["location"], d["applied"]) for d in decisions] == [("up", False), ("down", False)]
        where = "on this GPU" if rank == 1 else "on another tensor-parallel rank's GPU, so every rank keeps it dense"
        assert all("no Q4" in d["reason"] and where in d["reason"] for d in decisions), decisions
        torch.testing.assert_close(entry["output"], entry["eager"], rtol=1e-5, atol=1e-5)


def test_sequence_parallel_input_declined_with_the_reason(runs):
    """A linear whose input DTensor gathers a token-split input first is not the column-parallel form:
    declined, saying why, and the program runs as without the pass."""
    for rank in range(WORLD):
        entry = runs[rank]["sequence_parallel"]
        up = next(d for d in entry["decisions"] if d["pass_name"] == "fp4_linear" and d["location"] == "up")
        assert not up["applied"]
        assert "not a local tensor wrapped by DTensor.from_local" in up["reason"]
        down = next(d for d in entry["decisions"] if d["pass_name"] == "fp4_linear" and d["location"] == "down")
        assert down["applied"]
        assert _sqnr_db(entry["eager"], entry["output"]) > 15.0


@pytest.mark.parametrize("fmt", ["nvfp4", "q4_0"])
def test_quantize_packs_each_ranks_shards(runs, fmt):
    """graphopt.quantize_ on the split model quantizes each rank's shard (NVFP4 with the whole weight's
    global scale): the logits equal the unsplit model quantized the same way, eagerly and compiled."""
    single = runs[0][f"quantize_{fmt}"]["single"]
    for rank in range(WORLD):
        entry = runs[rank][f"quantize_{fmt}"]
        assert len(entry["layers"]) == LINEARS
        assert "in_features=64, out_features=32" in entry["layers"]["model.layers.0.self_attn.q_proj"]
        assert "tensor-parallel shard" in entry["layers"]["model.layers.0.self_attn.q_proj"]
        assert "tensor-parallel shard" not in entry["layers"]["lm_head"]
        torch.testing.assert_close(entry["eager"], single)
        if fmt == "nvfp4":
            torch.testing.assert_close(entry["logits"], single)
            kept = [d for d in entry["decisions"] if d["pass_name"] == "fp4_linear"]
            assert len(kept) == LINEARS and all("already quantized" in d["reason"] for d in kept)


def test_transformers_tensor_parallelism(runs):
    """transformers' own split (its tp_plan): every linear, lm_head included, rewritten on the rank's
    shard; the logits equal the unsplit model's with the same pass."""
    if "transformers" not in runs[0]:
        pytest.skip("this transformers has no apply_tensor_parallelism / _expand_parallel_plan")
    single = runs[0]["transformers"]["single"]
    for rank in range(WORLD):
        entry = runs[rank]["transformers"]
        torch.testing.assert_close(entry["logits"], single)
        decisions = [d for d in entry["decisions"] if d["pass_name"] == "fp4_linear"]
        assert len(decisions) == LINEARS and all(d["applied"] for d in decisions)
        by_location = {d["location"]: d for d in decisions}
        assert by_location["model.layers.0.self_attn.o_proj"]["shard"] == f"row-parallel shard 64x32 of 64x64 (mesh index {rank} of 2)"
        assert by_location["lm_head"]["shard"] == f"column-parallel shard 64x64 of 128x64 (mesh index {rank} of 2)"
        # quantize_ cannot keep the forward transformers' split replaces, and says so
        assert "layer 'model.layers.0.self_attn.q_proj'" in entry["quantize_error"]
        assert "transformers' own tensor parallelism" in entry["quantize_error"]


@pytest.mark.parametrize("case", ALL_REDUCE_CASES)
def test_all_reduce_rewrites_the_all_reduce_of_each_row_parallel_linear(runs, case):
    """Each rank rewrites the all-reduces after o_proj and down_proj (on CPU the op runs the
    functional all-reduce), alternating buffer slots, and records them; the rewritten graph holds
    the ops (after fp4_linear, each reads the FP4 op's local result directly). The logits equal
    the single-process model's (test_tensor_parallel_logits_equal_single_process)."""
    locations = [f"model.layers.{i}.{m}" for i in range(LAYERS) for m in ("self_attn.o_proj", "mlp.down_proj")]
    for rank in range(WORLD):
        entry = runs[rank][case]
        decisions = [d for d in entry["decisions"] if d["pass_name"] == "all_reduce"]
        assert [(d["location"], d["applied"], d["slot"], d["rank"]) for d in decisions] == [
            (location, True, i % 2, rank) for i, location in enumerate(locations)]
        assert all(d["implementation"] == f"functional (slot {d['slot']})" for d in decisions)
        assert all("tensors are on cpu" in d["reason"] for d in decisions)
        nodes = [node for graph in entry["all_reduce_nodes"] for node in graph]
        assert [slot for _, slot in nodes] == [i % 2 for i in range(len(locations))]
        if case.startswith("fp4_linear"):
            assert {source for source, _ in nodes} == {"graphopt.fp4_linear.default"}
        assert [counts.get("all_reduce") for _, _, counts in entry["gathered"]] == [len(locations)] * WORLD
