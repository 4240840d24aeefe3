"""Readers for the deploy files (Dockerfiles, compose, Kubernetes), for tests/test_deploy_files.py:
the instructions of a Dockerfile and where its image paths come from in the repository, compose's
variable interpolation, and a `python -m tulip|ivy` command parsed by the real config with the
environment the file gives it."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILES = {"tulip": DEPLOY / "Dockerfile.tulip", "gateway": DEPLOY / "Dockerfile.gateway"}


# --- Dockerfiles -------------------------------------------------------------------------------

def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, rest) per instruction, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in path.read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        keyword, _, rest = cur.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        cur = ""
    return out


def values(path: Path, keyword: str) -> list[str]:
    return [rest for k, rest in instructions(path) if k == keyword]


def args(path: Path) -> dict[str, str]:
    """ARG NAME=default -> {NAME: default}."""
    return dict((a.split("=", 1) + [""])[:2] for a in values(path, "ARG"))


def env(path: Path) -> dict[str, str]:
    """ENV A=1 B=2 ... -> {A: 1, B: 2}."""
    return dict(kv.split("=", 1) for rest in values(path, "ENV") for kv in shlex.split(rest))


def copies(path: Path) -> list[tuple[str, str]]:
    """(repository source, absolute image path) per COPY source, WORKDIR applied."""
    workdir, out = PurePosixPath("/"), []
    for keyword, rest in instructions(path):
        if keyword == "WORKDIR":
            workdir = workdir / rest
        elif keyword == "COPY":
            *sources, dest = [w for w in shlex.split(rest) if not w.startswith("--")]
            into_dir = dest.endswith("/") or len(sources) > 1
            d = workdir / dest
            out += [(s, str(d / PurePosixPath(s).name if into_dir else d)) for s in sources]
    return out


def source_of(dockerfile: Path, image_path: str) -> Path | None:
    """The repository file or directory that `image_path` comes from in that image (None: not copied)."""
    for src, dest in copies(dockerfile):
        if image_path == dest:
            return ROOT / src
        if image_path.startswith(dest + "/"):
            return ROOT / src / image_path[len(dest) + 1:]
    return None


def exec_form(rest: str) -> list[str]:
    """CMD / HEALTHCHECK ... CMD in exec (JSON) form."""
    return json.loads(rest[rest.index("["):])


# --- compose -------------------------------------------------------------------------------------

VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(node, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default} over every string of a parsed file."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m):
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        v = env.get(name)
        if op == ":-":
            return v or default
        if op == "-":
            return default if v is None else v
        assert v is not None, f"${{{name}}} has no default and no value"
        return v

    out = VAR.sub(sub, node)
    assert "$" not in out.replace("$$", ""), f"uninterpolated: {node!r}"
    return out


def variables(text: str) -> set[str]:
    return {m.group(1) for m in VAR.finditer(text)}


def dotenv(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


# --- commands against the real configs -----------------------------------------------------------

@contextmanager
def environment(env: dict[str, str]):
    """os.environ with every IVY_* / TULIP_* variable of this process replaced by `env`."""
    saved = dict(os.environ)
    try:
        for k in [k for k in os.environ if k.startswith(("IVY_", "TULIP_"))]:
            del os.environ[k]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def config_fields(role: str) -> set[str]:
    from ivy.config import IvyConfig
    from tulip.config import TulipConfig

    return {f.name for f in dataclasses.fields(TulipConfig if role == "tulip" else IvyConfig)}


def pending_ivy_fields() -> set[str]:
    """Fields the deploy files already use whose Ivy side is being built elsewhere: DNS discovery's
    re-resolution interval (IVY_RESOLVE_INTERVAL, branch m-disc). Checked as soon as IvyConfig has it;
    skipped (not failed) until then, because an unknown IVY_* variable is ignored by Ivy."""
    return {"resolve_interval"} - config_fields("ivy")


def parse_command(cmd: list[str], env: dict[str, str] | None = None):
    """`python -m tulip|ivy ARGS` with the environment the file gives it, parsed by the real config
    (flags, then TULIP_* / IVY_* variables, then defaults, as the service does). Every TULIP_* /
    IVY_* variable must name a field (the parser ignores unknown ones). Returns (role, config)."""
    from ivy.config import IvyConfig
    from tulip.config import TulipConfig

    env = {k: "" if v is None else str(v) for k, v in (env or {}).items()}
    assert cmd[:2] == ["python", "-m"] and cmd[2] in ("tulip", "ivy"), cmd
    role, argv = cmd[2], [str(a) for a in cmd[3:]]
    prefix = role.upper() + "_"
    fields = config_fields(role)
    pending = pending_ivy_fields() if role == "ivy" else set()
    for name in env:
        if name.startswith(prefix):
            field = name.removeprefix(prefix).lower()
            if field in pending:
                env = {k: v for k, v in env.items() if k != name}
                continue
            assert field in fields, f"{name}: {role} has no such setting (fields: {sorted(fields)})"
        else:
            assert not name.startswith(("IVY_", "TULIP_")), f"{name} given to {role}"
    for a in argv:
        if a.startswith("--"):
            assert a[2:].split("=")[0].replace("-", "_") in fields, f"{a}: not a flag of python -m {role}"
    with environment(env):
        try:
            cfg = (TulipConfig if role == "tulip" else IvyConfig).from_args(argv)
        except SystemExit:
            pytest.fail(f"python -m {role} {' '.join(argv)} (env {env}) does not parse")
    return role, cfg
