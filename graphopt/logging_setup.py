"""GRAPHOPT_LOG=info|debug: log every pass decision to stderr (through rich when available)."""

from __future__ import annotations

import logging
import os

_LEVELS = {"info": logging.INFO, "debug": logging.DEBUG, "warning": logging.WARNING}
_configured: str | None = None


def configure_logging() -> None:
    """Apply GRAPHOPT_LOG once per value; without it, graphopt logs warnings only."""
    global _configured
    value = os.environ.get("GRAPHOPT_LOG", "").strip().lower()
    if value == _configured:
        return
    if value and value not in _LEVELS:
        raise ValueError(f"GRAPHOPT_LOG={value!r} is not valid; valid choices: {', '.join(_LEVELS)}")
    logger = logging.getLogger("graphopt")
    ours = [h for h in logger.handlers if getattr(h, "_graphopt", False)]
    if not value and ours:  # switched off again: warnings through the application's own handlers
        for handler in ours:
            logger.removeHandler(handler)
        logger.propagate = True
    elif value and not ours:
        try:
            from rich.logging import RichHandler

            handler: logging.Handler = RichHandler(show_path=False, markup=False)
        except ImportError:  # rich is a dependency; stay usable without it
            handler = logging.StreamHandler()
        handler._graphopt = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(_LEVELS.get(value, logging.WARNING))
    _configured = value
