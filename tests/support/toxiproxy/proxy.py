"""A single named proxy: listener, accept thread, toxic chains and live connections.

Threading contract
------------------
* API methods (``start``, ``stop``, ``update``, toxic methods, ``to_json``) may be
  called from any thread.  ``_state_lock`` serialises start/stop/update;
  ``_lock`` guards the toxic chains and the connection set and is held only
  briefly (never while joining threads).
* One named daemon accept thread per enabled proxy.  It waits in ``select`` on
  the listener and a wake-up socketpair, so ``stop`` returns promptly.
* A connection is registered and its links are started under ``_lock`` with a
  snapshot of the chains, so every toxic change reaches every live link exactly
  once (the toxic change itself is applied to each link before the API call
  returns).
"""

from __future__ import annotations

import itertools
import select
import socket
import threading
from typing import Any

from .link import Connection
from .specs import (
    DIRECTIONS,
    ERR_TOXIC_NOT_FOUND,
    ApiError,
    ToxicSpec,
    parse_new_toxic,
    parse_toxic_update,
)

__all__ = ["Proxy", "split_address"]

UPSTREAM_CONNECT_TIMEOUT = 5.0
JOIN_TIMEOUT = 5.0
_conn_ids = itertools.count(1)


def split_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """Parse ``host:port`` (``[v6]:port`` allowed; empty host -> ``default_host``)."""
    host, sep, port = address.rpartition(":")
    if not sep:
        raise ApiError(f"listen tcp {address}: missing port in address", 500)
    host = host.strip("[]") or default_host
    try:
        return host, int(port)
    except ValueError:
        raise ApiError(f"listen tcp {address}: invalid port", 500) from None


class Proxy:
    """A Toxiproxy proxy (see module docstring for the threading contract)."""

    def __init__(self, name: str, listen: str, upstream: str) -> None:
        self.name = name
        self.listen = listen or "127.0.0.1:0"
        self.upstream = upstream
        self.enabled = False
        self._state_lock = threading.Lock()
        self._lock = threading.Lock()
        self._chains: dict[str, list[ToxicSpec]] = {d: [] for d in DIRECTIONS}
        self._conns: set[Connection] = set()
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None

    # -- JSON ----------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "listen": self.listen,
            "upstream": self.upstream,
            "enabled": self.enabled,
            "toxics": self.toxics_json(),
        }

    def toxics_json(self) -> list[dict[str, Any]]:
        with self._lock:
            return [t.to_json() for d in DIRECTIONS for t in self._chains[d]]

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        with self._state_lock:
            self._start()

    def stop(self) -> None:
        with self._state_lock:
            self._stop()

    def update(self, listen: str, upstream: str, enabled: bool) -> None:
        """Upstream ``Proxy.Update``: restart on address change, then apply ``enabled``."""
        with self._state_lock:
            if listen != self.listen or upstream != self.upstream:
                self._stop()
                self.listen, self.upstream = listen, upstream
            if enabled and not self.enabled:
                self._start()
            elif not enabled and self.enabled:
                self._stop()

    def _start(self) -> None:
        if self.enabled:
            return
        host, port = split_address(self.listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise ApiError(f"listen tcp {self.listen}: {exc.strerror or exc}", 500) from None
        bound_host, bound_port = listener.getsockname()[:2]
        self.listen = (
            f"[{bound_host}]:{bound_port}"
            if family == socket.AF_INET6
            else (f"{bound_host}:{bound_port}")
        )
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._accept_thread = threading.Thread(
            target=self._accept_loop,
            args=(listener, self._wake_r),
            name=f"toxiproxy-accept-{self.name}",
            daemon=True,
        )
        self.enabled = True
        self._accept_thread.start()

    def _stop(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        assert self._wake_w is not None and self._accept_thread is not None
        self._wake_w.send(b"x")
        self._accept_thread.join(JOIN_TIMEOUT)
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._listener = self._wake_r = self._wake_w = None
        self._accept_thread = None
        self.close_connections()

    def close_connections(self) -> None:
        """Close every live connection and wait (bounded) for their threads."""
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.stop()
        for conn in conns:
            conn.join(JOIN_TIMEOUT)

    def connection_count(self) -> int:
        with self._lock:
            return len(self._conns)

    # -- accept thread -------------------------------------------------------
    def _accept_loop(self, listener: socket.socket, wake: socket.socket) -> None:
        while True:
            readable, _, _ = select.select([listener, wake], [], [])
            if wake in readable:
                return
            try:
                client, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            self._handle_client(client)

    def _handle_client(self, client: socket.socket) -> None:
        host, port = split_address(self.upstream)
        try:
            upstream = socket.create_connection((host, port), timeout=UPSTREAM_CONNECT_TIMEOUT)
        except OSError:
            client.close()  # upstream logs "Unable to open connection to upstream"
            return
        with self._lock:
            conn = Connection(
                f"toxiproxy-{self.name}-{next(_conn_ids)}",
                client,
                upstream,
                list(self._chains["upstream"]),
                list(self._chains["downstream"]),
                self._connection_closed,
            )
            self._conns.add(conn)
            conn.start()

    def _connection_closed(self, conn: Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    # -- toxics ----------------------------------------------------------------
    def _find(self, name: str) -> ToxicSpec | None:
        for direction in DIRECTIONS:
            for spec in self._chains[direction]:
                if spec.name == name:
                    return spec
        return None

    def get_toxic(self, name: str) -> ToxicSpec:
        with self._lock:
            spec = self._find(name)
        if spec is None:
            raise ERR_TOXIC_NOT_FOUND
        return spec

    def add_toxic(self, body: object) -> ToxicSpec:
        with self._lock:
            spec = parse_new_toxic(body, lambda name: self._find(name) is not None)
            self._chains[spec.stream].append(spec)
            for conn in self._conns:
                (conn.up if spec.stream == "upstream" else conn.down).add_toxic(spec)
            return spec

    def update_toxic(self, name: str, body: object) -> ToxicSpec:
        with self._lock:
            current = self._find(name)
            if current is None:
                raise ERR_TOXIC_NOT_FOUND
            spec = parse_toxic_update(current, body)
            chain = self._chains[spec.stream]
            chain[chain.index(current)] = spec
            for conn in self._conns:
                (conn.up if spec.stream == "upstream" else conn.down).update_toxic(spec)
            return spec

    def remove_toxic(self, name: str) -> None:
        with self._lock:
            spec = self._find(name)
            if spec is None:
                raise ERR_TOXIC_NOT_FOUND
            self._chains[spec.stream].remove(spec)
            for conn in self._conns:
                (conn.up if spec.stream == "upstream" else conn.down).remove_toxic(name)

    def reset_toxics(self) -> None:
        with self._lock:
            names = [t.name for d in DIRECTIONS for t in self._chains[d]]
        for name in names:
            try:
                self.remove_toxic(name)
            except ApiError:
                pass  # removed concurrently
