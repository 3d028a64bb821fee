"""Socket calls that keep the interpreter lock: ``send_at_once(sock)``, ``readable(sock)``.

``socket.sendall`` lets go of the interpreter lock around its system call, as every
socket call does (``select`` too). In a process whose threads queue for that lock (a web
worker's request threads), the calling thread then waits to get it back: a hand-over to
another thread and back, two context switches, for a system call that takes
microseconds. A call that cannot block (``MSG_DONTWAIT``) is cheaper with the lock kept.

Linux and CPython only, and plain TCP sockets only (not TLS, nor a socket's stand-in):
elsewhere :func:`send_at_once` gives None and the caller uses the socket's own calls,
and :func:`readable` asks ``select``.
"""

from __future__ import annotations

import ctypes
import errno
import select
import socket
import sys
from collections.abc import Callable

#: A larger write goes through ``sendall``: copying it would hold the lock for longer
#: than the hand-over costs, and the socket is more likely not to take it whole.
MAX_AT_ONCE = 64 * 1024

_FLAGS = 0x40 | 0x4000  # MSG_DONTWAIT | MSG_NOSIGNAL (Linux): never block, never SIGPIPE
_PEEK_FLAGS = 0x2 | 0x40  # MSG_PEEK | MSG_DONTWAIT (Linux): look, take nothing, never block
_NOTHING_YET = frozenset((errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR))


def _libc(name: str) -> Callable[..., int] | None:
    """libc's ``send`` or ``recv`` (fd, buffer, size, flags), called keeping the
    interpreter lock (``PyDLL``), errno kept for ``ctypes.get_errno``; None where that
    cannot be done."""
    if not sys.platform.startswith("linux") or sys.implementation.name != "cpython":
        return None
    try:
        function = getattr(ctypes.PyDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_ssize_t
    return function  # type: ignore[no-any-return]


_send = _libc("send")
_recv = _libc("recv")
_peeked = ctypes.create_string_buffer(1)  # what a peek copies, never read


def readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read now: bytes, its end of stream, or an error
    (which a read then raises). False when it has nothing yet, or is closed."""
    fd = sock.fileno()
    if fd < 0:
        return False
    if _recv is not None and type(sock) is socket.socket:
        if _recv(fd, _peeked, 1, _PEEK_FLAGS) >= 0:
            return True  # a byte, or the end of stream
        return ctypes.get_errno() not in _NOTHING_YET
    try:
        return bool(select.select((fd,), (), (), 0)[0])
    except (OSError, ValueError):  # closed meanwhile
        return False


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
