"""Property tests of the frame assembler: whatever bytes come, in whatever pieces.

The assembler is compared with a reference reader that sees the whole stream at once.
Properties: the pieces make no difference; nothing but ``MalformedFrame`` is ever
raised; the assembler never holds more than one frame's worth (``frame_max``) of bytes
after its header was checked; every frame completed before a bad one is handed out.
Deterministic in CI: derandomized, no example database.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drainer_amqp.errors import MalformedFrame
from drainer_amqp.framing import FRAME_TYPES, HEADER_SIZE, Frame, FrameAssembler

FRAME_MAX = 4096
SETTINGS = settings(
    max_examples=300,
    deadline=1000,  # ms per example: far above a few ms, so only a hang fails it
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def encode(frames: list[Frame]) -> bytes:
    return b"".join(struct.pack(">BHI", t, c, len(p)) + p + b"\xce" for t, c, p in frames)


def reference(stream: bytes, frame_max: int) -> tuple[list[Frame], bool, int]:
    """Read ``stream`` whole: (frames before any bad one, whether one is bad, bytes left
    over in an incomplete last frame)."""
    frames: list[Frame] = []
    pos = 0
    while len(stream) - pos >= HEADER_SIZE:
        frame_type, channel, size = struct.unpack(">BHI", stream[pos : pos + HEADER_SIZE])
        if frame_type not in FRAME_TYPES or size + HEADER_SIZE + 1 > frame_max:
            return frames, True, 0
        end = pos + HEADER_SIZE + size
        if end >= len(stream):
            break
        if stream[end] != 0xCE:
            return frames, True, 0
        frames.append((frame_type, channel, stream[pos + HEADER_SIZE : end]))
        pos = end + 1
    return frames, False, len(stream) - pos


def feed_in_pieces(
    stream: bytes, cuts: list[int], frame_max: int
) -> tuple[list[Frame], MalformedFrame | None, FrameAssembler]:
    """Feed ``stream`` cut at ``cuts``; collect what comes out, including the frames a
    ``MalformedFrame`` carries. Checks the buffer bound after every piece."""
    assembler = FrameAssembler(frame_max)
    out: list[Frame] = []
    bounds = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    for start, stop in zip(bounds, bounds[1:], strict=False):
        try:
            out.extend(assembler.feed(stream[start:stop]))
        except MalformedFrame as exc:
            out.extend(exc.frames)
            return out, exc, assembler
        # What is kept is part of one frame whose header (if complete) passed the check.
        assert assembler.buffered < max(frame_max, HEADER_SIZE), assembler.buffered
    return out, None, assembler


frames_strategy = st.lists(
    st.tuples(
        st.sampled_from(sorted(FRAME_TYPES)),
        st.integers(0, 65535),
        st.binary(max_size=300),
    ),
    max_size=12,
)
cuts_strategy = st.lists(st.integers(0, 10_000), max_size=20)


def check_against_reference(stream: bytes, cuts: list[int], frame_max: int = FRAME_MAX) -> None:
    want, bad, left = reference(stream, frame_max)
    got, error, assembler = feed_in_pieces(stream, cuts, frame_max)
    assert got == want
    assert (error is not None) == bad, error
    if error is None:
        assert assembler.buffered == left
        if left:
            with pytest.raises(MalformedFrame, match="truncated"):
                assembler.check_eof()
        else:
            assembler.check_eof()


@SETTINGS
@given(frames_strategy, cuts_strategy)
def test_valid_streams_reassemble_the_same_whatever_the_pieces(
    frames: list[Frame], cuts: list[int]
) -> None:
    got, error, assembler = feed_in_pieces(encode(frames), cuts, FRAME_MAX)
    assert error is None
    assert got == frames
    assert assembler.buffered == 0


@SETTINGS
@given(st.binary(max_size=2000), cuts_strategy)
def test_random_bytes_raise_only_malformed_frame(stream: bytes, cuts: list[int]) -> None:
    check_against_reference(stream, cuts)


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.integers(0, 255)),
)


def mutate(stream: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    data = bytearray(stream)
    for kind, where, value in mutations:
        if not data:
            break
        at = where % len(data)
        if kind == "flip":
            data[at] ^= value
        elif kind == "truncate":
            del data[at:]
        else:
            data.insert(at, value)
    return bytes(data)


@SETTINGS
@given(frames_strategy, st.lists(mutation, min_size=1, max_size=4), cuts_strategy)
def test_mutated_valid_streams_raise_only_malformed_frame(
    frames: list[Frame], mutations: list[tuple[str, int, int]], cuts: list[int]
) -> None:
    check_against_reference(mutate(encode(frames), mutations), cuts)


@SETTINGS
@given(
    frames_strategy,
    st.integers(FRAME_MAX - HEADER_SIZE, 2**32 - 1),
    st.binary(max_size=FRAME_MAX * 2),
    cuts_strategy,
)
def test_an_oversized_frame_fails_on_its_header_and_earlier_frames_survive(
    frames: list[Frame], size: int, payload: bytes, cuts: list[int]
) -> None:
    """However big the announced size and however the bytes are cut, the error comes
    once the header is in, before the payload is buffered, and the frames before it are
    handed out."""
    good = encode(frames)
    stream = good + struct.pack(">BHI", 3, 1, size) + payload
    got, error, _ = feed_in_pieces(stream, cuts, FRAME_MAX)  # checks the buffer bound
    assert got == frames
    assert error is not None and "exceeds frame_max" in str(error)


def test_frames_before_a_bad_one_in_the_same_piece_are_handed_out() -> None:
    """The bug this guards: a feed that completed frames and then hit a bad one lost
    them (the drainer delivers ``MalformedFrame.frames`` before it fails)."""
    good = [(1, 0, b"method"), (3, 1, b"body")]
    stream = encode(good) + struct.pack(">BHI", 1, 0, 1) + b"x\x00"
    with pytest.raises(MalformedFrame, match="frame-end") as info:
        FrameAssembler(FRAME_MAX).feed(stream)
    assert info.value.frames == good
