"""A small write that keeps the interpreter lock: ``send_at_once(sock)``.

``socket.sendall`` lets go of the interpreter lock around its system call, as every
socket call does. In a process whose threads queue for that lock (a web worker's request
threads), the sending thread then waits to get it back: a hand-over to another thread
and back, two context switches, for a system call that takes microseconds. A send that
cannot block (``MSG_DONTWAIT``) of a few kilobytes is cheaper with the lock kept.

Linux and CPython only, and plain TCP sockets only (not TLS, nor a socket's stand-in):
elsewhere :func:`send_at_once` gives None and the caller uses the socket's own calls.
"""

from __future__ import annotations

import ctypes
import socket
import sys
from collections.abc import Callable

#: A larger write goes through ``sendall``: copying it would hold the lock for longer
#: than the hand-over costs, and the socket is more likely not to take it whole.
MAX_AT_ONCE = 64 * 1024

_FLAGS = 0x40 | 0x4000  # MSG_DONTWAIT | MSG_NOSIGNAL (Linux): never block, never SIGPIPE


def _libc_send() -> Callable[[int, bytes, int, int], int] | None:
    if not sys.platform.startswith("linux") or sys.implementation.name != "cpython":
        return None
    try:
        send = ctypes.PyDLL(None).send  # PyDLL: the call keeps the interpreter lock
    except (OSError, AttributeError):
        return None
    send.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
    send.restype = ctypes.c_ssize_t
    return send  # type: ignore[no-any-return]


_send = _libc_send()


def send_at_once(sock: object) -> Callable[[bytes | memoryview], int] | None:
    """A function that gives ``sock`` what it takes of a payload at once, without letting
    go of the interpreter lock, and returns how many bytes it took: 0 when it took none,
    or failed (the socket's own call then raises that error), or when the payload is
    larger than :data:`MAX_AT_ONCE`. None when that cannot be done here.

    The caller writes the rest with ``sendall``. The socket must not be closed while the
    function runs (the writer holds ``io_lock``, which closing the socket takes)."""
    if _send is None or type(sock) is not socket.socket:
        return None
    libc_send = _send
    fileno = sock.fileno

    def send(payload: bytes | memoryview) -> int:
        size = len(payload)
        if size > MAX_AT_ONCE:
            return 0
        if type(payload) is not bytes:
            payload = bytes(payload)
        return max(libc_send(fileno(), payload, size, _FLAGS), 0)

    return send
