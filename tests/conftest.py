"""Test setup. Without a GPU, Triton kernels run in the interpreter (TRITON_INTERPRET=1), which
Triton reads when a kernel is decorated, so it is set here before any graphopt kernel import."""

import contextlib
import os
import socket

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as _tl  # noqa: E402


def _language_members():
    """(object, name, value) of every attribute the interpreter patches (triton.runtime.interpreter
    ._patch_lang): the language modules' builtins and the tensor class's."""
    owners = (_tl, _tl.core, _tl.math, _tl.core.tensor, _tl.core.tensor_descriptor_base)
    return [(owner, name, value) for owner in owners for name, value in vars(owner).items()]


_PRISTINE_LANGUAGE = _language_members()


@pytest.fixture
def pristine_triton_language():
    """triton.language as imported. The interpreter patches it for every @triton.jit helper that a
    kernel calls (InterpretedFunction.__call__) and never restores that patch, so after an
    interpreted kernel, a real compile in the same process (the offline sm_90 builds) can run its
    front end on the interpreter's builtins. This puts the originals back first."""
    for owner, name, value in _PRISTINE_LANGUAGE:
        if vars(owner).get(name) is not value:
            setattr(owner, name, value)
    yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graphs leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@contextlib.contextmanager
def tf32_allowed():
    """torch.backends.cuda.matmul.allow_tf32 on for the block, its value restored after (set and
    read back through the property: pytest's monkeypatch cannot delete it on undo)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def free_port() -> int:
    """A TCP port free on this host, for the rendezvous of spawned process groups."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def q4_gluon_node(x, qweight, scales, kernel):
    """The one call node of a fake-mode trace of graphopt::q4_gluon_linear(x, qweight, scales, None,
    kernel): what a graph that runs a Gluon Q4 tile holds."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, qweight, scales):
        return torch.ops.graphopt.q4_gluon_linear(x, qweight, scales, None, kernel)

    (node,) = [n for n in make_fx(step, tracing_mode="fake")(x, qweight, scales).graph.nodes if n.op == "call_function"]
    return node


def replayed_in_cuda_graph(call):
    """call() captured in a CUDA graph and replayed once: the captured output, synchronized."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    return captured


@pytest.fixture(scope="module")
def one_rank_mesh(tmp_path_factory):
    """A 1-D device mesh of one gloo rank: this process joins a default process group of one for
    the test module (the placements, and so graphopt's per-rank rewrites, are those of any
    tensor-parallel size)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("store") / "file"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()
