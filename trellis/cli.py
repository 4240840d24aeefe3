"""One place where CLI flags and environment variables map onto frozen config dataclasses.

Each field of a service's config dataclass becomes `--field-name` (underscores
to dashes) and environment variable `PREFIX_FIELD_NAME`; the field's
`metadata["help"]` is its documentation. Precedence: flag > environment >
dataclass default. Tuple fields take the flag several times (or a
comma-separated environment value). Validation lives in the dataclass's
`__post_init__`, so a bad value fails the same way from any source.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, TypeVar

T = TypeVar("T")
_PROG: str | None = None  # "trellis SUB" while the `trellis` command runs a subcommand (trellis.command)


def set_prog(name: str | None) -> None:
    """Name the running program in usage lines and errors (the `trellis` command: "trellis serve")."""
    global _PROG
    _PROG = name


def prog(default: str | None = None) -> str | None:
    """The program name for an ArgumentParser: set_prog's, else `default` (None: argparse's, from sys.argv[0])."""
    return _PROG or default


def field(default: Any, help: str, **kw: Any) -> Any:
    """A documented dataclass field."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for sequence defaults (configs are frozen)")
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def parse_bool(s: str) -> bool:
    """A boolean flag or environment value, as every config reads one (benchmarks.summary reads
    TULIP_COMPILE with it too)."""
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {s!r}")


def _scalar(tp: Any) -> Any:
    return {int: int, float: float, bool: parse_bool}.get(tp, str)


def parse(cls: type[T], argv: list[str] | None, env_prefix: str, description: str = "") -> T:
    """Build `cls` from argv and the environment; exit with a usage error on a bad value."""
    hints = typing.get_type_hints(cls)
    ap = argparse.ArgumentParser(prog=prog(), description=description or cls.__doc__)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        is_tuple = typing.get_origin(tp) is tuple
        inner = typing.get_args(tp)[0] if is_tuple else tp
        env = f"{env_prefix}_{f.name.upper()}"
        help_ = f"{f.metadata.get('help', '')} [env {env}; default {f.default!r}]"
        kw: dict[str, Any] = {"help": help_, "dest": f.name, "default": None}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if is_tuple:
            ap.add_argument(f"--{f.name.replace('_', '-')}", action="append", type=_scalar(inner), **kw)
        elif inner is bool:  # `--flag` alone means true; `--flag false` also works
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=parse_bool, nargs="?", const=True, **kw)
        else:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=_scalar(inner), **kw)
    ns = ap.parse_args(argv)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        is_tuple = typing.get_origin(tp) is tuple
        inner = typing.get_args(tp)[0] if is_tuple else tp
        v = getattr(ns, f.name)
        env = os.environ.get(f"{env_prefix}_{f.name.upper()}")
        try:
            if v is None and env is not None:
                v = [_scalar(inner)(x) for x in env.split(",") if x] if is_tuple else _scalar(inner)(env)
        except ValueError as e:
            ap.error(f"{env_prefix}_{f.name.upper()}={env!r}: {e}")
        if v is not None:
            values[f.name] = tuple(v) if is_tuple else v
    try:
        return cls(**values)
    except ValueError as e:
        ap.error(str(e))
        raise  # unreachable: ap.error exits
