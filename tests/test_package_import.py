"""`import graphopt` stays light until its API is used (the CLI's --help), and the API works in
either import order of graphopt and torch."""

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_graphopt_imported_before_torch():
    result = _run("""
        import sys
        import graphopt
        assert "torch" not in sys.modules
        import torch
        from graphopt.explain import Report  # loads the module of the same name first
        assert callable(graphopt.explain) and graphopt.Report is Report
        assert "explain" in dir(graphopt)
        report = graphopt.explain(torch.nn.Linear(4, 4), torch.randn(2, 4), downstream="eager")
        assert isinstance(report, Report)
        assert hasattr(torch.ops.graphopt, "attention")
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_graphopt_imported_after_torch_registers_the_ops():
    result = _run("""
        import torch
        import graphopt
        assert hasattr(torch.ops.graphopt, "attention")
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_backend_entry_point_registers_the_ops_itself():
    """torch.compile(backend="graphopt") with graphopt imported before torch, and no API touched."""
    result = _run("""
        import graphopt
        import torch
        fn = torch.compile(torch.nn.Linear(4, 4), backend="graphopt", options={"downstream": "eager"})
        fn(torch.randn(2, 4))
        assert hasattr(torch.ops.graphopt, "attention")
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_tuning_key_names_the_installed_graphopt_version():
    """The kernels' tuning-cache key reads graphopt's version from the package metadata (the kernels
    import nothing of graphopt above them): the version graphopt.__version__ states."""
    import graphopt
    from graphopt.kernels import tuning

    assert tuning.graphopt_version() in (graphopt.__version__, "unknown")


@pytest.mark.slow
def test_each_pass_module_imports_on_its_own():
    """A pass module imported first (as a tool or a test may do) registers the ops it names."""
    result = _run("""
        import importlib, subprocess, sys
        for name in ("attention", "sparse_attention", "fp4_linear", "q4_linear", "fft_linear", "all_reduce"):
            code = f"import graphopt.passes.{name}"
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            assert done.returncode == 0, (name, done.stderr[-500:])
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
