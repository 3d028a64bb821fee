"""Toxiproxy 2.5-compatible HTTP API (stdlib ``http.server``).

Threading contract
------------------
* :class:`ToxiproxyServer` is started and stopped by its owner thread.
  ``start`` binds (port 0 = free port) and runs ``serve_forever`` in a named
  daemon thread; ``stop`` shuts the HTTP loop down, deletes every proxy
  (closing listeners and connections) and joins the thread, all bounded.
* Each HTTP request is handled in its own named daemon thread.  The proxy
  registry is guarded by ``_lock``; per-proxy work is delegated to
  :class:`~.proxy.Proxy`, which has its own locking.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import unquote

from .proxy import Proxy
from .specs import (
    ERR_BAD_REQUEST_BODY,
    ERR_MISSING_FIELD,
    ERR_PROXY_EXISTS,
    ERR_PROXY_NOT_FOUND,
    ApiError,
    parse_proxy_fields,
)

__all__ = ["VERSION", "ToxiproxyServer"]

VERSION = "2.5.0"
_request_ids = itertools.count(1)

Response = tuple[int, Any]  # (status, JSON-able body or None for no content)


class _HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer whose per-request threads are named and daemonic."""

    daemon_threads = True
    allow_reuse_address = True
    api: ToxiproxyServer

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"toxiproxy-http-{next(_request_ids)}",
            daemon=True,
        )
        thread.start()


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "toxiproxy-py"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        pass  # keep pytest output clean

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")  # no PUT route: 405 like gorilla/mux

    def _body(self) -> object:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        if not raw.strip():
            raise ERR_BAD_REQUEST_BODY.joined("EOF")
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ERR_BAD_REQUEST_BODY.joined(str(exc)) from None

    def _dispatch(self, method: str) -> None:
        if self.headers.get("User-Agent", "").startswith("Mozilla/"):
            self._send_raw(403, b"User agent not allowed\n", "text/plain; charset=utf-8")
            return
        path = self.path.split("?", 1)[0]
        try:
            status, body = self.server.api.route(method, path, self._body)
        except ApiError as exc:
            data = json.dumps(exc.to_json(), separators=(",", ":")).encode() + b"\n"
            self._send_raw(exc.status, data, "application/json")
            return
        if isinstance(body, str):  # /version (and router misses) are plain text in 2.5
            self._send_raw(status, body.encode(), "text/plain;charset=utf-8" if body else None)
        elif body is None:
            self._send_raw(status, b"", None)
        else:
            data = json.dumps(body, separators=(",", ":")).encode()
            self._send_raw(status, data, "application/json")

    def _send_raw(self, status: int, data: bytes, content_type: str | None) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)


class ToxiproxyServer:
    """In-process Toxiproxy replacement; see the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._address = (host, port)
        self._lock = threading.Lock()
        self._proxies: dict[str, Proxy] = {}
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> ToxiproxyServer:
        httpd = _HTTPServer(self._address, _Handler)
        httpd.api = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="toxiproxy-http-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
        self._httpd = None
        self._thread = None
        with self._lock:
            proxies = list(self._proxies.values())
            self._proxies.clear()
        for proxy in proxies:
            proxy.stop()

    def __enter__(self) -> ToxiproxyServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def host(self) -> str:
        assert self._httpd is not None, "server not started"
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def proxies(self) -> dict[str, Proxy]:
        """Snapshot of the registry (for white-box tests)."""
        with self._lock:
            return dict(self._proxies)

    # -- routing ---------------------------------------------------------------
    def route(self, method: str, path: str, body: Callable[[], object]) -> Response:
        """Dispatch one request; raises :class:`ApiError` for API errors."""
        for pattern, handlers in _ROUTES:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            handler = handlers.get(method)
            if handler is None:
                return 405, ""  # gorilla/mux: empty 405
            return handler(self, body, *(unquote(g) for g in match.groups()))
        return 404, "404 page not found\n"  # gorilla/mux NotFound, plain text

    def _get(self, name: str) -> Proxy:
        with self._lock:
            proxy = self._proxies.get(name)
        if proxy is None:
            raise ERR_PROXY_NOT_FOUND
        return proxy

    # -- handlers --------------------------------------------------------------
    def _version(self, body: Callable[[], object]) -> Response:
        return 200, VERSION

    def _reset(self, body: Callable[[], object]) -> Response:
        for proxy in self.proxies().values():
            proxy.start()
            proxy.reset_toxics()
        return 204, None

    def _proxy_index(self, body: Callable[[], object]) -> Response:
        return 200, {name: p.to_json() for name, p in self.proxies().items()}

    def _proxy_create(self, body: Callable[[], object]) -> Response:
        fields = parse_proxy_fields(
            body(), {"name": "", "listen": "", "upstream": "", "enabled": True}
        )
        if not fields["name"]:
            raise ERR_MISSING_FIELD.joined("name")
        if not fields["upstream"]:
            raise ERR_MISSING_FIELD.joined("upstream")
        proxy = Proxy(fields["name"], fields["listen"], fields["upstream"])
        with self._lock:
            if proxy.name in self._proxies:
                raise ERR_PROXY_EXISTS
            if fields["enabled"]:
                proxy.start()
            self._proxies[proxy.name] = proxy
        return 201, proxy.to_json()

    def _proxy_show(self, body: Callable[[], object], name: str) -> Response:
        return 200, self._get(name).to_json()

    def _proxy_update(self, body: Callable[[], object], name: str) -> Response:
        proxy = self._get(name)
        fields = parse_proxy_fields(
            body(),
            {"listen": proxy.listen, "upstream": proxy.upstream, "enabled": proxy.enabled},
        )
        proxy.update(fields["listen"], fields["upstream"], fields["enabled"])
        return 200, proxy.to_json()

    def _proxy_delete(self, body: Callable[[], object], name: str) -> Response:
        with self._lock:
            proxy = self._proxies.pop(name, None)
        if proxy is None:
            raise ERR_PROXY_NOT_FOUND
        proxy.stop()
        return 204, None

    def _toxic_index(self, body: Callable[[], object], name: str) -> Response:
        return 200, self._get(name).toxics_json()

    def _toxic_create(self, body: Callable[[], object], name: str) -> Response:
        proxy = self._get(name)
        return 200, proxy.add_toxic(body()).to_json()

    def _toxic_show(self, body: Callable[[], object], name: str, toxic: str) -> Response:
        return 200, self._get(name).get_toxic(toxic).to_json()

    def _toxic_update(self, body: Callable[[], object], name: str, toxic: str) -> Response:
        proxy = self._get(name)
        return 200, proxy.update_toxic(toxic, body()).to_json()

    def _toxic_delete(self, body: Callable[[], object], name: str, toxic: str) -> Response:
        self._get(name).remove_toxic(toxic)
        return 204, None


_Handlers = dict[str, Callable[..., Response]]
_ROUTES: list[tuple[re.Pattern[str], _Handlers]] = [
    (re.compile(r"/version"), {"GET": ToxiproxyServer._version}),
    (re.compile(r"/reset"), {"POST": ToxiproxyServer._reset}),
    (
        re.compile(r"/proxies"),
        {"GET": ToxiproxyServer._proxy_index, "POST": ToxiproxyServer._proxy_create},
    ),
    (
        re.compile(r"/proxies/([^/]+)"),
        {
            "GET": ToxiproxyServer._proxy_show,
            "POST": ToxiproxyServer._proxy_update,
            "PATCH": ToxiproxyServer._proxy_update,
            "DELETE": ToxiproxyServer._proxy_delete,
        },
    ),
    (
        re.compile(r"/proxies/([^/]+)/toxics"),
        {"GET": ToxiproxyServer._toxic_index, "POST": ToxiproxyServer._toxic_create},
    ),
    (
        re.compile(r"/proxies/([^/]+)/toxics/([^/]+)"),
        {
            "GET": ToxiproxyServer._toxic_show,
            "POST": ToxiproxyServer._toxic_update,
            "PATCH": ToxiproxyServer._toxic_update,
            "DELETE": ToxiproxyServer._toxic_delete,
        },
    ),
]
