"""Command-line flags generated from dataclasses: `EngineConfig`'s for every command and
`ServerArgs`' for `liteinfer serve` come from one place, so a field, its type and the comment
beside it are the flag, its parsing and its help."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import tokenize
import types
import typing
from collections.abc import Callable
from typing import Any

# What a field's metadata may say about its flag.
FLAG = "flag"                  # its name, when not the field's (`--x-y` for `x_y`)
CHOICES = "choices"            # the values it accepts
CLI_DEFAULT = "cli_default"    # a function giving the command line's default, not the field's
SHOWN_DEFAULT = "shown_default"  # the default as --help states it ("{}": the value)


def field_help(cls: type) -> dict[str, str]:
    """Each dataclass field's `metadata["help"]`, else the comments written beside it or on the
    lines just above it in the class's source."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments: dict[int, str] = {}
    alone: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            comments[row] = tok.string.lstrip("#").strip()
            if not lines[row - 1][:tok.start[1]].strip():
                alone.add(row)
    found: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, row = [], node.lineno - 1
            while row in alone:
                above.insert(0, comments[row])
                row -= 1
            beside = [] if node.end_lineno in alone else [comments.get(node.end_lineno, "")]
            found[node.target.id] = " ".join(c for c in above + beside if c)
    return {f.name: f.metadata.get("help") or found.get(f.name, "")
            for f in dataclasses.fields(cls)}


def _json_object(text: str) -> dict[str, Any] | None:
    value = json.loads(text)
    if value is not None and not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _value_parser(annotation: Any) -> tuple[Callable[[str], Any], bool]:
    """argparse's `type` for a field annotation, and whether the field is a bool."""
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is \
        typing.Union
    base = kinds[0] if optional and len(kinds) == 1 else annotation
    if base is bool:
        return bool, True
    if typing.get_origin(base) is dict:  # a JSON object, as vLLM's --speculative-config
        return _json_object, False
    if not optional:
        return base, False

    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null") else base(text)

    return parse, False


def flag_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get(FLAG) or "--" + f.name.replace("_", "-")


def _default(f: dataclasses.Field[Any]) -> Any:
    """The field's default on the command line."""
    make = f.metadata.get(CLI_DEFAULT)
    return make() if make is not None else f.default


def add_dataclass_args(group: argparse._ActionsContainer, cls: type) -> None:
    """Every field of dataclass `cls` as a flag (`max_num_seqs` as --max-num-seqs, booleans as
    --x / --no-x, optional values taking `none`, dicts as JSON objects), its help the field's
    comment and its default. Unset flags stay out of the namespace (`dataclass_kwargs`), so
    the dataclass keeps its own defaults."""
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    for f in dataclasses.fields(cls):
        parse, is_bool = _value_parser(hints[f.name])
        shown = f.metadata.get(SHOWN_DEFAULT, "{}").format(_default(f))
        help_text = f"{helps[f.name]} (default: {shown})".lstrip()
        if is_bool:
            group.add_argument(flag_name(f), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag_name(f), dest=f.name, type=parse, default=argparse.SUPPRESS,
                               choices=f.metadata.get(CHOICES), help=help_text,
                               metavar=None if CHOICES in f.metadata else f.name.upper())


def dataclass_kwargs(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """`cls`'s keyword arguments from the flags `add_dataclass_args` added: those given, and
    the command line's own defaults (CLI_DEFAULT) of those not."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if hasattr(args, f.name):
            kwargs[f.name] = getattr(args, f.name)
        elif CLI_DEFAULT in f.metadata:
            kwargs[f.name] = f.metadata[CLI_DEFAULT]()
    return kwargs
