"""`trellis`, the one console command (pyproject.toml's [project.scripts]; `python -m trellis` too).

    trellis serve --model BAAI/bge-m3      Tulips and one Ivy on this host (deploy.local; `make serve`)
    trellis ivy --tulip HOST:PORT ...      the HTTP gateway alone (python -m ivy)
    trellis tulip --model ...              one gRPC inference server (python -m tulip)
    trellis bench run ...                  the benchmark harness (python -m benchmarks)
    trellis embed IN OUT --model ...       a bulk embedding job (python -m jobs)

A subcommand is its module's own `main(argv)`, so its flags, environment variables and `--help` are that
module's, and `python -m MODULE` stays the same program. The module is imported by name only when its
subcommand runs: `trellis ivy` needs only the gateway install (no torch), and the package trellis (the
contracts) still imports nothing of the services above it. A new subcommand is one row of COMMANDS and its
module.
"""

from __future__ import annotations

import difflib
import importlib
import sys
import textwrap

from trellis import cli

# subcommand -> (module with main(argv) -> int, the pyproject.toml extra it needs, one line for `trellis --help`)
COMMANDS = {
    "serve": ("deploy.local", "all", "start Tulips and one Ivy on this host and serve a model: a Hugging Face Hub "
                                     "id (ORG/NAME[@REVISION], downloaded once), a directory, 'default' or preset:NAME"),
    "ivy": ("ivy.__main__", "gateway", "the HTTP gateway (OpenAI, TEI and rerank routes) in front of running Tulips"),
    "tulip": ("tulip.__main__", "tulip", "one gRPC inference server: one model on one device"),
    "embed": ("jobs.run", "jobs", "a bulk job: a dataset's texts (Parquet, JSONL, CSV) to a Parquet dataset of "
                                  "vectors, in-process, on running Tulips or through an Ivy; resumable"),
    "bench": ("benchmarks.__main__", "all,bench", "the benchmark harness: run suites against a model, write the "
                                                  "summary"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(textwrap.fill(help_, 100, initial_indent=f"  {name:<{width}}  ",
                                    subsequent_indent=" " * (width + 4)) for name, (_, _, help_) in COMMANDS.items())
    return ("usage: trellis COMMAND [ARGS ...]   (trellis COMMAND --help: that command's flags)\n\n"
            "Trellis serves embedding and reranking models: Ivy (HTTP gateway) -> Tulip (gRPC inference\n"
            "server) -> ROSE (engine).\n\ncommands:\n" + rows + "\n\nexample:\n  trellis serve --model BAAI/bge-m3 "
            "--port 8000\n    downloads the model into the Hugging Face cache once, then serves OpenAI's API at "
            "http://127.0.0.1:8000/v1\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "help":  # `trellis help serve` is `trellis serve --help`
        return main([argv[1], "--help"] if len(argv) > 1 else ["--help"])
    sub, rest = argv[0], argv[1:]
    if sub not in COMMANDS:
        near = difflib.get_close_matches(sub, COMMANDS, n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        print(f"trellis: error: unknown command {sub!r}{hint}; the commands are {', '.join(COMMANDS)} "
              "(trellis --help)", file=sys.stderr)
        return 2
    module_name, extra, _ = COMMANDS[sub]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:  # e.g. `trellis tulip` in the gateway image (no torch, no rose)
        print(f"trellis: error: 'trellis {sub}' needs what this installation lacks (no module {e.name}): install it "
              f"with pip install 'trellis[{extra}]'", file=sys.stderr)
        return 2
    cli.set_prog(f"trellis {sub}")
    return module.main(rest)
