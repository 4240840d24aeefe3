import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# Ports for the servers tests start: one range per pytest-xdist worker, below the kernel's ephemeral range
# (32768-60999 by default), so neither the other worker nor a client's outgoing connection (tests open
# thousands) takes a port between its pick and the server's bind. Subprocesses (benchmarks.common) inherit it.
# A worker sets its own range over what it inherited: the xdist controller imports this file too (as worker
# 0) before it starts the workers, so with setdefault every worker kept 20000-23000 and two workers' servers
# could take one port (an Ivy's port answered by another test's Tulip: 405s in tests/test_tei.py, 2026-12-06).
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
_RANGE = f"{20000 + 3000 * (_WORKER % 4)}-{23000 + 3000 * (_WORKER % 4)}"
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["TRELLIS_FREE_PORTS"] = _RANGE
else:
    os.environ.setdefault("TRELLIS_FREE_PORTS", _RANGE)

from benchmarks.common import free_port  # noqa: E402  (after TRELLIS_FREE_PORTS and sys.path)


SLOW = os.environ.get("TRELLIS_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` (the benchmark harness's own features, not the product: `make test` stays under CI's
    15 minutes) run only with TRELLIS_SLOW=1 (`make test-slow`)."""
    if SLOW:
        return
    skip = pytest.mark.skip(reason="opt-in: TRELLIS_SLOW=1 (make test-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status
    except Exception:
        return 0


class Child:
    """A real child process (any argv) with its output captured to a file."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.log = log
        e = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **(env or {}))
        self.p = subprocess.Popen(argv, cwd=ROOT, env=e, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, check, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.p.args[:6]} exited {self.p.returncode}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout}s:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0, check: bool = True) -> int:
        """Signal it and wait; past `timeout` it is killed, and (`check`) TimeoutExpired raised."""
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            if check:
                raise
            return self.p.returncode


class Proc(Child):
    """A `python -m ...` child, its log in `tmp`."""

    def __init__(self, args: list[str], tmp: Path, env: dict | None = None):
        super().__init__([sys.executable, *args], tmp / f"{args[1].replace('.', '_')}-{time.monotonic_ns()}.log", env)


class HostsFile:
    """A copy of /etc/hosts at `path` for a child to bind-mount over its own (`mount --bind PATH
    /etc/hosts` in a private mount namespace), whose names the test sets while the child runs."""

    def __init__(self, path: Path):
        self.path = path
        self.base = Path("/etc/hosts").read_text()
        path.touch()

    def name(self, name: str, *addrs: str) -> float:
        """`name` resolves to `addrs` from now on (the file is rewritten in place: the bind mount
        follows the inode); returns when, as time.monotonic()."""
        with self.path.open("r+") as f:
            f.truncate(0)
            f.write(self.base + "".join(f"{a} {name}\n" for a in addrs))
        return time.monotonic()


def tulip_requests(ip: str, metrics_port: int, timeout: float = 2.0) -> float:
    """Requests a Tulip has finished (any status), from its metrics; -1 when it cannot be asked."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{metrics_port}/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return -1
    return metric(text, "tulip_requests_total")


@pytest.fixture(scope="session")
def standin_dir():
    """The bge-m3 preset's directory (the XLM-R-like stand-in tokenizer of 250,002 pieces), written once into
    the preset cache that every test shares (building it costs ~25 s: once per cache, not once per module)."""
    from presets import materialize

    return materialize("bge-m3")


@pytest.fixture(scope="session")
def model_path() -> Path:
    from trellis.modelref import resolve_model_path

    return resolve_model_path("default")


@pytest.fixture(scope="session")
def st_model(model_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_path), device="cpu")


@pytest.fixture(scope="session")
def engine():
    from rose.engine import Engine, EngineConfig

    return Engine(EngineConfig(model="default", device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def tulip_server(tmp_path_factory):
    """One real Tulip process serving the default model on a free loopback port."""
    port, metrics_port = free_port(), free_port()
    proc = Proc(["-m", "tulip", "--model", "default", "--port", str(port), "--device", "cpu",
                 "--max-queued-tokens", "20000", "--metrics-port", str(metrics_port)], tmp_path_factory.mktemp("tulip"))
    proc.wait_for(lambda: "TULIP_READY" in proc.output())
    proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield f"127.0.0.1:{port}", proc
    proc.stop()


@contextlib.contextmanager
def local_stack(model, tmp: Path, *args: str, env: dict | None = None):
    """deploy.local (one Ivy and its Tulips as child processes) serving `model` on the CPU, `args` added
    to its command line; yields (base URL, the Proc) once it is ready, then stops it (SIGINT)."""
    port = free_port()
    proc = Proc(["-m", "deploy.local", "--model", str(model), "--port", str(port), "--device", "cpu", *args], tmp, env)
    try:
        proc.wait_for(lambda: "Trellis is ready" in proc.output(), timeout=180)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop(signal.SIGINT)


@pytest.fixture(scope="session")
def stack_default(tmp_path_factory):
    """deploy.local serving the default model with one replica; yields the base URL."""
    with local_stack("default", tmp_path_factory.mktemp("stack-default")) as (url, _):
        yield url


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` (as exposed, e.g. `ivy_requests_total`) in Prometheus text
    whose labels include `labels` (whatever order the exposition writes them in)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
