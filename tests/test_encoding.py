"""PublishEncoder writes exactly the bytes py-amqp's frame writer writes for a
Basic.Publish, raises where it raises, and the fast path round-trips through the broker;
a settlement is encoded, and a delivery's arguments decoded, as py-amqp does."""

from __future__ import annotations

import copy
import struct
from collections.abc import Callable
from datetime import datetime
from typing import Any

import amqp
import pytest
from amqp import spec
from amqp.method_framing import frame_writer
from amqp.serialization import dumps, loads
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from support.broker import unique_name, wait_until

from drainer_amqp.channel import _deliver_args, _settlement_frame
from drainer_amqp.encoding import CACHE_SIZE, PublishEncoder

MODES = ["legacy", "drainer"]
#: Basic.Publish's exchange, routing key, mandatory, immediate.
Publish = tuple[Any, Any, bool, bool]


class _Wire:
    """A fake connection and transport for py-amqp's frame writer: keeps its bytes."""

    def __init__(self, frame_max: int) -> None:
        self.frame_max = frame_max
        self.bytes_sent = 0
        self.chunks: list[bytes] = []

    def write(self, data: Any) -> None:
        self.chunks.append(bytes(data))  # py-amqp reuses its buffer


def py_amqp_bytes(frame_max: int, channel_id: int, publish: Publish, msg: Any) -> bytes:
    wire = _Wire(frame_max)
    write = frame_writer(wire, wire)
    write(1, channel_id, spec.Basic.Publish, dumps("Bssbb", (0, *publish)), msg)
    return b"".join(wire.chunks)


#: py-amqp 5.2 writes no content header for an empty body that does not fit in one frame
#: (``if body:``), a publish the broker refuses; the encoder writes it, as later releases do.
EMPTY_BODY_HEADER_DROPPED = (
    py_amqp_bytes(9, 1, ("", "", False, False), amqp.Message(b"")).count(b"\xce") == 1
)


def encoded_bytes(encoder: PublishEncoder, channel_id: int, publish: Publish, msg: Any) -> bytes:
    """What a publish writes: the encoder's frames, or py-amqp's where it declines."""
    chunks = encoder.encode(channel_id, *publish, msg)
    if chunks is None:
        return py_amqp_bytes(encoder.frame_max, channel_id, publish, msg)
    return b"".join(bytes(chunk) for chunk in chunks)


def outcome(encode: Callable[[], bytes]) -> tuple[str, bytes]:
    """What an encoding gave: its bytes, or the type of the error it raised."""
    try:
        return "ok", encode()
    except Exception as exc:  # noqa: BLE001 - compared with py-amqp's
        return type(exc).__name__, b""


# -- strategies ---------------------------------------------------------------------------
shortstr = st.text(max_size=40) | st.binary(max_size=40)
ints = (
    st.integers(-(2**7), 2**7)
    | st.integers(-(2**31), 2**31)
    | st.integers(-(2**63), 2**63 - 1)
    | st.sampled_from([2147483647, 2147483648, -2147483647, -2147483648, 2**63 - 1, -(2**63)])
)
scalars = (
    st.none()
    | st.booleans()
    | ints
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
    | st.binary(max_size=30)
    | st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(2200, 1, 1))
    | st.decimals(min_value=-1000, max_value=1000, places=3)
)
keys = st.text(max_size=20) | st.binary(max_size=20)
values = st.recursive(
    scalars,
    lambda inner: (
        st.dictionaries(keys, inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.lists(inner, max_size=4)
    ),
    max_leaves=12,
)
headers = st.dictionaries(keys, values, max_size=6)
#: Values py-amqp cannot encode (it raises): the encoder must raise the same error.
odd = st.sampled_from([300, -1, "x" * 256, 1.5, datetime(2020, 1, 1), 2**64, frozenset({1})])


def _optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


properties = st.fixed_dictionaries(
    {},
    optional={
        "content_type": _optional(shortstr),
        "content_encoding": st.sampled_from(["utf-8", "latin-1", "utf-16", "binary"]),
        "application_headers": _optional(headers),
        "delivery_mode": _optional(st.integers(0, 255)),
        "priority": _optional(st.integers(0, 255)),
        "correlation_id": _optional(shortstr),
        "reply_to": _optional(shortstr),
        "expiration": _optional(shortstr),
        "message_id": _optional(shortstr),
        "timestamp": _optional(st.integers(0, 2**64 - 1)),
        "type": _optional(shortstr),
        "user_id": _optional(shortstr),
        "app_id": _optional(shortstr),
        "cluster_id": _optional(shortstr),
        "x-not-a-property": st.integers(),  # ignored by py-amqp
    },
)
frame_maxes = st.integers(9, 80) | st.integers(4096, 4200) | st.just(131072)


@st.composite
def bodies(draw: st.DrawFn, frame_max: int) -> Any:
    """Empty, small, str, and sizes around multiples of a body frame's payload."""
    chunk = frame_max - 8
    around = draw(st.integers(0, 3)) * chunk + draw(st.integers(-40, 40))
    size = max(0, min(around, 3 * 131072))
    return draw(
        st.just(b"")
        | st.binary(max_size=200)
        | st.text(max_size=200)
        | st.just(b"b" * size)
        | st.just("\u00e9" * (size // 2))
    )


class _OwnMessage(amqp.Message):
    """A message class of its own: the encoder leaves it to py-amqp."""


@st.composite
def publishes(draw: st.DrawFn) -> tuple[int, int, Publish, Any, Any]:
    frame_max = draw(frame_maxes)
    channel_id = draw(st.integers(1, 65535))
    name = st.text(max_size=60) | st.binary(max_size=60)
    publish = (draw(name), draw(name), draw(st.booleans()), draw(st.booleans()))
    body = draw(bodies(frame_max) | st.binary(max_size=50).map(bytearray))
    props = draw(properties)
    if draw(st.integers(0, 9)) == 0:  # now and then, a value py-amqp refuses
        field = draw(st.sampled_from([n for n, _ in amqp.Message.PROPERTIES]))
        props[field] = draw(odd)
    if draw(st.integers(0, 9)) == 0:
        props["application_headers"] = {"odd": draw(odd | st.just(2**63))}
    cls = draw(st.sampled_from([amqp.Message, amqp.Message, _OwnMessage]))
    build: Any = None if draw(st.integers(0, 30)) == 0 else cls
    return frame_max, channel_id, publish, build, (body, props)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(publishes())
def test_the_encoder_writes_py_amqps_bytes(
    case: tuple[int, int, Publish, Any, Any],
) -> None:
    frame_max, channel_id, publish, cls, (body, props) = case
    assume(not (EMPTY_BODY_HEADER_DROPPED and cls is not None and len(body) == 0))
    theirs = None if cls is None else cls(body, **copy.deepcopy(props))
    ours = None if cls is None else cls(body, **copy.deepcopy(props))
    encoder = PublishEncoder(frame_max)
    expected = outcome(lambda: py_amqp_bytes(frame_max, channel_id, publish, theirs))
    event(f"py-amqp: {expected[0]}")
    if cls is not None:
        event(f"body frames: {min(-(-len(body) // (frame_max - 8)), 3)}")
    assert outcome(lambda: encoded_bytes(encoder, channel_id, publish, ours)) == expected
    if ours is not None and theirs is not None:
        assert ours.properties == theirs.properties  # content_encoding set for a str body
    if expected[0] == "ok":  # the cached method frame, for a second message
        again = None if cls is None else cls(body, **copy.deepcopy(props))
        assert encoded_bytes(encoder, channel_id, publish, again) == expected[1]


def test_a_large_body_is_not_copied_by_the_encoder() -> None:
    body = bytes(range(256)) * 2000  # 512000 bytes: four frames at frame_max 131072
    chunks = PublishEncoder(131072).encode(1, "", "q", False, False, amqp.Message(body))
    assert chunks is not None
    views = [c for c in chunks if isinstance(c, memoryview)]
    assert [len(v) for v in views] == [131064, 131064, 131064, 512000 - 3 * 131064]
    assert all(v.obj is body for v in views)
    expected = py_amqp_bytes(131072, 1, ("", "q", False, False), amqp.Message(body))
    assert b"".join(chunks) == expected


def test_the_method_frame_cache_is_bounded() -> None:
    encoder = PublishEncoder(131072)
    for i in range(3 * CACHE_SIZE):
        encoder.encode(1, "", f"queue-{i}", False, False, amqp.Message(b"x"))
    assert len(encoder._methods) <= CACHE_SIZE


def test_a_frame_max_too_small_for_any_body_is_refused() -> None:
    with pytest.raises(ValueError):
        PublishEncoder(8)


# -- through the broker ---------------------------------------------------------------------
def _messages() -> list[amqp.Message]:
    return [
        amqp.Message(b""),
        amqp.Message("h\u00e9llo w\u00f6rld"),
        amqp.Message(
            b"small",
            content_type="application/json",
            content_encoding="binary",
            delivery_mode=2,
            priority=3,
            correlation_id="c-1",
            reply_to="replies",
            message_id="m-1",
            timestamp=1700000000,
            type="kind",
            app_id="tests",
            application_headers={
                "int": 7,
                "big": 2**40,
                "neg": -5,
                "text": "t\u00eaxt",
                "flag": True,
                "none": None,
                "float": 1.5,
                "nested": {"list": [1, "two", {"three": 3}]},
            },
        ),
        amqp.Message(bytes(range(256)) * 1200),  # 307200 bytes: several frames
        amqp.Message("\u00e9" * 70000, content_encoding="utf-8"),  # 140000 bytes encoded
    ]


@pytest.mark.parametrize("frame_max", [4096, 131072])
@pytest.mark.parametrize("mode", MODES)
def test_the_fast_path_round_trips_through_the_broker(
    mode: str, frame_max: int, connect: Callable[..., Any]
) -> None:
    conn = connect(mode, frame_max=frame_max)
    assert conn.publish_encoder is not None and conn.publish_encoder.frame_max == conn.frame_max
    channel = conn.channel()
    channel.auto_decode = False  # compare the bytes on the wire
    queue = channel.queue_declare(unique_name(), exclusive=True).queue
    sent = _messages()
    for message in sent:
        channel.basic_publish(message, routing_key=queue)
    assert wait_until(
        lambda: channel.queue_declare(queue, passive=True).message_count == len(sent), 10
    )
    for message in sent:
        got = channel.basic_get(queue, no_ack=True)
        assert got is not None
        body = message.body
        if isinstance(body, str):
            body = body.encode(message.properties["content_encoding"])
        assert got.body == (body or "")  # py-amqp gives an empty body as ""
        assert got.properties == message.properties


@pytest.mark.parametrize("mode", MODES)
def test_a_fast_path_publish_counts_as_traffic_for_heartbeats(
    mode: str, connect: Callable[..., Any]
) -> None:
    conn = connect(mode)
    channel = conn.channel()
    before = conn.bytes_sent
    channel.basic_publish(amqp.Message(b"x"), routing_key=unique_name())
    assert conn.bytes_sent > before


@pytest.mark.parametrize(
    ("sig", "argsig", "args"),
    [
        (spec.Basic.Ack, "Lb", (5, False)),
        (spec.Basic.Ack, "Lb", (2**40, True)),
        (spec.Basic.Reject, "Lb", (7, True)),
        (spec.Basic.Reject, "Lb", (7, False)),
        (spec.Basic.Nack, "Lbb", (9, True, False)),
        (spec.Basic.Nack, "Lbb", (9, False, True)),
        (spec.Basic.Nack, "Lbb", (9, True, True)),
    ],
)
def test_a_settlement_frame_is_what_py_amqp_writes(
    sig: tuple[int, int], argsig: str, args: tuple[int | bool, ...]
) -> None:
    payload = struct.pack(">HH", *sig) + dumps(argsig, args)
    expected = struct.pack(">BHI", 1, 3, len(payload)) + payload + b"\xce"
    assert _settlement_frame(3, sig, args) == expected


_SHORT_STRINGS = st.text(max_size=80).filter(lambda s: len(s.encode()) <= 255)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(_SHORT_STRINGS, st.integers(0, 2**64 - 1), st.booleans(), _SHORT_STRINGS, _SHORT_STRINGS)
def test_a_deliveries_arguments_are_decoded_as_py_amqp_decodes_them(
    consumer_tag: str, delivery_tag: int, redelivered: bool, exchange: str, routing_key: str
) -> None:
    args = (consumer_tag, delivery_tag, redelivered, exchange, routing_key)
    payload = struct.pack(">HH", *spec.Basic.Deliver) + dumps("sLbss", args)
    assert _deliver_args(payload) == tuple(loads("sLbss", payload, 4)[0]) == args


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=60))
def test_a_delivery_of_another_length_than_its_strings_say_is_left_to_py_amqp(
    payload: bytes,
) -> None:
    """Whatever the bytes: no error, and either py-amqp's own reading of them or None
    (then py-amqp decodes it, or raises, itself)."""
    args = _deliver_args(payload)
    if args is not None:
        assert args == tuple(loads("sLbss", payload, 4)[0])
        assert len(payload) == len(dumps("sLbss", args)) + 4
