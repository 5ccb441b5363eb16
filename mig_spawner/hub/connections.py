"""Kept-alive HTTP/1.1 connections to single-user servers, for the slice service's sweep.

A sweep talks to every server once: one request (mig-spawner's ``probe``), a second
on the same connection where it culls kernels. Each server has an address of its
own, so nearly every visit opens a connection, and at thousands of servers a sweep's
cost is that of opening connections and making small requests. A general client
(aiohttp, which the service keeps for the hub's API) spends a session and a connector
on each address and about twice the CPU per request; this module does only what
those requests need: a plain HTTP/1.1 exchange at a time per connection (JSON bodies,
``Content-Length`` or chunked answers, ``Connection: close``), over TCP or TLS, and
keeps the idle connections of the addresses used last (:class:`ConnectionPool`).
:class:`Slots` bounds the requests in flight and lets a visit's next request go
before the first request of visits not yet begun, so that it finds its connection open.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import OrderedDict, deque

#: The most a response head or body may hold (a kernels list is a few kB).
MAX_HEAD = 64 * 1024
MAX_BODY = 64 * 1024 * 1024

Address = tuple[str, str, int | None]


class ProtocolError(OSError):
    """The server's answer is not HTTP/1.1 as this client reads it."""


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one exchange at a time, reusable while the server keeps
    it open (its answers do not say ``Connection: close``)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        #: Whether any byte of an answer to the current request has come (a connection
        #: kept idle that the server closed answers nothing: the request may be resent).
        self.answered = False
        self._waiter: asyncio.Future[tuple[int, str, bytes, bool]] | None = None
        self._buffer = bytearray()
        self._head: tuple[int, str, int | None, bool, bool] | None = None

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.answered = True
        self._buffer += data
        try:
            self._parse(eof=False)
        except ProtocolError as e:
            self._fail(e)

    def eof_received(self) -> bool:
        try:
            self._parse(eof=True)
        except ProtocolError as e:
            self._fail(e)
        self._fail(ConnectionResetError("the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionResetError("the server closed the connection"))

    # -- use --------------------------------------------------------------------------

    async def exchange(self, request: bytes) -> tuple[int, str, bytes, bool]:
        """Send ``request`` (head and body) and return the answer: status, reason, body
        and whether the connection may carry another request."""
        assert self.transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        self._buffer.clear()
        self._head = None
        self.answered = False
        self.transport.write(request)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        """Close the connection (the server sees it at once)."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- parsing ------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def _parse(self, eof: bool) -> None:
        if self._waiter is None or self._waiter.done():
            return
        if self._head is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD:
                    raise ProtocolError("the answer's head is too long")
                return
            self._head = _parse_head(bytes(self._buffer[:end]))
            del self._buffer[:end + 4]
        code, reason, length, chunked, keep = self._head
        if 100 <= code < 200:  # an interim answer (none is asked for): the real one follows
            self._head = None
            self._parse(eof)
            return
        if chunked:
            body = _dechunk(self._buffer)
            if body is None:
                return
        elif length is not None:
            if len(self._buffer) < length:
                return
            body = bytes(self._buffer[:length])
        else:  # the body ends with the connection
            if not eof:
                if len(self._buffer) > MAX_BODY:
                    raise ProtocolError("the answer is too long")
                return
            body, keep = bytes(self._buffer), False
        self._waiter.set_result((code, reason, body, keep))


def _parse_head(head: bytes) -> tuple[int, str, int | None, bool, bool]:
    """(status, reason, Content-Length, chunked, keep-alive) of an answer's head."""
    status, _, fields = head.partition(b"\r\n")
    parts = status.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"not an HTTP/1.1 answer: {status[:80]!r}")
    code = int(parts[1])
    reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
    length: int | None = None
    chunked = False
    connection = b""
    # Only three fields matter; most answers carry a handful of others.
    lowered = b"\r\n" + fields.lower()
    for name in (b"\r\ncontent-length:", b"\r\ntransfer-encoding:", b"\r\nconnection:"):
        at = lowered.find(name)
        if at < 0:
            continue
        end = lowered.find(b"\r\n", at + 2)
        value = lowered[at + len(name):end if end >= 0 else None].strip()
        if name == b"\r\ncontent-length:":
            if not value.isdigit():
                raise ProtocolError("a Content-Length that is not a number")
            length = int(value)
            if length > MAX_BODY:
                raise ProtocolError("the answer is too long")
        elif name == b"\r\ntransfer-encoding:":
            chunked = value.endswith(b"chunked")
        else:
            connection = value
    keep = connection != b"close" if parts[0] == b"HTTP/1.1" else connection == b"keep-alive"
    if code in (204, 304):
        length, chunked = 0, False
    return code, reason, length, chunked, keep


def _dechunk(buffer: bytearray) -> bytes | None:
    """The body of a complete chunked answer in ``buffer``; ``None`` until it is all
    there. Trailers are ignored."""
    body = bytearray()
    at = 0
    while True:
        end = buffer.find(b"\r\n", at)
        if end < 0:
            return None
        size_text = bytes(buffer[at:end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise ProtocolError("a malformed chunk size") from None
        if size == 0:
            trailers = buffer.find(b"\r\n\r\n", end)
            if buffer[end:end + 4] == b"\r\n\r\n" or trailers >= 0:
                return bytes(body)
            return None
        start = end + 2
        if len(buffer) < start + size + 2:
            return None
        body += buffer[start:start + size]
        if len(body) > MAX_BODY:
            raise ProtocolError("the answer is too long")
        at = start + size + 2


class ConnectionPool:
    """Idle connections by address, for the ``keep`` addresses used last: a sweep over
    thousands of servers holds a bounded number of sockets."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._idle: OrderedDict[Address, list[Connection]] = OrderedDict()
        self._tls: ssl.SSLContext | None = None

    def holds(self, address: Address) -> bool:
        """Whether an idle connection to ``address`` is kept."""
        return address in self._idle

    def take(self, address: Address) -> Connection | None:
        """An idle connection to ``address``, now in use; ``None`` if none is kept."""
        idle = self._idle.get(address)
        while idle:
            connection = idle.pop()
            if not idle:
                del self._idle[address]
            if not connection.closed:
                return connection
        return None

    async def open(self, address: Address) -> Connection:
        """A new connection to ``address`` (TLS for ``https``)."""
        scheme, host, port = address
        tls = scheme == "https"
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        _, connection = await asyncio.get_running_loop().create_connection(
            Connection, host, port or (443 if tls else 80), ssl=self._tls if tls else None)
        return connection

    def put(self, address: Address, connection: Connection) -> None:
        """Keep ``connection`` for the next request to ``address``; close those of the
        addresses used least recently beyond ``keep``."""
        self._idle.setdefault(address, []).append(connection)
        self._idle.move_to_end(address)
        while len(self._idle) > self.keep:
            _, connections = self._idle.popitem(last=False)
            for old in connections:
                old.close()

    def close(self) -> None:
        """Close every idle connection."""
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()


class Slots:
    """At most ``size`` holders at once; a waiter that asks ``first`` gets a free slot
    before every other kind of waiter (each kind in the order they came)."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiting: tuple[deque[asyncio.Future[None]], deque[asyncio.Future[None]]] = (
            deque(), deque())

    async def acquire(self, first: bool = False) -> None:
        """Wait for a slot."""
        if self._free > 0 and not (self._waiting[0] or self._waiting[1]):
            self._free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[0 if first else 1].append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot as it was cancelled: pass it on
            raise

    def release(self) -> None:
        """Give a slot back: to the next waiter, ``first`` ones before the others."""
        for waiting in self._waiting:
            while waiting:
                waiter = waiting.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    return
        self._free += 1
