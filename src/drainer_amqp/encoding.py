"""A fast encoder for ``Basic.Publish``: the bytes py-amqp's frame writer would write.

py-amqp encodes every method through one generic path (``frame_writer``, ``dumps``,
``GenericContent._serialize_properties``), about 13 µs for a small publish. The
:class:`PublishEncoder` writes the same bytes for a publish: the method frame is cached
per channel, exchange, routing key and flags; the common properties and header values
are packed directly; anything unusual (a message class of its own, a property or header
value of another type, a body that is neither ``bytes`` nor ``str``) goes through
py-amqp's own code, so its output and its errors stay py-amqp's.

Frames, as py-amqp writes them: the method frame, the content header (class id, weight
0, body size, property flags and properties), then the body in frames of at most
``frame_max - 8`` bytes (none for an empty body). A ``str`` body is encoded with the
message's ``content_encoding``, which is set to ``utf-8`` when missing, as py-amqp does.
"""

from __future__ import annotations

from struct import Struct, pack
from typing import Any

from amqp import spec
from amqp.basic_message import Message
from amqp.serialization import GenericContent, dumps

__all__ = ["PublishEncoder"]

#: Cached method frames (and property layouts) kept per encoder.
CACHE_SIZE = 256
#: Bodies above this many bytes are not copied into the encoded message: they are
#: returned as their own chunk(s), copied once when the writer sends them.
COPY_LIMIT = 16 * 1024

_FRAME_END = b"\xce"
_CLASS_ID, _METHOD_ID = spec.Basic.Publish
_METHOD_HEAD = Struct(">BHIHH")  # type 1, channel, size, class id, method id
_HEADER_HEAD = Struct(">BHIHHQH")  # type 2, channel, size, class, weight, body size, flags
_BODY_HEAD = Struct(">cBHI")  # the previous frame's end, type 3, channel, size
_U32 = Struct(">I")
_OCTET = [bytes((i,)) for i in range(256)]
_INT = Struct(">ci").pack
_SIZED_HEAD = Struct(">cI").pack  # a field kind and its 32-bit size: strings, arrays
_LONG = Struct(">cq").pack
_DOUBLE = Struct(">cd").pack
_SHORTSTR, _OCTET_KIND, _TABLE, _TIMESTAMP = "s", "o", "F", "L"

#: Table keys seen, encoded with their length byte (shared by every encoder).
_KEYS: dict[str, bytes] = {}

#: Message's properties in wire order: name -> (position, flag bit, kind).
_PROPERTY = {name: (i, 1 << (15 - i), kind) for i, (name, kind) in enumerate(Message.PROPERTIES)}


def _standard(cls: type) -> bool:
    """The class's properties are Message's, serialised by py-amqp's generic code."""
    return cls is Message or (
        getattr(cls, "PROPERTIES", None) is Message.PROPERTIES
        and getattr(cls, "_serialize_properties", None) is GenericContent._serialize_properties
    )


def _table(table: dict[Any, Any]) -> bytes | None:
    """A field table as py-amqp's ``_write_table`` writes it, or None for a key or value
    of a type left to py-amqp (subclasses, Decimal, datetime, out-of-range ints)."""
    parts: list[bytes] = []
    append = parts.append
    keys = _KEYS
    for key, value in table.items():
        head = keys.get(key) if type(key) is str else None
        if head is None:
            head = _key(key)
            if head is None:
                return None
        append(head)
        if not _item(value, append):
            return None
    data = b"".join(parts)
    return _U32.pack(len(data)) + data


def _key(key: Any) -> bytes | None:
    """A table key's length and bytes (cached for str keys), or None if py-amqp's."""
    if type(key) is str:
        data = key.encode("utf-8", "surrogatepass")
    elif type(key) is bytes:
        data = key
    else:
        return None
    if len(data) > 255:
        return None
    head = _OCTET[len(data)] + data
    if type(key) is str:
        _remember(_KEYS, key, head, 4 * CACHE_SIZE)
    return head


def _item(value: Any, append: Any) -> bool:
    """Append one field value as py-amqp's ``_write_item`` writes it; False when the value
    is left to py-amqp."""
    kind = type(value)
    if kind is str:
        data = value.encode("utf-8", "surrogatepass")
        append(_SIZED_HEAD(b"S", len(data)))
        append(data)
    elif kind is bytes:
        append(_SIZED_HEAD(b"S", len(value)))
        append(value)
    elif kind is bool:
        append(b"t\x01" if value else b"t\x00")
    elif kind is int:
        if -2147483647 <= value <= 2147483647:
            append(_INT(b"I", value))
        elif -(2**63) <= value < 2**63:
            append(_LONG(b"L", value))
        else:
            return False
    elif kind is float:
        append(_DOUBLE(b"d", value))
    elif value is None:
        append(b"V")
    elif kind is dict:
        data = _table(value)
        if data is None:
            return False
        append(b"F")
        append(data)
    elif kind is list or kind is tuple:
        parts: list[bytes] = []
        if not all(_item(item, parts.append) for item in value):
            return False
        data = b"".join(parts)
        append(_SIZED_HEAD(b"A", len(data)))
        append(data)
    else:
        return False
    return True


class PublishEncoder:
    """Encodes ``Basic.Publish`` with its content for one connection's ``frame_max``.

    Safe to call from several threads at once (its caches are plain dicts)."""

    def __init__(self, frame_max: int, cache_size: int = CACHE_SIZE) -> None:
        if frame_max <= 8:
            raise ValueError(f"frame_max must be more than 8, not {frame_max!r}")
        self.frame_max = frame_max
        self.chunk_size = frame_max - 8  # a body frame's payload, at most
        self.cache_size = cache_size
        self._methods: dict[tuple[Any, ...], bytes] = {}
        self._layouts: dict[tuple[str, ...], list[tuple[str, int, str]]] = {}

    def encode(
        self,
        channel_id: int,
        exchange: Any,
        routing_key: Any,
        mandatory: Any,
        immediate: Any,
        msg: Any,
    ) -> list[bytes | memoryview] | None:
        """The frames of one publish, as chunks to send in order; None for what it
        leaves to py-amqp's own frame writer (no content, or content of a class or with
        a body it does not know)."""
        if not msg or not _standard(type(msg)) or type(msg.body) not in (bytes, str):
            return None
        method = self._method_frame(channel_id, exchange, routing_key, mandatory, immediate)
        body = msg.body
        if type(body) is str:
            encoding = msg.properties.setdefault("content_encoding", "utf-8")
            body = body.encode(encoding)
        props = msg.properties
        flags, properties = self._properties(props) if props else (0, b"")
        if properties is None:
            serialized = msg._serialize_properties()
            flags, properties = int.from_bytes(serialized[:2], "big"), serialized[2:]
        size = len(body)
        header = _HEADER_HEAD.pack(2, channel_id, 14 + len(properties), _CLASS_ID, 0, size, flags)
        if not size:
            return [b"".join((method, header, properties, _FRAME_END))]
        chunk_size = self.chunk_size
        if size <= chunk_size:
            head = _BODY_HEAD.pack(_FRAME_END, 3, channel_id, size)
            if size <= COPY_LIMIT:
                return [b"".join((method, header, properties, head, body, _FRAME_END))]
            return [b"".join((method, header, properties, head)), body, _FRAME_END]
        view = memoryview(body)
        chunks: list[bytes | memoryview] = [b"".join((method, header, properties))]
        append = chunks.append
        full = _BODY_HEAD.pack(_FRAME_END, 3, channel_id, chunk_size)
        for start in range(0, size, chunk_size):
            piece = view[start : start + chunk_size]
            append(
                full
                if len(piece) == chunk_size
                else _BODY_HEAD.pack(_FRAME_END, 3, channel_id, len(piece))
            )
            append(piece)
        append(_FRAME_END)
        return chunks

    def _method_frame(
        self, channel_id: int, exchange: Any, routing_key: Any, mandatory: Any, immediate: Any
    ) -> bytes:
        cacheable = type(exchange) is str and type(routing_key) is str
        if cacheable:
            key = (channel_id, exchange, routing_key, bool(mandatory), bool(immediate))
            frame = self._methods.get(key)
            if frame is not None:
                return frame
        args = dumps("Bssbb", (0, exchange, routing_key, mandatory, immediate))
        frame = _METHOD_HEAD.pack(1, channel_id, 4 + len(args), _CLASS_ID, _METHOD_ID)
        frame += args + _FRAME_END
        if cacheable:
            _remember(self._methods, key, frame, self.cache_size)
        return frame

    def _properties(self, props: dict[str, Any]) -> tuple[int, bytes | None]:
        """The property flags and list, or (0, None) for a value left to py-amqp."""
        names = tuple(props)
        layout = self._layouts.get(names)
        if layout is None:
            present = sorted((_PROPERTY[n][0], n) for n in names if n in _PROPERTY)
            layout = [(n, _PROPERTY[n][1], _PROPERTY[n][2]) for _, n in present]
            _remember(self._layouts, names, layout, self.cache_size)
        flags = 0
        parts: list[bytes] = []
        append = parts.append
        for name, bit, kind in layout:
            value = props[name]
            if value is None:
                continue
            flags |= bit
            kind_of = type(value)
            if kind is _SHORTSTR:
                if kind_of is str:
                    value = value.encode("utf-8", "surrogatepass")
                elif kind_of is not bytes:
                    return 0, None
                if len(value) > 255:
                    return 0, None
                append(_OCTET[len(value)])
                append(value)
            elif kind is _OCTET_KIND:
                if kind_of is not int or not 0 <= value <= 255:
                    return 0, None
                append(_OCTET[value])
            elif kind is _TABLE:
                if kind_of is not dict:
                    return 0, None
                table = _table(value)
                if table is None:
                    return 0, None
                append(table)
            else:  # _TIMESTAMP
                if kind_of is not int or not 0 <= value < 2**64:
                    return 0, None
                append(pack(">Q", value))
        return flags, b"".join(parts)


def _remember(cache: dict[Any, Any], key: Any, value: Any, limit: int) -> None:
    """Store in a bounded cache, dropping the oldest entry when full."""
    if len(cache) >= limit:
        try:
            del cache[next(iter(cache))]
        except (KeyError, RuntimeError, StopIteration):
            pass  # another thread changed it meanwhile
    cache[key] = value
