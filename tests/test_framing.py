"""The frame assembler alone: pure bytes in, frames out."""

from __future__ import annotations

import random
import struct

import pytest

from drainer_amqp.errors import ConnectionLost, MalformedFrame
from drainer_amqp.framing import FrameAssembler


def frame(frame_type: int, channel: int, payload: bytes, end: int = 0xCE) -> bytes:
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + bytes([end])


def test_whole_frames_in_one_chunk() -> None:
    data = frame(1, 0, b"method") + frame(8, 0, b"") + frame(3, 5, b"body")
    assert FrameAssembler(131072).feed(data) == [(1, 0, b"method"), (8, 0, b""), (3, 5, b"body")]


def test_frame_split_at_every_byte_boundary() -> None:
    data = frame(2, 7, b"x" * 50) + frame(3, 7, b"y" * 20)
    for cut in range(1, len(data)):
        assembler = FrameAssembler(131072)
        assert assembler.feed(data[:cut]) + assembler.feed(data[cut:]) == [
            (2, 7, b"x" * 50),
            (3, 7, b"y" * 20),
        ]
        assert assembler.buffered == 0


def test_random_slices_reassemble_in_order() -> None:
    rng = random.Random(1234)
    frames = [(3, rng.randrange(1, 10), rng.randbytes(rng.randrange(0, 3000))) for _ in range(200)]
    stream = b"".join(frame(*f) for f in frames)
    assembler = FrameAssembler(131072)
    out = []
    pos = 0
    while pos < len(stream):
        size = rng.randrange(1, 700)
        out.extend(assembler.feed(stream[pos : pos + size]))
        pos += size
    assert out == frames


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (frame(1, 0, b"abc", end=0x00), "frame-end byte 0x00"),
        (frame(9, 0, b"abc"), "unknown frame type 9"),
        (struct.pack(">BHI", 3, 1, 200_000), "exceeds frame_max"),
    ],
)
def test_malformed_frames_raise_a_recoverable_typed_error(data: bytes, message: str) -> None:
    with pytest.raises(MalformedFrame, match=message) as info:
        FrameAssembler(131072).feed(data)
    assert isinstance(info.value, ConnectionLost)


def test_oversized_frame_fails_on_the_header_before_the_payload_arrives() -> None:
    assembler = FrameAssembler(4096)
    with pytest.raises(MalformedFrame):
        assembler.feed(struct.pack(">BHI", 3, 1, 4096))


def test_truncated_frame_is_reported_at_end_of_stream() -> None:
    assembler = FrameAssembler(131072)
    assert assembler.feed(frame(1, 0, b"method")[:-3]) == []
    with pytest.raises(MalformedFrame, match="truncated"):
        assembler.check_eof()
    FrameAssembler(131072).check_eof()  # an empty buffer at EOF is a clean end
