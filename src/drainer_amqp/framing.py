"""Incremental assembly of AMQP 0-9-1 frames from a byte stream (pure, no I/O).

A frame is ``type:u8 channel:u16 size:u32 payload[size] 0xCE``. Bytes arrive in
whatever pieces the socket gives; :meth:`FrameAssembler.feed` returns every frame that
is complete so far and keeps the rest. Not thread-safe: the drainer thread owns it.
"""

from __future__ import annotations

from struct import Struct, unpack_from

from .errors import MalformedFrame

__all__ = ["FRAME_END", "Frame", "FrameAssembler", "check_header"]

FRAME_END = 0xCE
HEADER_SIZE = 7
_OVERHEAD = HEADER_SIZE + 1  # the header and the frame-end byte
#: method, content header, content body, heartbeat
FRAME_TYPES = frozenset((1, 2, 3, 8))

Frame = tuple[int, int, bytes]
_HEADER = Struct(">BHI")


def check_header(
    header: bytes | bytearray, frame_max: int, offset: int = 0
) -> tuple[int, int, int]:
    """Unpack the 7-byte frame header at ``offset``: ``(type, channel, size)``.

    Raises :class:`MalformedFrame` for an unknown frame type or a frame larger than
    ``frame_max`` (0: no limit), so a reader can refuse a bogus size before it reads
    or buffers the payload.
    """
    frame_type, channel, size = unpack_from(">BHI", header, offset)
    if frame_type not in FRAME_TYPES:
        raise MalformedFrame(f"unknown frame type {frame_type}")
    if frame_max and size + _OVERHEAD > frame_max:
        raise MalformedFrame(f"frame of {size + _OVERHEAD} bytes exceeds frame_max {frame_max}")
    return frame_type, channel, size


class FrameAssembler:
    """Turns chunks of bytes into complete ``(type, channel, payload)`` frames."""

    def __init__(self, frame_max: int) -> None:
        self.frame_max = frame_max
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        """Add ``data``; return the frames it completes, in order.

        Raises :class:`MalformedFrame` for an unknown frame type, a size above
        ``frame_max`` (checked as soon as the header is in, so a bogus size fails at
        once instead of buffering) or a wrong frame-end byte; its ``frames`` are the
        frames this call completed before the bad one.
        """
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos = 0
        frame_max, unpack_header = self.frame_max, _HEADER.unpack_from
        try:
            while len(buf) - pos >= HEADER_SIZE:
                frame_type, channel, size = unpack_header(buf, pos)
                if frame_type not in FRAME_TYPES or (frame_max and size + _OVERHEAD > frame_max):
                    check_header(buf, frame_max, pos)  # raises, saying why
                end = pos + HEADER_SIZE + size
                if len(buf) <= end:
                    break
                if buf[end] != FRAME_END:
                    raise MalformedFrame(f"frame-end byte {buf[end]:#04x}, expected 0xce")
                frames.append((frame_type, channel, bytes(buf[pos + HEADER_SIZE : end])))
                pos = end + 1
        except MalformedFrame as exc:
            exc.frames = frames  # complete before the bad one: the caller delivers them
            raise
        finally:
            if pos:
                del buf[:pos]
        return frames

    @property
    def buffered(self) -> int:
        """Bytes held for a frame that is not complete yet."""
        return len(self._buf)

    def check_eof(self) -> None:
        """At end of stream: raise :class:`MalformedFrame` if a frame was cut short."""
        if self._buf:
            raise MalformedFrame(f"truncated frame: stream ended {len(self._buf)} bytes into it")
