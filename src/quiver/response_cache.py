"""Triton's response cache (``docs/user_guide/response_cache.md``): the server-wide ``local``
cache (``--cache-config local,size=N``, or the older ``--response-cache-byte-size N``), used by
the models whose config says ``response_cache { enable: true }``.

A request whose key is in the cache is answered from it without running the model; on a miss
the model runs and a successful answer is kept. The key is a 128-bit BLAKE2b digest of the
model name and version (and when that version was loaded: answers do not outlive a reload),
every input (name, datatype, shape and bytes, in name order), the
outputs asked for, and the request parameters that can change an answer (not ``priority``,
``timeout`` or the transport's ``binary_data*``). Triton's key is a subset of this one (name,
version, input names and bytes): Quiver's never gives one request another's answer where
Triton's would, e.g. for the same bytes in another shape. Entries are kept under the byte
size, least recently used first out; an answer larger than the whole cache is not kept
(Triton's "Failed to insert key ... into response cache", logged once per model here).

Statistics as Triton's: a hit counts a success and ``cache_hit`` (not ``inference_count``
or an execution), a miss counts ``cache_miss`` with the time spent looking up and inserting.
Ensembles are cached at the top level (the whole ensemble's answer) when their own config
enables it; composing models by their own configs. Decoupled and sequence models cannot
enable it (refused at load, as Triton does).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from quiver.metrics.statistics import ModelStatistics
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

logger = logging.getLogger(__name__)

#: Request parameters that do not change an answer, left out of the key.
UNKEYED_PARAMETERS = frozenset(
    ("priority", "timeout", "binary_data_output", "binary_data", "binary_data_size", "headers")
)
#: Inputs larger than this are hashed on a worker thread, off the event loop.
HASH_INLINE_BYTES = 1 << 20
#: What an entry costs beyond its tensors' bytes (names, shapes, bookkeeping).
ENTRY_OVERHEAD = 256
TENSOR_OVERHEAD = 64


class CacheConfigError(ValueError):
    """A cache flag that makes no sense; the message names it as Triton's parser does."""


def parse_cache_config(values: Sequence[str], byte_size: str | None = None) -> int:
    """The local cache's size in bytes from ``--cache-config`` and ``--response-cache-byte-size``
    (0: no response cache), with Triton's errors."""
    if byte_size is not None and values:
        raise CacheConfigError(
            "Incompatible flags --response-cache-byte-size and --cache-config both provided. "
            "Please provide one or the other."
        )
    if byte_size is not None:
        try:
            size = int(byte_size)
        except ValueError:
            raise CacheConfigError(f"--response-cache-byte-size must be a number of bytes, got '{byte_size}'") from None
        if size < 0:
            raise CacheConfigError(f"--response-cache-byte-size must not be negative, got {size}")
        return size
    caches: dict[str, dict[str, str]] = {}
    for arg in values:
        name, comma, rest = arg.partition(",")
        if not comma or not name:
            raise CacheConfigError(
                f"No cache specified. --cache-config option format is <cache name>,<setting>=<value>. Got {arg}"
            )
        setting, equals, value = rest.partition("=")
        if not equals or not setting or not value:
            raise CacheConfigError(
                f"--cache-config option format is '<cache name>,<setting>=<value>'. Got {arg}"
            )
        caches.setdefault(name, {})[setting] = value
    if not caches:
        return 0
    if len(caches) > 1:
        raise CacheConfigError(
            f"multiple cache configurations are not supported: {', '.join(sorted(caches))}; "
            "give settings for one cache"
        )
    name, settings = next(iter(caches.items()))
    if name != "local":
        raise CacheConfigError(
            f"--cache-config: cache '{name}' is not available; Quiver has the 'local' cache "
            "(--cache-config local,size=BYTES)"
        )
    unknown = sorted(set(settings) - {"size"})
    if unknown:
        raise CacheConfigError(f"--cache-config local: unknown setting(s) {', '.join(unknown)}; it takes 'size'")
    if "size" not in settings:
        raise CacheConfigError("--cache-config local needs size=BYTES")
    try:
        size = int(settings["size"])
    except ValueError:
        raise CacheConfigError(f"--cache-config local,size must be a number of bytes, got '{settings['size']}'") from None
    if size < 0:
        raise CacheConfigError(f"--cache-config local,size must not be negative, got {size}")
    return size


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--cache-config", action="append", default=[], metavar="CACHE,SETTING=VALUE",
        help="the response cache, as tritonserver's: 'local,size=BYTES' keeps answers of the "
        "models whose config enables response_cache, least recently used out first",
    )  # fmt: skip
    group.add_argument(
        "--response-cache-byte-size", default=None, metavar="BYTES",
        help="deprecated: --cache-config local,size=BYTES",
    )  # fmt: skip
    group.add_argument(
        "--cache-directory", default=None, metavar="DIR",
        help="accepted for tritonserver's launch scripts; Quiver's 'local' cache is built in",
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Entry:
    outputs: tuple[Tensor, ...]
    parameters: dict[str, Any]
    size: int


def _tensor_bytes(tensor: Tensor) -> int:
    data = tensor.data
    if tensor.datatype is DataType.BYTES:
        return sum(4 + (len(v) if isinstance(v, bytes | str) else 8) for v in np.asarray(data, dtype=object).reshape(-1))
    return int(np.asarray(data).nbytes)


def request_key(model: str, version: str, request: InferenceRequest, generation: float = 0.0) -> bytes:
    """The cache key of ``request`` to ``model`` ``version`` (see the module docstring);
    ``generation`` tells one load of the version from the next."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(orjson.dumps([model, version, generation]))
    for tensor in sorted(request.inputs, key=lambda t: t.name):
        digest.update(orjson.dumps([tensor.name, tensor.datatype.value, list(tensor.shape)]))
        if tensor.datatype is DataType.BYTES:
            for item in np.asarray(tensor.data, dtype=object).reshape(-1):
                raw = item if isinstance(item, bytes) else str(item).encode()
                digest.update(len(raw).to_bytes(8, "little"))
                digest.update(raw)
        else:
            digest.update(np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8).data)
    outputs = None if request.outputs is None else sorted(o.name for o in request.outputs)
    params = {k: v for k, v in request.parameters.items() if k not in UNKEYED_PARAMETERS}
    try:
        tail = orjson.dumps([outputs, params], option=orjson.OPT_SORT_KEYS)
    except TypeError:
        tail = repr((outputs, sorted(params.items()))).encode()
    digest.update(tail)
    return digest.digest()


def _frozen(tensor: Tensor) -> Tensor:
    data = np.array(tensor.data, copy=True)
    data.setflags(write=False)
    return Tensor(tensor.name, tensor.datatype, tensor.shape, data, dict(tensor.parameters))


class ResponseCache:
    """The ``local`` cache: answers by key under ``size`` bytes, least recently used out."""

    def __init__(self, size: int, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.size = size
        self.used = 0
        self.evictions = 0
        self.lookups = 0
        self.hits = 0
        self._clock = clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._too_large: set[str] = set()  # models told about once

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: bytes) -> _Entry | None:
        self.lookups += 1
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return entry

    def insert(self, key: bytes, response: InferenceResponse, model: str) -> bool | None:
        """Keep ``response`` under ``key`` (evicting the least recently used as needed);
        False when it is larger than the whole cache, None when the key is there already (an
        identical request answered meanwhile)."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return None
        size = ENTRY_OVERHEAD + sum(TENSOR_OVERHEAD + _tensor_bytes(t) for t in response.outputs)
        if size > self.size:
            if model not in self._too_large:
                self._too_large.add(model)
                logger.warning(
                    "Failed to insert a response of model '%s' into the response cache: it takes %d "
                    "bytes and the cache holds %d (--cache-config local,size); answers this large "
                    "are not cached",
                    model, size, self.size,
                )  # fmt: skip
            return False
        while self.used + size > self.size:
            _, evicted = self._entries.popitem(last=False)
            self.used -= evicted.size
            self.evictions += 1
        self._entries[key] = _Entry(tuple(_frozen(t) for t in response.outputs), dict(response.parameters), size)
        self.used += size
        return True

    async def infer(
        self,
        model: str,
        version: str,
        request: InferenceRequest,
        stats: ModelStatistics,
        rows: int,
        run: Callable[[InferenceRequest], Awaitable[InferenceResponse]],
        generation: float = 0.0,
    ) -> InferenceResponse:
        """Answer ``request`` from the cache, or with ``run(request)`` and keep the answer;
        ``generation``: when this load of the model was installed (a model loaded again, with
        other files perhaps, does not get the answers of the one before)."""
        clock = self._clock
        started = clock()
        if sum(int(np.asarray(t.data).nbytes) for t in request.inputs) < HASH_INLINE_BYTES:
            key = request_key(model, version, request, generation)
        else:
            key = await asyncio.to_thread(request_key, model, version, request, generation)
        entry = self.lookup(key)
        looked_up = clock()
        if entry is not None:
            stats.record_cache_hit(looked_up - started, rows)
            return InferenceResponse(model, version, list(entry.outputs), request.id, dict(entry.parameters))
        response = await run(request)
        inserting = clock()
        if self.insert(key, response, model) is not None:  # Triton counts no miss for a key already there
            stats.record_cache_miss(looked_up - started + clock() - inserting)
        return response
