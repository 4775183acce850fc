"""The `graphopt` command (also `python -m graphopt`).

Subcommands:
  demo         compile a small LLaMA-style model, show the rewrites, time eager/Inductor/graphopt
  explain      the decision table for a built-in model or a module:function
  ablate       all passes / each alone / all but one: latency, error, memory, compile time
  export       the rewritten graph as ONNX
  calibrate    measure this GPU's copy bandwidth, bf16 matmul rate and launch overhead
  bench        run a benchmark of the source checkout (bench/bench_<family>.py), passing its arguments on
  tune         per-head sparse-attention thresholds under an L1 budget (graphopt.sparse_tuning)
  explore-fft  when does an FFT-chain layer beat a dense GEMM (graphopt.fft_explorer)
  fftchain     FFT-chain distillation (graphopt.fft_distill)

torch, transformers, rich and matplotlib load inside the commands, so that `graphopt --help` is quick.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import subprocess
import sys
import traceback
from pathlib import Path

# Commands implemented in their own modules: each defines add_arguments(parser) and run(args) -> int.
# Their modules import torch, so they load only when their command runs.
PLUGIN_COMMANDS: dict[str, tuple[str, str]] = {
    "tune": ("graphopt.sparse_tuning", "tune sparse-attention thresholds per head under an L1 budget; writes a plan"),
    "explore-fft": ("graphopt.fft_explorer", "measure where FFT-chain layers beat dense GEMMs, with predictions"),
    "fftchain": ("graphopt.fft_distill", "FFT-chain layer tools: `graphopt fftchain distill ...`"),
}


def _add_model_arguments(parser: argparse.ArgumentParser, *, default_model: str = "tiny-llama") -> None:
    from graphopt.models import BUILTIN_MODELS

    parser.add_argument("--model", default=default_model,
                        help=f"built-in model ({', '.join(BUILTIN_MODELS)}) or module:function returning "
                             f"(model, example_inputs), the module looked up in the working directory first")
    parser.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sequence (default: per model)")
    parser.add_argument("--batch", type=_positive_int, default=1)
    parser.add_argument("--device", type=_device, default=None, help="cuda or cpu (default: cuda when present)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def check_device(text: str, option: str = "") -> str:
    """A --device value, or ValueError naming the valid choices (shared with the plugin commands,
    which pass `option`, the flag the message then starts with)."""
    import torch

    prefix = f"{option} " if option else ""
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{prefix}{text!r}: no CUDA device is present; valid choices here: cpu")
    if not (text == "cpu" or text.startswith("cuda")):
        raise ValueError(f"{prefix}{text!r} is not a device; valid choices: cuda, cuda:N, cpu")
    return text


def require_cuda(what: str, hint: str = "") -> None:
    """ValueError unless a CUDA GPU is present: GPU-only work says so rather than failing inside CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{what} needs a CUDA GPU and none is present" + (f"; {hint}" if hint else ""))


def _device(text: str) -> str:
    try:
        return check_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_option_arguments(parser: argparse.ArgumentParser) -> None:
    from graphopt.config import TARGETS

    parser.add_argument("--passes", default=None, help="comma-separated passes to enable (others off)")
    parser.add_argument("--force", action="store_true", help="apply every match regardless of the cost model")
    parser.add_argument("--target", default="auto", help=f"hardware for the cost model ({', '.join(TARGETS)})")
    parser.add_argument("--downstream", default="inductor", help="inductor, eager or tensorrt")
    parser.add_argument("--plan", default=None, help="a tuned plan (JSON)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                        help="any other GraphOptConfig field, e.g. --option fp4_format='\"mxfp4\"'")


def _pass_names(text: str) -> list[str]:
    """The passes of a --passes list, or ValueError naming an unknown one and the valid choices."""
    from graphopt.config import PASS_NAMES

    names = [p.strip() for p in text.split(",") if p.strip()]
    for p in names:
        if p not in PASS_NAMES:
            raise ValueError(f"unknown pass {p!r} in --passes; valid choices: {', '.join(PASS_NAMES)}")
    return names


def _options(args: argparse.Namespace) -> dict:
    from graphopt.config import PASS_NAMES, GraphOptConfig

    options: dict = {"force": args.force, "target": args.target, "downstream": args.downstream}
    if args.plan:
        options["plan"] = args.plan
    if args.passes is not None:
        wanted = _pass_names(args.passes)
        options["passes"] = {p: p in wanted for p in PASS_NAMES}
    flags = {"force": "--force", "target": "--target", "downstream": "--downstream", "plan": "--plan",
             "passes": "--passes"}
    for item in args.option:
        key, _, value = item.partition("=")
        if key in flags:
            raise ValueError(f"--option {key}=... repeats {flags[key]}: give it once, with {flags[key]}")
        if key in options:
            raise ValueError(f"--option {key} is given twice")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    GraphOptConfig.from_options(options)  # validate before building any model
    return options


def cmd_demo(args: argparse.Namespace) -> int:
    from graphopt.ablation import run_demo

    run_demo(device=args.device, out_dir=args.out)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from rich.console import Console

    from graphopt.explain import explain
    from graphopt.logging_setup import configure_logging
    from graphopt.models import build

    options = _options(args)
    configure_logging()  # a bad GRAPHOPT_LOG is an error here, before the model is built
    model, inputs = build(args.model, seq_len=args.seq_len, batch=args.batch, device=args.device)
    report = explain(model, *inputs, **options)
    Console(width=180).print(report.table())
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    import os

    from graphopt.ablation import run_ablation
    from graphopt.config import GraphOptConfig
    from graphopt.logging_setup import configure_logging

    passes = _pass_names(args.passes)
    variables = [v for v in ("GRAPHOPT_ENABLE", "GRAPHOPT_DISABLE") if os.environ.get(v)]
    if variables:  # they override every variant's passes, so the table's labels would be wrong
        raise ValueError(f"{' and '.join(variables)} would override the pass sets ablate compares; unset "
                         f"{'them' if len(variables) > 1 else 'it'} (ablate --passes chooses the passes)")
    configure_logging()  # a bad GRAPHOPT_LOG is an error here, before any timing
    GraphOptConfig.from_options({"force": args.force, "downstream": args.downstream}, environ={})
    run_ablation(args.model, passes, seq_len=args.seq_len, batch=args.batch, device=args.device, force=args.force,
                 downstream=args.downstream, out_dir=args.out, rep_ms=args.rep_ms)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from graphopt.models import build
    from graphopt.onnx_export import export_onnx

    options = _options(args)
    for item in args.onnx_form:
        if "=" not in item:
            raise ValueError(f"--onnx-form {item!r}: expected OP=FORM, e.g. graphopt::fp4_linear=runnable")
    forms = dict(item.split("=", 1) for item in args.onnx_form)
    dims = {}
    for item in filter(None, (args.dynamic or "").split(",")):
        dim, _, name = item.partition("=")
        if not dim.strip().lstrip("-").isdigit() or not name.strip():
            raise ValueError(f"--dynamic {args.dynamic!r}: expected DIM=NAME[,DIM=NAME], e.g. 0=batch,1=seq")
        dims[int(dim)] = name.strip()
    model, inputs = build(args.model, seq_len=args.seq_len, batch=args.batch, device=args.device or "cpu")
    # the named dims of every tensor input that has them
    axes = {i: {d: n for d, n in dims.items() if -t.dim() <= d < t.dim()} for i, t in enumerate(inputs)
            if isinstance(t, torch.Tensor)} if dims else None
    unused = sorted(set(dims) - {d for named in (axes or {}).values() for d in named})
    if unused:
        ranks = ", ".join(f"input {i}: {t.dim()}-D" for i, t in enumerate(inputs) if isinstance(t, torch.Tensor))
        raise ValueError(f"--dynamic names dim {', '.join(map(str, unused))}, which no tensor input has ({ranks})")
    path = export_onnx(model, inputs, args.out, onnx_forms=forms or None, dynamic_axes=axes, **options)
    print(f"wrote {path}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from graphopt.calibrate import calibrate

    require_cuda("calibrate", "on CPU the cost model uses the generic 'cpu' spec (target='cpu')")
    result = calibrate(attention=not args.no_attention)
    print(json.dumps(result, indent=2))
    return 0


BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"  # in a source checkout (pip install -e .)


def bench_families() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))


def cmd_bench(args: argparse.Namespace) -> int:
    """Run bench/bench_<family>.py with the rest of the command line (its own --help lists them).
    The scripts compare against eager, Inductor, cuBLAS and SDPA on a GPU; they are not part of the
    installed package, so this needs the source checkout."""
    families = bench_families()
    if not families:
        raise ValueError(f"graphopt bench runs the benchmark scripts of a source checkout, and {BENCH_DIR} has none; "
                         f"install graphopt from its repository (pip install -e .)")
    if args.family not in families:
        raise ValueError(f"unknown benchmark {args.family!r}; valid choices: {', '.join(families)}")
    script = BENCH_DIR / f"bench_{args.family}.py"
    if not (args.family.endswith("_cpu") or {"-h", "--help", "--cpu-smoke"} & set(args.script_args)):
        smoke = "--cpu-smoke" in script.read_text()
        require_cuda(f"bench {args.family}", f"graphopt bench {args.family} --cpu-smoke runs it at tiny sizes on CPU"
                     if smoke else "")
    return subprocess.call([sys.executable, str(script), *args.script_args], cwd=BENCH_DIR.parent)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphopt", description="graphopt: graph-rewriting optimizer for transformer inference")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("demo", help="compile a small LLaMA-style model; show rewrites and speedups")
    p.add_argument("--device", type=_device, default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--out", default=str(Path("graphopt_out", "demo")), help="folder for the JSON and the plot "
                   "(default: %(default)s under the working directory)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("explain", help="decision table for a model")
    _add_model_arguments(p)
    _add_option_arguments(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("ablate", help="ablation runs over pass subsets: table, JSON and PNG")
    _add_model_arguments(p)
    p.add_argument("--passes", default="attention", help="comma-separated passes to ablate")
    p.add_argument("--force", action="store_true", help="apply every match regardless of the cost model")
    p.add_argument("--downstream", default="inductor")
    p.add_argument("--rep-ms", type=float, default=200, help="timing budget per variant")
    p.add_argument("--out", default=str(Path("graphopt_out", "ablation")), help="folder for the JSON and the plot "
                   "(default: %(default)s under the working directory)")
    p.set_defaults(func=cmd_ablate)

    p = sub.add_parser("export", help="export the rewritten graph to ONNX")
    _add_model_arguments(p)
    _add_option_arguments(p)
    p.add_argument("--out", default="model.onnx")
    p.add_argument("--onnx-form", action="append", default=[], metavar="OP=FORM",
                   help="alternative ONNX form of an op, e.g. graphopt::fp4_linear=runnable")
    p.add_argument("--dynamic", default=None, metavar="DIM=NAME[,DIM=NAME]",
                   help="dims of every input to keep symbolic in the ONNX model, e.g. 0=batch,1=seq "
                        "(the example's size there must be >= 2)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("calibrate", help="measure this GPU's ceilings for the cost model")
    p.add_argument("--no-attention", action="store_true", help="skip the per-shape attention table")
    p.set_defaults(func=cmd_calibrate)

    families = bench_families()
    p = sub.add_parser("bench", help="run a benchmark script of the source checkout (bench/bench_<family>.py)")
    p.add_argument("family", help=f"which benchmark ({', '.join(families) or 'none found: needs the source checkout'})")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="passed on to the script (see its --help)")
    p.set_defaults(func=cmd_bench)

    for name, (_, help_text) in PLUGIN_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # listed here; parse_args gives it its own parser
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with a plugin command's module loaded only when that command runs."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in PLUGIN_COMMANDS:
        return build_parser().parse_args(argv)
    name = argv[0]
    module_name, help_text = PLUGIN_COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return argparse.Namespace(command=name, func=lambda args, exc=exc: _unavailable(name, exc))
    parser = argparse.ArgumentParser(prog=f"graphopt {name}", description=help_text)
    module.add_arguments(parser)
    parser.set_defaults(command=name, func=module.run)
    return parser.parse_args(argv[1:])


def _unavailable(name: str, exc: Exception) -> int:
    print(f"graphopt {name} is unavailable: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The command line is an application: graphopt's warnings go to stderr unless logging is set up.
    logging.basicConfig(format="%(name)s: %(levelname)s: %(message)s")
    try:
        device = getattr(args, "device", None)
        if isinstance(device, str) and device.startswith("cuda"):
            require_cuda(f"--device {device}", "valid choices here: cpu")
        if args.command != "bench":  # bench runs its script in a subprocess
            importlib.import_module("graphopt.ops")  # registers the graphopt::* ops the commands run
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad options and inputs: a clear message, not a traceback
        print(f"graphopt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (AssertionError, RuntimeError) as exc:
        if not _cuda_missing(exc):  # a bug: keep its traceback
            raise
        print(f"graphopt {args.command}: error: this run needs a CUDA GPU and none is present (torch: {exc})",
              file=sys.stderr)
        return 2


def _cuda_missing(exc: BaseException) -> bool:
    """Whether `exc` is torch failing to start CUDA on a machine without it (a model or a plugin
    asked for a GPU in a way the checks above do not see)."""
    import torch

    frames = traceback.extract_tb(exc.__traceback__)
    return (not torch.cuda.is_available()
            and any(f.name == "_lazy_init" and Path(f.filename).parent.name == "cuda" for f in frames))


if __name__ == "__main__":
    sys.exit(main())
