import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from graphopt.cli import build_parser, main


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for command in ("explain", "demo", "ablate", "export", "calibrate", "bench", "tune", "explore-fft", "fftchain"):
        assert command in text


def test_bad_pass_name_is_a_clear_error(capsys):
    assert main(["explain", "--passes", "atention"]) == 2
    assert "unknown pass 'atention'" in capsys.readouterr().err


def test_calibrate_without_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["calibrate"]) == 2  # a message, not a traceback
    assert "calibrate needs a CUDA GPU and none is present" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["explain", "--seq-len", "-3"], "not a positive integer"),
    (["explain", "--batch", "0"], "not a positive integer"),
    (["explain", "--device", "tpu"], "valid choices: cuda, cuda:N, cpu"),
])
def test_bad_model_arguments_are_usage_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and fragment in capsys.readouterr().err


def test_export_onnx_form_needs_op_equals_form(tmp_path, capsys):
    assert main(["export", "--onnx-form", "nonsense", "--out", str(tmp_path / "m.onnx")]) == 2
    assert "expected OP=FORM" in capsys.readouterr().err


def test_export_with_dynamic_dims(tmp_path, capsys):
    import onnx

    out = tmp_path / "m.onnx"
    assert main(["export", "--model", "tiny-llama", "--seq-len", "16", "--batch", "2", "--device", "cpu",
                 "--dynamic", "0=batch,1=seq", "--out", str(out)]) == 0
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in onnx.load(str(out)).graph.input]
    assert all(d[:2] == ["batch", "seq"] for d in dims), dims
    assert main(["export", "--dynamic", "batch", "--out", str(out)]) == 2
    assert "expected DIM=NAME" in capsys.readouterr().err
    # a dim no input has used to be dropped silently, exporting a static model
    assert main(["export", "--model", "tiny-llama", "--seq-len", "16", "--device", "cpu", "--dynamic", "2=foo",
                 "--out", str(out)]) == 2
    assert "names dim 2, which no tensor input has (input 0: 2-D)" in capsys.readouterr().err


def test_bench_runs_the_checkouts_benchmark_scripts(capfd):
    """`graphopt bench FAMILY ARGS...` runs bench/bench_FAMILY.py with ARGS (DESIGN.md's cli.py)."""
    from graphopt.cli import bench_families

    assert {"attention", "sparse_attention", "fp4", "q4", "fft_chain", "cost_model"} <= set(bench_families())
    assert main(["bench", "fp4", "--help"]) == 0
    assert "usage: bench_fp4.py" in capfd.readouterr().out
    assert main(["bench", "fp5"]) == 2
    assert "unknown benchmark 'fp5'; valid choices: attention" in capfd.readouterr().err


def test_ablate_writes_table_json_and_plot(tmp_path, monkeypatch, capsys):
    """By default under ./graphopt_out/ablation of the working directory, and it says where."""
    monkeypatch.chdir(tmp_path)
    code = main(["ablate", "--model", "tiny-llama", "--seq-len", "16", "--passes", "attention",
                 "--downstream", "eager", "--rep-ms", "20"])
    assert code == 0
    out_dir = tmp_path / "graphopt_out" / "ablation"
    data = json.loads((out_dir / "ablation.json").read_text())
    names = [v["name"] for v in data["variants"]]
    assert names[:2] == ["eager", "inductor"] and any(n.startswith("graphopt") for n in names)
    # The model runs in float32 on CPU and bfloat16 on a GPU (8-bit mantissa: Inductor's own fusions
    # measured 5e-3 relative error on the H100).
    tolerance = 2e-2 if torch.cuda.is_available() else 1e-3
    for v in data["variants"]:
        assert v["median_ms"] > 0 and v["rel_err"] < tolerance and v["spread"] >= 0
    assert (out_dir / "ablation.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "ablation: tiny-llama" in out
    assert f"wrote {Path('graphopt_out', 'ablation', 'ablation.json')}" in out
    assert f"wrote {Path('graphopt_out', 'ablation', 'ablation.png')}" in out


def test_demo_writes_where_asked_and_says_so(tmp_path, capsys):
    from graphopt.ablation import run_demo

    out_dir = tmp_path / "here"
    run_demo(device="cpu", out_dir=out_dir, rep_ms=5)
    out = capsys.readouterr().out
    for name in ("ablation.json", "ablation.png"):
        assert (out_dir / name).is_file() and f"wrote {out_dir / name}" in out


def test_demo_and_ablate_write_outside_the_source_tree_by_default():
    parser = build_parser()
    assert Path(parser.parse_args(["demo"]).out) == Path("graphopt_out", "demo")
    assert Path(parser.parse_args(["ablate"]).out) == Path("graphopt_out", "ablation")


def test_variant_sets_deduplicate():
    from graphopt.ablation import variant_sets

    assert [s for _, s in variant_sets(["attention"])] == [["attention"], []]
    sets = variant_sets(["attention", "fp4_linear", "q4_linear"])
    assert len(sets) == 1 + 3 + 3
    with pytest.raises(ValueError, match="valid choices"):
        variant_sets(["flash"])


def test_parser_builds():
    assert build_parser().prog == "graphopt"


@pytest.mark.parametrize("argv, fragment", [
    (["explain", "--model", "nosuchmod:fn"], "no module named 'nosuchmod'"),
    (["explain", "--force", "--option", "force=false"], "repeats --force"),
    (["ablate", "--downstream", "foo"], "downstream='foo' is not valid"),
    (["ablate", "--passes", "atention"], "unknown pass 'atention'"),
    (["explore-fft", "--quick", "--block-sizes", "0"], "--block-sizes takes positive integers"),
    (["explore-fft", "--quick", "--device", "tpu"], "--device 'tpu' is not a device; valid choices: cuda, cuda:N, cpu"),
    (["fftchain", "distill", "--model", "tiny-llama", "--holdout", "1.5"], "--holdout must be a fraction"),
])
def test_bad_inputs_are_clear_errors_before_any_work(argv, fragment, capsys):
    """Exit 2 with a message naming the problem, not a traceback after minutes of timing."""
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_ablate_refuses_pass_variables_that_would_relabel_its_variants(monkeypatch, capsys):
    monkeypatch.setenv("GRAPHOPT_DISABLE", "attention")
    assert main(["ablate", "--model", "tiny-llama"]) == 2
    assert "GRAPHOPT_DISABLE would override" in capsys.readouterr().err


def test_demo_device_is_checked(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--device", "gpu"])
    assert "'gpu' is not a device" in capsys.readouterr().err


# Modules a bare `graphopt --help` must not load: each adds a second or more to every call.
HEAVY_MODULES = ("torch", "transformers", "triton", "rich", "matplotlib", "onnx", "onnxruntime", "onnxscript")


def test_help_loads_no_heavy_module():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "graphopt", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "explain" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert imported, result.stderr
    assert not {m.split(".")[0] for m in imported} & set(HEAVY_MODULES)


def test_subcommand_help_loads_no_heavy_module():
    code = textwrap.dedent("""
        import json
        import sys
        from graphopt.cli import main
        for command in ("demo", "explain", "ablate", "export", "calibrate", "bench"):
            try:
                main([command, "--help"])
            except SystemExit:
                pass
        print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert not loaded & set(HEAVY_MODULES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
@pytest.mark.parametrize("argv, command, hint", [
    (["calibrate"], "calibrate", ""),
    (["bench", "cost_model"], "bench", ""),
    (["bench", "fp4"], "bench", "--cpu-smoke"),
    (["explore-fft", "--quick", "--device", "cuda"], "explore-fft", ""),
])
def test_gpu_commands_say_so_without_a_gpu(argv, command, hint):
    """Exit 2 with one line naming the command and the missing GPU, not a CUDA traceback."""
    result = subprocess.run([sys.executable, "-m", "graphopt", *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [message] = result.stderr.strip().splitlines()
    assert message.startswith(f"graphopt {command}: error: ") and "needs a CUDA GPU" in message and hint in message


USER_MODELS = """
import torch

def make():
    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)

def make_list():
    return [torch.nn.Linear(4, 4), [torch.randn(2, 4)]]

def only_model():
    return torch.nn.Linear(4, 4)

def bare_tensor():
    return torch.nn.Linear(4, 4), torch.randn(2, 4)

def on_gpu():
    return torch.nn.Linear(4, 4).cuda(), (torch.randn(2, 4, device="cuda"),)

SIZE = 4
"""


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """A module:function file in the working directory, as a user writes one beside their code."""
    name = "graphopt_user_models"
    (tmp_path / f"{name}.py").write_text(USER_MODELS)
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("function", ["make", "make_list"])
def test_model_from_a_module_in_the_working_directory(user_models, function, capsys):
    path = list(sys.path)
    assert main(["explain", "--model", f"{user_models}:{function}", "--downstream", "eager"]) == 0
    assert "pass" in capsys.readouterr().out
    assert sys.path == path  # the working directory is on it only for the look-up


@pytest.mark.parametrize("spec, fragments", [
    ("{m}:only_model", ["{m}.only_model() returned a Linear", "expected (model, example_inputs)"]),
    ("{m}:bare_tensor", ["{m}.bare_tensor() returned a tuple (Linear, Tensor)", "a tuple of example inputs"]),
    ("{m}:nofn", ["module '{m}'", "has no function 'nofn'", "it defines: bare_tensor, make, make_list, on_gpu, only_model"]),
    ("{m}:SIZE", ["{m}.SIZE is an int, not a function"]),
    ("nosuchmod_xyz:make", ["no module named 'nosuchmod_xyz'", "the working directory"]),
])
def test_model_spec_errors_name_the_problem(user_models, spec, fragments, capsys):
    assert main(["export", "--model", spec.format(m=user_models), "--out", "m.onnx"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment.format(m=user_models) in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_a_model_that_asks_for_cuda_without_a_gpu_is_a_message(user_models, capsys):
    assert main(["explain", "--model", f"{user_models}:on_gpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphopt explain: error: this run needs a CUDA GPU and none is present (torch: ")
    assert len(err.strip().splitlines()) == 1
