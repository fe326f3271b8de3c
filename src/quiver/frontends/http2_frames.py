"""HTTP/2 (RFC 9113) wire constants, frame building, header-block encoding and request-head
validation, for Quiver's gRPC server (:mod:`quiver.frontends.http2` owns the connection).

Header blocks are decoded with the ``hpack`` package (RFC 7541, python-hyper). They are
encoded here, as literals without indexing (RFC 7541 6.2.2), which any decoder reads and
which never touch the peer's dynamic table: the few headers a gRPC server sends (status,
content type, ``grpc-status``, ``grpc-message``) are mostly the same bytes every time, so
Quiver's common blocks are built once (:func:`header_block`) instead of run through an
encoder per answer.
"""

from __future__ import annotations

import re
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 6).
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Error codes (RFC 9113 7).
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
SETTINGS_TIMEOUT = 0x4
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

# Settings (RFC 9113 6.5.2).
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6

#: Largest flow-control window and stream id (2^31 - 1).
MAX_WINDOW = 0x7FFFFFFF
#: The windows and frame size every connection starts with.
DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
#: The largest frame size a peer may announce.
LARGEST_FRAME = (1 << 24) - 1

#: A frame's 9-byte header: length (24 bits, as 16 + 8), type, flags, stream id.
FRAME_HEADER = struct.Struct(">HBBBL")
_SETTING = struct.Struct(">HL")
_U32 = struct.Struct(">L")
_GOAWAY = struct.Struct(">LL")


class ConnectionError(Exception):  # RFC 9113's name; import it under another
    """A connection error (RFC 9113 5.4.1): answered with GOAWAY and the connection closed."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StreamError(Exception):
    """A stream error (RFC 9113 5.4.2): the stream is reset, the connection goes on."""

    def __init__(self, stream_id: int, code: int, message: str) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.code = code
        self.message = message


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame (``payload`` at most the peer's maximum frame size)."""
    length = len(payload)
    return FRAME_HEADER.pack(length >> 8, length & 0xFF, kind, flags, stream_id) + payload


def data_frame_header(stream_id: int, length: int, flags: int = 0) -> bytes:
    return FRAME_HEADER.pack(length >> 8, length & 0xFF, DATA, flags, stream_id)


def headers_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """A header block as HEADERS and, past ``max_frame``, CONTINUATION frames."""
    flags = END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(HEADERS, flags | END_HEADERS, stream_id, block)
    parts = [frame(HEADERS, flags, stream_id, block[:max_frame])]
    at = max_frame
    while at < len(block):
        chunk = block[at : at + max_frame]
        at += max_frame
        parts.append(frame(CONTINUATION, END_HEADERS if at >= len(block) else 0, stream_id, chunk))
    return b"".join(parts)


def settings_frame(settings: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(key, value) for key, value in settings.items()))


def parse_settings(payload: bytes | memoryview) -> list[tuple[int, int]]:
    return [_SETTING.unpack_from(payload, at) for at in range(0, len(payload), 6)]


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_stream_id, code) + debug)


def u32(payload: bytes | memoryview) -> int:
    value: int = _U32.unpack_from(payload)[0]
    return value


def goaway_fields(payload: bytes | memoryview) -> tuple[int, int]:
    last, code = _GOAWAY.unpack_from(payload)
    return last & MAX_WINDOW, code


# -- HPACK encoding ---------------------------------------------------------------------------


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with ``first``'s high bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: RFC 7541's static table entries a gRPC server's answers use, by name.
_STATIC_NAMES = {b":status": 8, b"content-type": 31}
#: ":status: 200" is entry 8 of the static table itself.
_STATUS_200 = b"\x88"
#: A dynamic table size update to 0 (RFC 7541 6.3): Quiver's encoder never uses its table.
TABLE_SIZE_ZERO = b"\x20"


def header_block(headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...]) -> bytes:
    """An HPACK header block: every field a literal without indexing (names of the static
    table by index), so the block reads the same whatever either side's dynamic table holds."""
    out = []
    for name, value in headers:
        if name == b":status" and value == b"200":
            out.append(_STATUS_200)
            continue
        index = _STATIC_NAMES.get(name)
        if index is not None:
            out.append(_integer(index, 4, 0x00))
        else:
            out.append(b"\x00" + _integer(len(name), 7, 0x00) + name)
        out.append(_integer(len(value), 7, 0x00) + value)
    return b"".join(out)


# -- request heads ------------------------------------------------------------------------------

_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))
#: A field name of other than lower-case token characters (RFC 9110 5.1, RFC 9113 8.2.1).
_BAD_NAME = re.compile(rb"[^!#$%&'*+\-.^_`|~0-9a-z]")
#: A field value with NUL, CR or LF, or white space at either end (RFC 9113 8.2.1).
_BAD_VALUE = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")
#: Connection-specific fields HTTP/2 forbids (RFC 9113 8.2.2).
_CONNECTION_SPECIFIC = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))


def request_head(stream_id: int, headers: list[tuple[bytes, bytes]]) -> tuple[dict[bytes, bytes], list[tuple[bytes, bytes]]]:
    """The pseudo-header fields and the other fields of a request's header list, checked as
    RFC 9113 8.2 and 8.3.1 say: names of lower-case token characters, no connection-specific
    fields, values without NUL, CR, LF or white space at either end (a malformed request is a
    :class:`StreamError`, after the block was decoded, so HPACK stays in step)."""
    pseudo: dict[bytes, bytes] = {}
    fields: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name[:1] == b":":
            # (a :path that names no method is answered UNIMPLEMENTED whatever its bytes, as grpcio does)
            if fields or name not in _PSEUDO or name in pseudo or (name != b":path" and _BAD_VALUE.search(value)):
                raise StreamError(stream_id, PROTOCOL_ERROR, f"malformed request: pseudo-header {name!r}")
            pseudo[name] = value
            continue
        if not name or _BAD_NAME.search(name) or name in _CONNECTION_SPECIFIC:
            raise StreamError(stream_id, PROTOCOL_ERROR, f"malformed request: header {name!r}")
        if _BAD_VALUE.search(value):
            raise StreamError(stream_id, PROTOCOL_ERROR, f"malformed request: the value of header {name!r}")
        if name == b"te" and value != b"trailers":
            raise StreamError(stream_id, PROTOCOL_ERROR, "malformed request: te other than 'trailers'")
        fields.append((name, value))
    if b":method" not in pseudo or b":path" not in pseudo or b":scheme" not in pseudo or not pseudo[b":path"]:
        raise StreamError(stream_id, PROTOCOL_ERROR, "malformed request: :method, :scheme or :path missing")
    return pseudo, fields


__all__ = [
    "ConnectionError",
    "StreamError",
    "data_frame_header",
    "frame",
    "goaway",
    "header_block",
    "headers_frames",
    "request_head",
    "rst_stream",
    "settings_frame",
    "window_update",
]
