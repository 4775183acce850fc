"""GRAPHOPT_LOG=info|debug: log every pass decision to stderr (through rich when available).

Without it graphopt leaves its logger to the application, as a library should: the package adds a
NullHandler at import, and records propagate to whatever handlers and levels the application set.
"""

from __future__ import annotations

import logging
import os

_LEVELS = {"info": logging.INFO, "debug": logging.DEBUG, "warning": logging.WARNING}
_configured: str | None = None
_saved: tuple[int, bool] | None = None  # the application's (level, propagate), while GRAPHOPT_LOG overrides them


def configure_logging() -> None:
    """Apply GRAPHOPT_LOG once per value. Unset or empty, the logger is the application's: an earlier
    value's handler, level and propagation are undone, and nothing else is touched."""
    global _configured, _saved
    value = os.environ.get("GRAPHOPT_LOG", "").strip().lower()
    if value == _configured:
        return
    if value and value not in _LEVELS:
        raise ValueError(f"GRAPHOPT_LOG={value!r} is not valid; valid choices: {', '.join(_LEVELS)}")
    logger = logging.getLogger("graphopt")
    ours = [h for h in logger.handlers if getattr(h, "_graphopt", False)]
    if not value:
        for handler in ours:
            logger.removeHandler(handler)
        if _saved is not None:
            logger.setLevel(_saved[0])
            logger.propagate = _saved[1]
            _saved = None
    else:
        if not ours:
            try:
                from rich.logging import RichHandler

                handler: logging.Handler = RichHandler(show_path=False, markup=False)
            except ImportError:  # rich is a dependency; stay usable without it
                handler = logging.StreamHandler()
            handler._graphopt = True  # type: ignore[attr-defined]
            logger.addHandler(handler)
        if _saved is None:
            _saved = (logger.level, logger.propagate)
        logger.setLevel(_LEVELS[value])
        logger.propagate = False  # our handler prints them; the application's would print them twice
    _configured = value
