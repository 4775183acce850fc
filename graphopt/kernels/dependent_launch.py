"""Programmatic dependent launch for the persistent decode kernels (sm_90+).

At one token a decode GEMV reads a few megabytes: its launch, the ramp of its first weight loads
and the drain of the kernel before it cost as much as a good part of its reads. Launched with
CUDA's programmatic stream serialization, a kernel may start while the kernel before it on the
stream is still finishing: it requests the first chunks of its weights (graph constants, which no
kernel writes), then waits at `wait_for_previous_grid` until the previous grid has finished and
its writes are visible, and only then reads its activations or writes anything (its output may
reuse memory the previous kernel still reads). `release_next_grid` lets the kernel after it start
the same way as soon as every program of this one has passed that point. Both instructions do
nothing when the kernel was launched without the attribute; CUDA graphs keep the dependency.

Only a call whose input is another such call's output is launched so (the passes mark them): behind
an Inductor kernel, which never releases its dependents early, the attribute made a decode step
slower (bench/RESULTS.md section 1). GRAPHOPT_DEPENDENT_LAUNCH=0 launches every kernel the plain way.
"""

from __future__ import annotations

import os

from graphopt.hardware import compute_capability

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - no Gluon in this Triton
    gluon = None

ENABLED = os.environ.get("GRAPHOPT_DEPENDENT_LAUNCH", "1") != "0"


def dependent_launch(device_index: int) -> bool:
    """Whether kernels on CUDA device `device_index` are launched as dependents of the kernel before
    them: griddepcontrol needs sm_90."""
    return ENABLED and compute_capability(device_index) >= (9, 0)


if gluon is not None:

    @gluon.jit
    def wait_for_previous_grid():
        """Block until the grid before this one on the stream has completed and its memory is visible."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def release_next_grid():
        """Allow the dependent grid after this one to start (once every program has called this or exited)."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
