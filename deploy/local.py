"""trellis serve --model BAAI/bge-m3 --replicas 1 --port 8000 [--add-model NAME=MODEL ...]
(the same program as python -m deploy.local)

Starts N Tulip replicas per model and one Ivy as child processes on loopback, waits until
Ivy reports ready, prints the base URL and what each model serves (a Hub id's commit; a preset's
random weights), and on SIGINT/SIGTERM stops them all (Ivy first, then the Tulips, each given time
to drain) and exits 0. `--model` is the default model; each `--add-model NAME=MODEL` adds one more,
served as NAME with N Tulips of its own (Ivy's --model-config file, written to a temporary directory).

A model is a Hugging Face Hub id (ORG/NAME, or ORG/NAME@REVISION: a branch, tag or commit), a model
directory, `default` (all-MiniLM-L6-v2) or `preset:NAME` (real shapes, random weights: benchmarks).
Each is resolved here, once, before any process starts: a Hub id is downloaded into the Hugging Face
cache (HF_HOME / HF_HUB_CACHE; HF_TOKEN for gated models; HF_HUB_OFFLINE=1: the cache only), with
progress, and its commit pinned for the children (trellis.modelref.pin), so the Tulips and Ivy read
the same files and none downloads again. A model that cannot be had exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 1.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except Exception:
        return 0


class Stack:
    """The child processes of one local deployment."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.url = f"http://{args.host}:{args.port}"
        self._gpus: int | None = None
        self._tmp: str | None = None
        self.refs: list = []  # each model's trellis.modelref.ModelRef (resolve()), --model first
        self.targets: dict[str, list[str]] = {}  # served name -> its Tulips

    def device(self, i: int) -> str:
        """Tulip i's device (counting every model's): with several Tulips on a GPU host, one GPU each
        (round robin)."""
        a = self.args
        if a.replicas * (1 + len(a.add_model)) == 1 or a.device not in ("auto", "cuda"):
            return a.device
        if self._gpus is None:
            import torch

            self._gpus = torch.cuda.device_count()
        return f"cuda:{i % self._gpus}" if self._gpus else a.device

    def _spawn(self, name: str, argv: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        p = subprocess.Popen([sys.executable, *argv], env=env, start_new_session=True)
        self.procs.append((name, p))

    def _tulips(self, model: str, name: str, first: int, revision: str = "") -> list[str]:
        """`--replicas` Tulips serving `model` (as `name`, if given); their targets."""
        a = self.args
        targets = []
        for i in range(first, first + a.replicas):
            port = free_port()
            targets.append(f"127.0.0.1:{port}")
            argv = ["-m", "tulip", "--model", model, "--port", str(port), "--device", self.device(i), "--dtype",
                    a.dtype]
            if revision:
                argv += ["--revision", revision]
            if name:
                argv += ["--served-model-name", name]
            self._spawn(f"tulip-{i}", argv)
        return targets

    def start(self) -> None:
        a = self.args
        targets = self._tulips(a.model, a.served_model_name, 0, a.revision)
        self.targets = {a.served_model_name or self.refs[0].name: targets}
        argv = ["-m", "ivy", "--model", a.model, "--host", a.host, "--port", str(a.port), "--workers",
                str(a.ivy_workers)]
        for t in targets:
            argv += ["--tulip", t]
        if a.revision:
            argv += ["--revision", a.revision]
        if a.served_model_name:
            argv += ["--served-model-name", a.served_model_name]
        if a.add_model:
            models = []
            for k, (name, model) in enumerate(a.add_model, 1):
                models.append({"name": name, "model": model, "tulip": self._tulips(model, name, k * a.replicas)})
                self.targets[name] = models[-1]["tulip"]
            self._tmp = tempfile.mkdtemp(prefix="trellis-local-")
            path = os.path.join(self._tmp, "models.json")
            with open(path, "w") as f:
                json.dump(models, f, indent=1)
            argv += ["--model-config", path]
        self._spawn("ivy", argv)

    def resolve(self) -> None:
        """Every model resolved (a Hub id fetched) here, once, and pinned for the children: the Tulips and Ivy
        then read the same commit from the cache and none of them downloads. ModelRefError: one line."""
        from trellis.modelref import pin, resolve

        a = self.args
        self.refs = [resolve(a.model, a.revision)] + [resolve(model) for _, model in a.add_model]
        for ref in self.refs:
            pin(ref)

    def banner(self) -> str:
        """What is served, after the ready line: each model's name, what it is (a Hub id's commit; a preset's
        RANDOM WEIGHTS) and its Tulips."""
        a = self.args
        names = [a.served_model_name or self.refs[0].name] + [name for name, _ in a.add_model]
        lines = []
        for name, ref in zip(names, self.refs):
            flag = "WARNING: " if ref.random_weights else ""
            lines.append(f"  {flag}model '{name}': {ref.describe()}; Tulips {', '.join(self.targets.get(name, []))}")
        return "\n".join(lines)

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs:
                if p.poll() is not None:
                    print(f"deploy.local: {name} exited with code {p.returncode}", file=sys.stderr)
                    return False
            if _get(self.url + "/ready") == 200:
                return True
            time.sleep(0.25)
        print(f"deploy.local: not ready after {timeout:.0f} s", file=sys.stderr)
        return False

    def stop(self, grace: float = 15.0) -> None:
        # Ivy first so no new work reaches the Tulips, then all Tulips drain together.
        ivy = [x for x in self.procs if x[0] == "ivy"]
        for group in (ivy, [x for x in self.procs if x[0] != "ivy"]):
            for _, p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for name, p in group:
                try:
                    p.wait(grace)
                except subprocess.TimeoutExpired:
                    print(f"deploy.local: {name} did not stop in {grace:.0f} s; killing it", file=sys.stderr)
                    p.kill()
                    p.wait()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def model_pair(s: str) -> tuple[str, str]:
    """--add-model NAME=MODEL -> (NAME, MODEL)."""
    name, sep, model = s.partition("=")
    if not sep or not name or not model:
        raise argparse.ArgumentTypeError(f"{s!r} is not NAME=MODEL (a served name, then a Hub id, a directory, "
                                         "'default' or preset:NAME)")
    return name, model


def main(argv: list[str] | None = None) -> int:
    from trellis.cli import prog

    name = prog("python -m deploy.local")
    ap = argparse.ArgumentParser(prog=name, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default",
                    help="a Hugging Face Hub id ORG/NAME[@REVISION] (downloaded once into the Hugging Face cache), a "
                    "model directory, 'default' (all-MiniLM-L6-v2) or preset:NAME (real shapes, random weights)")
    ap.add_argument("--revision", default="", help="with a Hub id: the branch, tag or commit to serve (as "
                    "ORG/NAME@REVISION; default: the default branch)")
    ap.add_argument("--replicas", type=int, default=1, help="Tulip processes (one per GPU on a GPU host)")
    ap.add_argument("--host", default="127.0.0.1", help="Ivy's listen address")
    ap.add_argument("--port", type=int, default=8000, help="Ivy's HTTP port")
    ap.add_argument("--ivy-workers", type=int, default=1, help="Ivy worker processes (tokenization and HTTP)")
    ap.add_argument("--device", default="auto", help="Tulip device: auto | cpu | cuda")
    ap.add_argument("--dtype", default="auto", help="Tulip dtype: auto | float32 | bfloat16 | float16")
    ap.add_argument("--served-model-name", default="", help="model name clients use")
    ap.add_argument("--add-model", action="append", type=model_pair, default=[], metavar="NAME=MODEL",
                    help="one more model served as NAME (a Hub id, a directory, 'default' or preset:NAME), with "
                    "--replicas Tulips of its own (repeat for several); --model stays the default")
    ap.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for readiness")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error(f"--replicas {args.replicas} must be >= 1")

    stack = Stack(args)
    from trellis.modelref import ModelRefError

    say = logging.StreamHandler(sys.stderr)  # a download's lines (trellis.hub), before its progress bars
    logging.getLogger("trellis").addHandler(say)
    logging.getLogger("trellis").setLevel(logging.INFO)
    try:
        stack.resolve()
    except ModelRefError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        logging.getLogger("trellis").removeHandler(say)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack.start()
    try:
        if not stack.wait_ready(args.ready_timeout):
            return 1
        print(f"Trellis is ready: {stack.url}  (OpenAI base URL {stack.url}/v1; Ctrl-C stops)\n{stack.banner()}",
              flush=True)
        while not stopping:
            for name, p in stack.procs:
                if p.poll() is not None:
                    print(f"deploy.local: {name} exited with code {p.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
