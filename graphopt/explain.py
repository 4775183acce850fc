"""graphopt.explain: compile and run a model once, and report every pass decision.

Under tensor parallelism (torchrun, torch.distributed.tensor) every rank compiles its own graph
over its own shards; its report says which rank it is, and `Report.all_ranks()` collects every
rank's report (a collective: all ranks call it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from graphopt.passes.base import Decision, count_applied


@dataclass
class Report:
    """Decisions of every pass over every graph of one model (graph breaks included)."""

    decisions: list[Decision] = field(default_factory=list)
    output: Any = None
    # The hardware the cost model priced, its coefficients and whether they were validated there
    # (graphopt.cost.coefficients.describe); `cost_model_validated` False for a never-measured target.
    cost_model: str = ""
    cost_model_validated: bool = True
    rank: int | None = None  # this process's torch.distributed rank, when several processes run
    world_size: int | None = None

    @property
    def counts(self) -> dict[str, int]:
        """Rewrites applied per pass. A pass appears once it decided on some match (0 when it declined
        them all); a pass that matched nothing is absent, so read it with counts.get(name, 0)."""
        return count_applied(self.decisions)

    @property
    def memory_saved_bytes(self) -> int:
        """Weight bytes the rewritten layers no longer hold (FP4 / Q4_0 / FFT-chain weights against
        the dense ones; a tied weight counted once)."""
        return sum(int(d.details.get("memory_saved_bytes", 0)) for d in self.applied())

    def applied(self, pass_name: str | None = None) -> list[Decision]:
        return [d for d in self.decisions if d.applied and (pass_name is None or d.pass_name == pass_name)]

    def declined(self, pass_name: str | None = None) -> list[Decision]:
        return [d for d in self.decisions if not d.applied and (pass_name is None or d.pass_name == pass_name)]

    def table(self):
        from rich.table import Table

        table = Table(title="graphopt decisions" + (f", rank {self.rank} of {self.world_size}" if self.rank is not None else ""))
        for column in ("pass", "location", "decision", "implementation", "before ms", "after ms", "reason"):
            table.add_column(column, overflow="fold")
        for d in self.decisions:
            table.add_row(
                d.pass_name, d.location or "-", "applied" if d.applied else "declined", d.implementation or "-",
                _ms(d.predicted_ms_before), _ms(d.predicted_ms_after), d.reason,
            )
        summary = ", ".join(f"{k}: {v}" for k, v in self.counts.items()) or "no pass matched anything"
        saved = self.memory_saved_bytes
        table.caption = f"rewrites applied: {summary}" + (f"; weight memory saved: {saved / 2**20:.2f} MiB" if saved else "")
        if self.cost_model:
            table.caption += f"\n{self.cost_model}"
        return table

    def all_ranks(self) -> list["Report"]:
        """Every rank's report, in rank order (their decisions; outputs stay on their ranks). A
        collective over the default process group: every rank must call it. [self] in a single process."""
        if self.rank is None:
            return [self]
        import torch.distributed as dist

        gathered: list = [None] * int(self.world_size)
        dist.all_gather_object(gathered, (self.rank, self.world_size, self.decisions))
        return [Report(decisions, None, self.cost_model, self.cost_model_validated, rank, world)
                for rank, world, decisions in gathered]

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=160, record=True, file=_NullFile())
        console.print(self.table())
        return console.export_text()


class _NullFile:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _refuse_model_keywords(model: torch.nn.Module, options: dict) -> None:
    """A keyword that is no graphopt option but an argument of model.forward (HF's input_ids=...):
    say that model inputs go positionally, rather than "unknown graphopt option"."""
    import dataclasses
    import inspect

    from graphopt.config import GraphOptConfig

    valid = {f.name for f in dataclasses.fields(GraphOptConfig)}
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    inputs = [key for key in options if key not in valid and key in parameters]
    if inputs:
        raise ValueError(f"{', '.join(inputs)}: an input of {type(model).__name__}.forward, passed as a keyword; "
                         f"model inputs go positionally (explain(model, *inputs, **options)), and keywords are "
                         f"graphopt options")


def explain(model: torch.nn.Module, *example_inputs: Any, **options: Any) -> Report:
    """Compile `model` with graphopt (options as for torch.compile), run it once under no_grad,
    and return every decision. Dynamo's cache is reset before and after, so the report covers
    exactly this model and these inputs."""
    from graphopt import compiler as backend_module
    from graphopt.config import GraphOptConfig
    from graphopt.cost import coefficients
    from graphopt.hardware import get_spec
    from graphopt.logging_setup import configure_logging
    from graphopt.passes.tensor_parallel import rank_and_world

    _refuse_model_keywords(model, options)
    config = GraphOptConfig.from_options(options)  # fail early and clearly on bad options
    configure_logging()  # and on a bad GRAPHOPT_LOG (inside the compile it would come wrapped by Dynamo)
    with backend_module.recording_decisions(reset=True) as sink:
        compiled = torch.compile(model, backend="graphopt", options=options or None)
        with torch.no_grad():
            output = compiled(*example_inputs)
    hw = get_spec(config.target, list(example_inputs))  # as the backend picks it
    rank, world_size = rank_and_world() or (None, None)
    return Report(sink, output, coefficients.describe(hw), coefficients.validated(hw), rank, world_size)
