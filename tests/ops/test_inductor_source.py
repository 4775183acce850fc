"""Every Triton kernel in graphopt.kernels loads as the module Inductor writes for it.

A triton_op's kernel reaches Inductor's generated code as source: the kernel, the @jit helpers it
calls and the global constants it reads, copied by torch's
user_defined_triton_kernel_transitive_closure_source_code, then put into the wrapper inside a
triple-quoted string literal that is not raw (async_compile.triton(name, '''...''')), whose escapes
Python reads once more. A global that does not survive this (a name it does not bring along, a
constant whose repr holds an escape such as a newline) makes the kernel's module fail to import, and
graphopt then compiles the graph without its rewrites. Gluon kernels are not emitted this way (they
run as opaque ops) and are left out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = r'''
import ast, importlib, importlib.util, os, pkgutil, tempfile
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code as closure
from triton.runtime.jit import JITFunction
import graphopt.kernels

found = {}
for info in pkgutil.walk_packages(graphopt.kernels.__path__, "graphopt.kernels."):
    for name, value in vars(importlib.import_module(info.name)).items():
        if isinstance(value, JITFunction) and name.endswith("_kernel") and not value.is_gluon():
            found.setdefault(value, info.name + "." + name)
root = tempfile.mkdtemp()
failed = []
quotes = "'" * 3
for i, (kernel, name) in enumerate(sorted(found.items(), key=lambda kv: kv[1])):
    path = os.path.join(root, f"emitted_{i}.py")
    text = "import triton\nimport triton.language as tl\n@triton.jit\n" + closure(kernel)
    try:
        with open(path, "w") as f:  # the source as the wrapper's string literal holds it
            f.write(ast.literal_eval(quotes + text + quotes))
        spec = importlib.util.spec_from_file_location(f"emitted_{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert isinstance(getattr(module, kernel.fn.__name__), JITFunction)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
names = set(found.values())
print(len(names), "kernels;", "int-dot fp4 found:", any(n.endswith("._fp4_gemv_int_kernel") for n in names))
print("FAILED" if failed else "all import", *failed, sep="\n")
'''


def test_every_triton_kernel_imports_as_inductor_emits_it():
    """In a process without Triton's interpreter (the tests' conftest turns kernels into interpreted
    functions, which Inductor never emits)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "int-dot fp4 found: True" in run.stdout and "all import" in run.stdout, run.stdout[-3000:]
    assert int(run.stdout.split()[0]) >= 15, run.stdout
