"""graphopt's logger follows library etiquette: a NullHandler at import, and its level, handlers and
propagation left to the application unless GRAPHOPT_LOG asks for graphopt's own output."""

import logging
import os
import subprocess
import sys

import pytest

from graphopt import logging_setup


@pytest.fixture
def graphopt_logger(monkeypatch):
    """The graphopt logger, restored afterwards with configure_logging's memory of it."""
    logger = logging.getLogger("graphopt")
    saved = logger.level, logger.propagate, list(logger.handlers)
    monkeypatch.delenv("GRAPHOPT_LOG", raising=False)
    logging_setup.configure_logging()
    yield logger
    monkeypatch.delenv("GRAPHOPT_LOG", raising=False)
    logging_setup.configure_logging()
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRAPHOPT_LOG"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_import_adds_a_null_handler_and_nothing_else():
    result = _run("import logging, graphopt\n"
                  "logger = logging.getLogger('graphopt')\n"
                  "print(logger.level, logger.propagate, [type(h).__name__ for h in logger.handlers])")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "0 True ['NullHandler']"


def test_an_applications_logging_config_sees_graphopts_records():
    """The application's DEBUG config reaches graphopt's info records (its decisions), through
    propagation, after the backend ran configure_logging."""
    result = _run("import logging, sys\n"
                  "logging.basicConfig(stream=sys.stdout, level=logging.DEBUG, format='%(name)s %(levelname)s %(message)s')\n"
                  "import torch, graphopt\n"
                  "torch.compile(torch.nn.Linear(2, 2), backend='graphopt', options={'downstream': 'eager'})(torch.randn(1, 2))\n"
                  "logging.getLogger('graphopt.passes').info('an info record')\n"
                  "logging.getLogger('graphopt').warning('a warning')\n")
    assert result.returncode == 0, result.stderr
    assert "graphopt.passes INFO an info record" in result.stdout
    assert "graphopt WARNING a warning" in result.stdout


def test_graphopt_log_adds_its_handler_and_unset_restores_the_applications_setup(graphopt_logger, monkeypatch):
    graphopt_logger.setLevel(logging.ERROR)
    handlers = list(graphopt_logger.handlers)
    monkeypatch.setenv("GRAPHOPT_LOG", "debug")
    logging_setup.configure_logging()
    assert graphopt_logger.level == logging.DEBUG and not graphopt_logger.propagate
    assert any(getattr(h, "_graphopt", False) for h in graphopt_logger.handlers)
    monkeypatch.setenv("GRAPHOPT_LOG", "")
    logging_setup.configure_logging()
    assert graphopt_logger.level == logging.ERROR and graphopt_logger.propagate
    assert graphopt_logger.handlers == handlers
