"""Logging of every liteinfer process (the CLI's, the engine core's, the API servers', the
grammar process's, the tensor-parallel workers'): one format and one level, the `--log-level`
flag's. Spawned processes read the level from LITEINFER_LOGGING_LEVEL, which the CLI sets."""
from __future__ import annotations

import logging
import os

LOGGING_LEVEL_ENV = "LITEINFER_LOGGING_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
# The process's name tells the core's lines from each API server's.
LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
# uvicorn's lines (the access log among them) in the same format.
LOGGERS = ("liteinfer", "uvicorn")


def logging_level() -> str:
    return os.environ.get(LOGGING_LEVEL_ENV, "info")


def configure_logging(level: str | None = None) -> logging.Handler:
    """A stderr handler on the `liteinfer` and `uvicorn` loggers at `level`, else at the
    environment's level (info when unset). A level given is put in the environment for the
    processes this one spawns. Returns the handler, for a caller that runs in-process (tests)
    to remove it."""
    if level is not None:
        os.environ[LOGGING_LEVEL_ENV] = level
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging_level().upper())
    return handler
