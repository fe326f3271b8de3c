"""HTTP content codings: request bodies inflated under a limit (``Content-Encoding``) and
answers compressed for clients that accept it (``Accept-Encoding``), gzip preferred."""

from __future__ import annotations

import asyncio
import functools
import gzip
import zlib

from quiver.errors import InvalidArgumentError
from quiver.frontends.status import BodyTooLarge


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo gzip/deflate, refusing output past ``limit`` (a small body can inflate hugely)."""
    if encoding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":
        wbits = zlib.MAX_WBITS
    else:
        raise InvalidArgumentError(
            f"unsupported Content-Encoding '{encoding}'; use gzip, deflate or identity"
        )
    decompressor = zlib.decompressobj(wbits)
    try:
        out = decompressor.decompress(body, limit + 1)
        if len(out) > limit or decompressor.unconsumed_tail:
            raise BodyTooLarge(limit)
        out += decompressor.flush()
    except zlib.error as exc:
        raise InvalidArgumentError(f"request body is not valid {encoding} data: {exc}") from None
    if not decompressor.eof:
        raise InvalidArgumentError(f"request body is truncated {encoding} data")
    return out


#: Smaller responses go out as they are: compressing them costs more than it saves.
MIN_COMPRESS_BYTES = 1024
#: Larger ones are compressed on a thread, so one big answer does not stall the event loop.
THREAD_COMPRESS_BYTES = 256 * 1024


def accepted_codings(accept: str) -> set[str]:
    """Codings the client accepts (``Accept-Encoding``), without those it refuses (``q=0``)."""
    codings = set()
    for part in accept.split(","):
        name, _, params = part.partition(";")
        q = params.strip().lower()
        if q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"):
            continue
        codings.add(name.strip().lower())
    return codings


async def compress_for(payload: bytes, accept: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    """Compress for a client that asked (``Accept-Encoding``); gzip preferred."""
    if len(payload) < MIN_COMPRESS_BYTES:
        return payload
    accepted = accepted_codings(accept)
    if "gzip" in accepted:
        coding, compress = b"gzip", functools.partial(gzip.compress, compresslevel=1)
    elif "deflate" in accepted:
        coding, compress = b"deflate", functools.partial(zlib.compress, level=1)
    else:
        return payload
    headers.append((b"content-encoding", coding))
    if len(payload) >= THREAD_COMPRESS_BYTES:
        return await asyncio.to_thread(compress, payload)
    return compress(payload)
