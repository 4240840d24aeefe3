"""Discovery: the set of Tulip replicas the balancer picks from, and what is known of each one's health.

Each `--tulip` target is either a literal address (`IP:PORT`, `[IPv6]:PORT`, `unix:PATH`: one replica,
used as given) or a DNS name (`NAME:PORT`, `dns:///NAME:PORT`): resolved with the system resolver
(`socket.getaddrinfo` in a thread, so /etc/hosts counts as it does for any program) into one replica
per address, re-resolved every `resolve_interval` seconds and soon after a connection failure. An
address that leaves the name leaves the set at once (no new request goes to it) and its channel is
closed once what it has in flight is answered; a lookup that fails keeps the addresses it had.

Every replica is watched with the standard gRPC health service (grpc.health.v1): one `Watch` while it
is SERVING, so NOT_SERVING (a draining Tulip) takes it out of routing the moment the Tulip says so; a
replica out of routing is probed with `Check` every PROBE_SECONDS until it is SERVING again. While it
is not serving, its request stream and health watch are closed once idle, so a draining Tulip is not
held open by Ivy for its whole grace period. EJECT_AFTER failures in a row (requests answered
UNAVAILABLE, failed health calls) eject a replica: only tried when nothing else is left, until a
probe finds it SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from trellis.client import TulipClient

log = logging.getLogger("ivy.discovery")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.UNKNOWN  # not heard yet, or the health call failed
EJECT_AFTER = 3  # failures in a row that eject a replica
PROBE_SECONDS = 1.0  # a replica out of routing is asked for its health this often
CLOSE_WAIT_S = 120.0  # a removed replica's in-flight requests get this long before its channel is closed
MIN_RESOLVE_GAP_S = 0.5  # re-resolutions asked for by failures come no closer than this
_HEALTH = health_pb2.HealthCheckRequest(service="")


@dataclass(frozen=True)
class Target:
    """One `--tulip` value: `address` for a literal one, else the DNS `name` and `port` to resolve."""

    given: str
    address: str = ""
    name: str = ""
    port: int = 0


# gRPC target schemes used as given (one replica each, gRPC resolves them)
GRPC_LITERAL_SCHEMES = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def parse_target(t: str) -> Target:
    """A `--tulip` value -> Target; ValueError quoting it when it is none of the accepted forms."""
    for scheme in GRPC_LITERAL_SCHEMES:
        if t.startswith(scheme):
            if len(t) > len(scheme):
                return Target(t, address=t)
            raise ValueError(f"--tulip {t!r}: {scheme} needs an address after it")
    rest = t
    if t.startswith("dns:"):
        if not t.startswith("dns:///"):
            raise ValueError(f"--tulip {t!r}: only dns:///NAME:PORT is supported (no DNS authority)")
        rest = t[len("dns:///"):]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--tulip {t!r} is not HOST:PORT or unix:PATH (HOST: an IP address or a DNS name; "
                         "dns:///NAME:PORT also works)")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        if bare != host or not all(c.isalnum() or c in "-._" for c in host):
            raise ValueError(f"--tulip {t!r}: {host!r} is neither an IP address nor a DNS name") from None
        return Target(t, name=host, port=int(port))
    return Target(t, address=f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}")


def address_of(sockaddr: tuple, port: int) -> str:
    ip = sockaddr[0]
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Replica:
    """One Tulip address: its client (channel and stream), what its health service says, and the
    balancer's marks (outstanding tokens, down / busy until)."""

    def __init__(self, target: str, transport: str = "stream", spin_ms: float = 0.0, source: str = ""):
        self.client = TulipClient(target, transport=transport, spin_ms=spin_ms)
        self.target = target
        self.source = source or target  # the --tulip value it came from
        self.outstanding = 0  # tokens sent and not yet answered (the balancer's)
        self.down_until = 0.0
        self.busy_until = 0.0  # RESOURCE_EXHAUSTED lately: passed over while others have room
        self.health = UNKNOWN
        self.failures = 0  # in a row
        self.ejected = False
        self.removed = False
        self.kick = asyncio.Event()  # set to end a health watch early (ejected, removed)

    @property
    def routable(self) -> bool:
        """New requests may go here (NOT_SERVING ones get none; ejected ones only as a last resort)."""
        return self.health != NOT_SERVING and not self.removed

    def __repr__(self) -> str:
        return f"Replica({self.target}, {health_pb2.HealthCheckResponse.ServingStatus.Name(self.health)})"


class ReplicaSet:
    """The replicas behind the `--tulip` targets. `replicas` is replaced, never changed in place, so a
    pick that iterates it sees one consistent set. `start()` (on the serving event loop) begins
    resolving names and watching health; without it, the literal targets are the set, health unknown."""

    def __init__(self, targets: tuple[str, ...], transport: str = "stream", spin_ms: float = 0.0,
                 resolve_interval: float = 5.0):
        self.targets = [parse_target(t) for t in targets]
        self.transport, self.spin_ms = transport, spin_ms
        self.resolve_interval = resolve_interval
        self.replicas: list[Replica] = []
        self._resolved: dict[str, list[str]] = {}  # name target -> its addresses at the last good lookup
        self._tasks: dict[Replica, asyncio.Task] = {}  # health watch per replica
        self._closing: set[asyncio.Task] = set()
        self._leaving: set[Replica] = set()  # removed, closed once idle
        self._resolver: asyncio.Task | None = None
        self._nudge: asyncio.Event | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._started = False
        self.lookups = 0  # rounds of name lookups done
        self._apply()

    @property
    def names(self) -> list[Target]:
        return [t for t in self.targets if t.name]

    def _wanted(self) -> list[tuple[str, str]]:
        out, seen = [], set()
        for t in self.targets:
            for a in ([t.address] if t.address else self._resolved.get(t.given, [])):
                if a not in seen:
                    seen.add(a)
                    out.append((a, t.given))
        return out

    def _apply(self) -> None:
        """Make the set match the targets' current addresses: new ones added, gone ones removed."""
        wanted = self._wanted()
        keep = {a for a, _ in wanted}
        have = {r.target: r for r in self.replicas}
        kept = [r for r in self.replicas if r.target in keep]
        added = [Replica(a, self.transport, self.spin_ms, src) for a, src in wanted if a not in have]
        for r in self.replicas:
            if r.target not in keep:
                self._remove(r)
        self.replicas = kept + added
        if self._started:
            for r in added:
                self._watch(r)

    def _remove(self, r: Replica) -> None:
        log.info("tulip %s (%s) left the name: no new requests; closed once its %d in flight are answered",
                 r.target, r.source, r.client.outstanding)
        r.removed = True
        r.kick.set()
        task = self._tasks.pop(r, None)
        if task is not None:
            task.cancel()
        self._leaving.add(r)
        if self._started or r.client.outstanding:
            self._later(self._close_when_idle(r))

    def _later(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._closing.add(task)  # a reference until it is done (the loop keeps only a weak one)
        task.add_done_callback(self._closing.discard)

    async def _close_when_idle(self, r: Replica, stream_only: bool = False) -> None:
        deadline = time.monotonic() + CLOSE_WAIT_S
        while (r.client.outstanding or r.outstanding) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if stream_only:
            if r.health != SERVING and r.client.stream is not None:  # still out of routing: let a draining Tulip finish early
                await r.client.stream.close()
        else:
            self._leaving.discard(r)
            await r.client.close()

    def start(self) -> None:
        """Resolve names and watch every replica's health from now on (call on the serving event loop)."""
        self._started = True
        for r in self.replicas:
            self._watch(r)
        if self.names:
            self._nudge = asyncio.Event()
            self._pool = ThreadPoolExecutor(max_workers=min(4, len(self.names)), thread_name_prefix="ivy-resolve")
            self._resolver = asyncio.get_running_loop().create_task(self._resolve_loop())

    async def close(self) -> None:
        tasks = [t for t in (self._resolver, *self._tasks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in list(self._closing):
            t.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in (*self.replicas, *self._leaving)), return_exceptions=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --- names ------------------------------------------------------------------------------------

    def nudge(self) -> None:
        """Re-resolve soon (a connection failed: the name may have moved)."""
        if self._nudge is not None:
            self._nudge.set()

    async def resolve(self) -> None:
        """Look every name up once (in threads) and apply what came back."""
        loop = asyncio.get_running_loop()

        async def lookup(t: Target) -> None:
            try:
                infos = await loop.run_in_executor(self._pool, socket.getaddrinfo, t.name, t.port, 0,
                                                   socket.SOCK_STREAM)
            except (OSError, UnicodeError) as e:  # socket.gaierror: no such name (yet), no DNS, ...
                log.warning("tulip %s: lookup failed (%s); keeping its %d known addresses", t.given, e,
                            len(self._resolved.get(t.given, [])))
                return
            addrs = list(dict.fromkeys(address_of(sa, t.port) for *_, sa in infos))
            old = self._resolved.get(t.given)
            if old is None or set(old) != set(addrs):
                log.info("tulip %s resolves to %s", t.given, ", ".join(addrs) or "nothing")
            self._resolved[t.given] = addrs

        await asyncio.gather(*(lookup(t) for t in self.names))
        self.lookups += 1
        self._apply()

    async def _resolve_loop(self) -> None:
        while True:
            last = time.monotonic()
            try:
                await self.resolve()
            except Exception:  # never let one bad lookup end discovery
                log.exception("resolving the tulip targets failed")
            self._nudge.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._nudge.wait(), self.resolve_interval)
            await asyncio.sleep(max(0.0, last + min(MIN_RESOLVE_GAP_S, self.resolve_interval) - time.monotonic()))

    # --- health -----------------------------------------------------------------------------------

    def _watch(self, r: Replica) -> None:
        if r not in self._tasks:
            self._tasks[r] = asyncio.get_running_loop().create_task(self._health(r))

    def succeeded(self, r: Replica) -> None:
        """A request to `r` was answered."""
        r.failures = 0
        if r.ejected:
            r.ejected = False
            log.info("tulip %s answered again: back in routing", r.target)

    def failed(self, r: Replica, why: str) -> None:
        """A request or health call to `r` failed as if the replica were unreachable."""
        r.failures += 1
        if r.failures == 1:
            self.nudge()  # the name may have moved (once per run of failures: a dead address is probed, not re-resolved)
        if r.failures >= EJECT_AFTER and not r.ejected:
            r.ejected = True
            r.kick.set()  # stop trusting an open watch: probe until SERVING
            log.warning("tulip %s ejected after %d failures in a row (%s); probing every %.1f s", r.target,
                        r.failures, why, PROBE_SECONDS)

    def _set(self, r: Replica, status: int) -> None:
        if status == SERVING and r.ejected:
            r.ejected, r.failures = False, 0
            log.info("tulip %s is SERVING: back in routing", r.target)
        if status == r.health:
            return
        was, r.health = r.health, status
        if status == SERVING:
            r.failures = 0
            r.down_until = 0.0
            log.info("tulip %s is SERVING", r.target)
        elif status == NOT_SERVING:
            log.info("tulip %s is NOT_SERVING: no new requests", r.target)
        if status != SERVING and was == SERVING:
            self._later(self._close_when_idle(r, stream_only=True))

    async def _watch_once(self, r: Replica) -> None:
        """One health Watch: returns when the replica stops serving, or the watch fails or ends."""
        call = r.client.health.Watch(_HEALTH)
        try:
            async for reply in call:
                status = reply.status if reply.status in (SERVING, NOT_SERVING) else UNKNOWN
                self._set(r, status)
                if status != SERVING:
                    return
            self._set(r, UNKNOWN)
            self.failed(r, "the health watch ended")
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._set(r, UNKNOWN)
            r.down_until = time.monotonic() + PROBE_SECONDS
            self.failed(r, f"health watch: {e.code().name}")
        finally:
            call.cancel()

    async def _health(self, r: Replica) -> None:
        """Watch while serving; out of routing (or ejected), probe with Check until SERVING again."""
        try:
            while not r.removed:
                r.kick.clear()
                if not r.ejected:
                    watch = asyncio.ensure_future(self._watch_once(r))
                    kicked = asyncio.ensure_future(r.kick.wait())
                    try:
                        await asyncio.wait((watch, kicked), return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        watch.cancel()
                        kicked.cancel()
                    if watch.done() and not watch.cancelled() and watch.exception() is not None:
                        raise watch.exception()
                while not r.removed:
                    await asyncio.sleep(PROBE_SECONDS)
                    try:
                        reply = await r.client.health.Check(_HEALTH, timeout=PROBE_SECONDS)
                    except grpc.aio.AioRpcError as e:
                        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                            raise
                        self._set(r, UNKNOWN)
                        self.failed(r, f"health check: {e.code().name}")
                        continue
                    self._set(r, reply.status if reply.status in (SERVING, NOT_SERVING) else UNKNOWN)
                    if r.health == SERVING:
                        break
        except grpc.aio.AioRpcError:  # UNIMPLEMENTED: no health service; requests alone judge it
            log.warning("tulip %s has no health service: routing by request outcomes alone", r.target)
            r.health, r.ejected = SERVING, False
