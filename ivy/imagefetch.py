"""Image inputs given as http(s) URLs: fetched only from the hosts `--allow-image-urls` names, never
from a private, loopback, link-local or otherwise non-public address, within a timeout and the
image byte limit.

The rule on addresses: a host NAME must resolve to public addresses only (every address it resolves
to is checked, and the connection goes to the checked address, not to a second lookup that a
rebinding DNS server could answer differently). An IP address written in the allow list (e.g.
`--allow-image-urls 10.0.0.7` or `127.0.0.1:8080`) is the operator's explicit choice of that one
address, so it is fetched from even where it is private or loopback; that is also how the tests
serve images from loopback, with no test-only switch in the product. An entry HOST:PORT allows that
port only, HOST any port.

Why a small HTTP/1.0 client of our own and not httpx / aiohttp: it connects to the address we checked
(neither takes a pinned address without a custom resolver or transport), follows no redirect (each
would need the same checks), and the gateway gains no dependency. HTTP/1.0 keeps the reply simple:
a server sends no chunked body to a 1.0 client and closes the connection at the end of the body.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from ivy.errors import APIError

MAX_HEADER_BYTES = 64 << 10


@dataclass(frozen=True)
class Allowed:
    """Hosts image URLs may name: host (lower case, an IP literal as written, IPv6 without brackets) -> the
    ports allowed (None: any)."""

    hosts: dict[str, frozenset[int] | None]

    @classmethod
    def parse(cls, entries: tuple[str, ...]) -> "Allowed":
        """`--allow-image-urls` entries (HOST, HOST:PORT, [V6]:PORT; commas split one into several), or a
        ValueError quoting a bad one."""
        hosts: dict[str, set[int] | None] = {}
        for entry in (e.strip() for item in entries for e in item.split(",")):
            if not entry:
                continue
            parts = urlsplit(f"http://{entry}")
            try:
                host, port = parts.hostname, parts.port
            except ValueError:
                host = None
            if not host or parts.path or parts.query or parts.username or "@" in entry:
                raise ValueError(f"--allow-image-urls: {entry!r} is not HOST or HOST:PORT")
            host = canonical(host)
            if port is None:
                hosts[host] = None  # any port
            elif hosts.get(host, ()) is not None:
                hosts.setdefault(host, set()).add(port)
        return cls({h: None if p is None else frozenset(p) for h, p in hosts.items()})

    def port_allowed(self, host: str, port: int) -> bool:
        if host not in self.hosts:
            return False
        ports = self.hosts[host]
        return ports is None or port in ports


def canonical(host: str) -> str:
    """A host as the allow list keys it: lower case, an IP address as ipaddress writes it (::1, not 0::1)."""
    lit = _literal(host)
    return str(lit) if lit is not None else host.lower()


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def public(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A globally routable unicast address: not private, loopback, link-local, shared (CGNAT), multicast,
    reserved or unspecified; an IPv4-mapped IPv6 address is judged by its IPv4 address."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_global and not addr.is_multicast


async def fetch(url: str, label: str, allowed: Allowed, max_bytes: int, timeout: float) -> bytes:
    """The body of a GET of `url` (200 only), or an APIError naming `label`: 400 where the URL is not
    allowed, cannot be fetched or times out, 413 over `max_bytes`."""
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or parts.scheme not in ("http", "https") or parts.username is not None:
        raise APIError(400, f"{label}: {url[:200]!r} is not an http(s) URL this server fetches", "input")
    https = parts.scheme == "https"
    port = port or (443 if https else 80)
    host = canonical(host)
    if not allowed.port_allowed(host, port):
        raise APIError(400, f"{label}: image URLs are fetched only from the hosts --allow-image-urls names "
                       f"({', '.join(sorted(allowed.hosts)) or 'none'}), not {host}:{port}", "input",
                       "image_url_refused")
    try:
        async with asyncio.timeout(timeout):
            return await _get(parts, host, port, https, label, max_bytes)
    except TimeoutError:
        raise APIError(400, f"{label}: fetching the image URL took more than {timeout:g} s", "input",
                       "image_url_failed") from None
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
        raise APIError(400, f"{label}: could not fetch the image URL: {e or type(e).__name__}", "input",
                       "image_url_failed") from None


async def _get(parts, host: str, port: int, https: bool, label: str, max_bytes: int) -> bytes:
    literal = _literal(host)
    if literal is not None:  # an address the allow list names itself: the operator's choice (module docstring)
        addrs = [str(literal)]
    else:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addrs = list(dict.fromkeys(info[4][0] for info in infos))
        bad = [a for a in addrs if not public(ipaddress.ip_address(a.split("%", 1)[0]))]
        if bad or not addrs:
            raise APIError(400, f"{label}: {host} resolves to {', '.join(bad) or 'no address'}: image URLs are "
                           "never fetched from private, loopback or link-local addresses", "input",
                           "image_url_refused")
    ctx = ssl.create_default_context() if https else None
    reader, writer = await asyncio.open_connection(addrs[0], port, ssl=ctx, server_hostname=host if https else None,
                                                   limit=MAX_HEADER_BYTES)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        authority = f"[{host}]" if ":" in host else host
        if port != (443 if https else 80):
            authority += f":{port}"
        writer.write(f"GET {target} HTTP/1.0\r\nHost: {authority}\r\nUser-Agent: trellis-ivy\r\n"
                     "Accept: image/*\r\nConnection: close\r\n\r\n".encode("latin-1"))
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = head[0].split(" ", 2)
        code = int(status[1]) if len(status) > 1 and status[1].isdigit() else 0
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
        if code != 200:
            raise APIError(400, f"{label}: the image URL answered {head[0][:100]!r} (redirects are not followed)",
                           "input", "image_url_failed")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise APIError(400, f"{label}: the image URL sent a chunked body to an HTTP/1.0 request", "input",
                           "image_url_failed")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > max_bytes:
            raise APIError(413, f"{label}: the image has {length} bytes, more than this server's limit of "
                           f"{max_bytes} (--max-image-mb)", "input", "image_too_large")
        body = await reader.read(max_bytes + 1)
        while body and len(body) <= max_bytes and (more := await reader.read(max_bytes + 1 - len(body))):
            body += more
        if len(body) > max_bytes:
            raise APIError(413, f"{label}: the image has more than {max_bytes} bytes, this server's limit "
                           "(--max-image-mb)", "input", "image_too_large")
        return body
    finally:
        writer.close()
