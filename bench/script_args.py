"""Command line of the bench scripts that take --cpu-smoke.

It has to act before torch, triton or any graphopt kernel module is imported: Triton reads
TRITON_INTERPRET when a kernel is decorated. So the scripts import this module as a sibling
(`python bench/<script>.py` puts bench/ first on sys.path) before anything else, and it puts the
repository root on sys.path for their `bench.*` and `graphopt` imports.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_arguments(doc: str) -> argparse.ArgumentParser:
    """A parser described by the script's first docstring line, with --cpu-smoke."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU through the Triton interpreter")
    return parser


def parse_bench_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse sys.argv; with --cpu-smoke, run Triton kernels in the interpreter."""
    opts = parser.parse_args()
    if opts.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    return opts
