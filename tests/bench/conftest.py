"""The bench/report CLI as the liteinfer CLI mounts it (tiny models come from ../conftest.py)."""
from __future__ import annotations

import argparse

import pytest

from liteinfer.bench.cli import add_bench_parser, add_report_parser


@pytest.fixture
def cli():
    """Runs `liteinfer bench|report ...` through the parsers the liteinfer CLI mounts."""
    parser = argparse.ArgumentParser(prog="liteinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_report_parser(sub)

    def run(*argv: str) -> None:
        args = parser.parse_args([str(a) for a in argv])
        args.func(args)

    return run
