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


def configure_logging(level: str | None = None) -> logging.Handler:
    """A stderr handler on the `liteinfer` logger at `level`, else at the environment's level
    (info when unset). A level given is put in the environment for the processes this one
    spawns. Returns the handler, for a caller that runs in-process (tests) to remove it."""
    if level is not None:
        os.environ[LOGGING_LEVEL_ENV] = level
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger = logging.getLogger("liteinfer")
    logger.addHandler(handler)
    logger.setLevel(os.environ.get(LOGGING_LEVEL_ENV, "info").upper())
    return handler
