"""The block-sparse attention kernel's autotune space per head dim and dtype: fp32 inputs (IEEE
dots, FMA code) tune one config, tensor-core dtypes keep their space, and every config kept for a
non-power-of-two head dim builds for sm_90 in bounded time (offline, in a subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphopt.kernels import sparse_attention as sa
from graphopt.kernels.sparse_attention import attention_kernel as ak


def _kept(head_dim, precision, tma_kv=True):
    return ak._kept_configs(sa._attention_configs(), head_dim, precision, tma_kv=tma_kv,
                            single_loop=tma_kv and ak._single_loop_body_supported(head_dim, False))


@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 80, 96, 128, 256])
def test_fp32_inputs_tune_one_pointer_load_config(head_dim):
    (config,) = _kept(head_dim, "ieee")
    assert config.kwargs == {"PREFETCH_INDEX": 1, "USE_TMA": 0, "PAIR_BLOCKS": 0}
    assert (config.num_warps, config.num_stages) == (4 if head_dim <= 32 else 8, 2)


@pytest.mark.parametrize("head_dim", [48, 64, 128])
def test_tensor_core_dtypes_keep_descriptor_and_pair_configs(head_dim):
    # the fp32 rule must not reach bf16 / fp16 launches (DOT_PRECISION "tf32")
    kept = _kept(head_dim, "tf32")
    assert any(c.kwargs["USE_TMA"] for c in kept) and any(c.kwargs["PAIR_BLOCKS"] for c in kept)
    assert any(c.kwargs.get("SINGLE_LOOP") for c in kept) == (head_dim & (head_dim - 1) == 0)
    assert len({(c.num_warps, c.num_stages, tuple(c.kwargs.items())) for c in kept}) == len(kept) > 4


def test_autotuner_pruning_reads_the_launch_precision():
    # the autotuner hands the launch's constexprs as keyword arguments and the tensors as named_args
    t = torch.empty(1, 2, 200, 48)
    named = {"q_ptr": t, "k_ptr": t, "v_ptr": t, "o_ptr": t}
    fp32 = sa._prune_attention_configs(sa._attention_configs(), named, HEAD_DIM=48, PV_SKIP=False,
                                       DOT_PRECISION="ieee")
    bf16 = sa._prune_attention_configs(sa._attention_configs(), named, HEAD_DIM=48, PV_SKIP=False,
                                       DOT_PRECISION="tf32")
    key = lambda c: (c.num_warps, c.num_stages, tuple(sorted(c.kwargs.items())))  # noqa: E731
    assert len(fp32) == 1 and len(bf16) > 1
    assert key(fp32[0]) in {key(c) for c in bf16}


_BUILD = """
import json, sys
from bench.offline_sm90 import sparse_config_builds
for config, seconds, resources, instructions in sparse_config_builds(int(sys.argv[1]), sys.argv[2]):
    print(json.dumps(dict(config=f"{config}", seconds=seconds, resources=resources, instructions=instructions)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_configs_kept_for_head_dim_48_build_for_sm90_in_bounded_time(dtype, tmp_path):
    """Every config the tuner builds for head dim 48 (BLOCK_D 64), through ptxas for sm_90. In fp32
    the whole space is 16 builds, the 4-warp ones 55k+ SASS instructions with 7-13 KB of spills per
    thread; the bounds hold the kept set to a fraction of that."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # build, never load a cached binary
    run = subprocess.run([sys.executable, "-c", _BUILD, "48", dtype], capture_output=True, text=True, timeout=600,
                         env=env, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-2000:]
    builds = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(builds) == len(_kept(48, "ieee" if dtype == "fp32" else "tf32")) >= 1
    for build in builds:
        assert build["seconds"] < 20, build
        assert build["instructions"] < 20_000, build
    assert sum(b["seconds"] for b in builds) < 60, builds
