"""Triton's shared-memory extensions: the one registry of client shared-memory regions.

Both frontends (HTTP ``/v2/systemsharedmemory/...``, gRPC ``SystemSharedMemory*``) register,
unregister and list regions here, and the service reads inputs from and writes outputs into
them. A region is a POSIX shared-memory object the client created (``shm_open``: on Linux a
file in ``/dev/shm``), mapped once when it is registered.

Rules, as Triton's ``SharedMemoryManager``:

- registering and unregistering need ``--allow-client-shm`` (status is always allowed);
- the key is a name, not a path: leading slashes are dropped (as ``shm_open`` does); a key
  that is only slashes, holds another slash, or starts with the reserved Python-backend
  prefix is refused; the object is opened without following links and must be a regular file;
- ``offset + byte_size`` must lie inside the object;
- a region in use by a request when it is unregistered stays until the last such request
  is done (it is still listed meanwhile), then goes;
- CUDA regions: Quiver has no CUDA IPC, so it answers as a Triton built without GPU support:
  status lists none, register is refused, unregister finds nothing to do.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quiver import messages
from quiver.errors import (
    AlreadyExistsError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from quiver.protocol.bytes_codec import deserialize_bytes, serialize_bytes
from quiver.types import DataType, InferenceRequest, InferenceResponse, Placement, Tensor

#: Where Linux keeps POSIX shared-memory objects (``shm_open``'s folder).
SHM_FOLDER = "/dev/shm"
#: Keys Triton keeps for its Python backend's own regions.
RESERVED_PREFIX = "triton_python_backend_shm_region_"
#: The request parameters that put a tensor in a region.
REGION, OFFSET, BYTE_SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"


@dataclass(slots=True)
class Region:
    """One registered system shared-memory region and the mapping of its object."""

    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap
    fd: int  # kept open: each use checks the object still holds the region
    users: int = 0
    awaiting_unregister: bool = False

    def status(self) -> dict[str, int | str]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def intact(self) -> bool:
        """Whether the object still holds the region: a client that shrank it after
        registering would make a read or write past its end kill the server (SIGBUS)."""
        try:
            return os.fstat(self.fd).st_size >= self.offset + self.byte_size
        except OSError:
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1
        with contextlib.suppress(BufferError):  # a tensor still views it: unmapped with the last view
            self.mapping.close()


@dataclass(slots=True)
class Lease:
    """The regions one request uses; :meth:`SharedMemoryManager.release` gives them back."""

    regions: list[Region] = field(default_factory=list)


class SharedMemoryManager:
    """The registered regions (thread-safe: the gRPC and HTTP frontends share it)."""

    def __init__(self, allow_client: bool = False) -> None:
        self.allow_client = allow_client
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    # -- system shared memory -----------------------------------------------------------

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.check_allowed()
        if not name:
            raise InvalidArgumentError(
                "'region name' is necessary to register system shared memory region"
            )
        if offset < 0 or byte_size < 0:
            raise InvalidArgumentError(messages.shm_register_invalid(name))
        path = _object_path(name, key)
        with self._lock:
            if name in self._regions:
                raise AlreadyExistsError(messages.shm_already_registered(name))
        mapping, fd = _map(name, key, path, offset, byte_size)
        region = Region(name, key, offset, byte_size, mapping, fd)
        with self._lock:
            if name in self._regions:  # registered meanwhile by another client
                region.close()
                raise AlreadyExistsError(messages.shm_already_registered(name))
            self._regions[name] = region

    def unregister_system(self, name: str = "") -> None:
        """One region, or every region when ``name`` is empty; an unknown name is no error."""
        self.check_allowed()
        with self._lock:
            names = [name] if name else list(self._regions)
            for each in names:
                region = self._regions.get(each)
                if region is None:
                    continue
                if region.users:
                    region.awaiting_unregister = True
                    continue
                del self._regions[each]
                region.close()

    def system_status(self, name: str = "") -> list[dict[str, int | str]]:
        with self._lock:
            if not name:
                return [region.status() for region in self._regions.values()]
            region = self._regions.get(name)
            if region is None:
                raise NotFoundError(messages.shm_status_not_found("system", name))
            return [region.status()]

    # -- CUDA shared memory: a Triton without GPU support ---------------------------------

    def cuda_status(self, name: str = "") -> list[dict[str, int | str]]:
        if name:
            with self._lock:
                if name in self._regions:
                    raise InvalidArgumentError(messages.shm_wrong_kind(name, "system", "CUDA"))
            raise NotFoundError(messages.shm_status_not_found("cuda", name))
        return []

    def register_cuda(self, name: str) -> None:
        self.check_allowed()
        if not name:
            raise InvalidArgumentError(
                "'region name' is necessary to register cuda shared memory region"
            )
        raise InvalidArgumentError(messages.cuda_shm_unsupported(name))

    def unregister_cuda(self, name: str = "") -> None:
        self.check_allowed()  # no CUDA region can exist: nothing to unregister

    # -- tensors in regions ------------------------------------------------------------

    def acquire(self, names: Iterable[str]) -> Lease:
        """The regions a request refers to, held until :meth:`release` (NotFoundError for an
        unknown one, before any is held)."""
        with self._lock:
            regions = []
            for name in names:
                region = self._regions.get(name)
                if region is None:
                    raise NotFoundError(messages.shm_not_found(name))
                if not region.intact():
                    raise InvalidArgumentError(messages.shm_shrunk(name))
                regions.append(region)
            for region in regions:
                region.users += 1
        return Lease(regions)

    def release(self, lease: Lease) -> None:
        with self._lock:
            for region in lease.regions:
                region.users -= 1
                if not region.users and region.awaiting_unregister:
                    if self._regions.get(region.name) is region:
                        del self._regions[region.name]
                    region.close()
            lease.regions = []

    @staticmethod
    def view(region: Region, offset: int, byte_size: int) -> memoryview:
        """``byte_size`` bytes at ``offset`` into a held region, with Triton's checks."""
        if offset < 0 or offset >= region.byte_size:
            raise InvalidArgumentError(messages.shm_invalid_offset(region.name))
        if byte_size < 0 or offset + byte_size > region.byte_size:
            raise InvalidArgumentError(messages.shm_invalid_extent(region.name))
        start = region.offset + offset
        return memoryview(region.mapping)[start : start + byte_size]

    def close(self) -> None:
        """Unmap every region (the server is stopping)."""
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
        for region in regions:
            region.close()

    def check_allowed(self) -> None:
        if not self.allow_client:
            raise UnsupportedError(messages.CLIENT_SHM_DISABLED)


# -- request parameters --------------------------------------------------------------------


def placement(params: dict[str, Any], tensor: str, *, grpc: bool) -> Placement | None:
    """The region parameters of a tensor, checked as Triton checks them, and taken out of
    ``params`` (they are the transport's, not the model's); None when the tensor is not in
    shared memory."""
    region = params.get(REGION)
    offset = params.get(OFFSET)
    size = params.get(BYTE_SIZE)
    if region is None:
        for param, value in ((OFFSET, offset), (BYTE_SIZE, size)):
            if value is not None:
                raise InvalidArgumentError(messages.shm_param_without_region(param, tensor))
        return None
    if not isinstance(region, str):
        raise InvalidArgumentError(_type_error(REGION, tensor, "string_param", grpc))
    for param, value in ((OFFSET, offset), (BYTE_SIZE, size)):
        if value is not None and (type(value) is not int or value < 0):
            raise InvalidArgumentError(_type_error(param, tensor, "int64_param", grpc))
    if size is None:
        raise InvalidArgumentError(messages.shm_byte_size_missing(tensor))
    for key in (REGION, OFFSET, BYTE_SIZE):
        params.pop(key, None)
    return Placement(region, offset or 0, size)


def _type_error(param: str, tensor: str, expected: str, grpc: bool) -> str:
    if grpc:
        return messages.shm_param_type(param, tensor, expected)
    return f"Unable to parse '{param}' of tensor '{tensor}'"


# -- tensors in regions ------------------------------------------------------------------


def read_inputs(manager: SharedMemoryManager, request: InferenceRequest) -> Lease:
    """Hold every region the request names (inputs and outputs) and give each input in a
    region its data (a view of the region); the caller releases the lease."""
    inputs = request.input_placements or {}
    outputs = request.output_placements or {}
    lease = manager.acquire([p.region for p in inputs.values()] + [p.region for p in outputs.values()])
    try:
        regions = {region.name: region for region in lease.regions}
        for tensor in request.inputs:
            where = inputs.get(tensor.name)
            if where is not None:
                view = manager.view(regions[where.region], where.offset, where.byte_size)
                tensor.data = _input_data(tensor, view, request.model_name)
        for where in outputs.values():
            manager.view(regions[where.region], where.offset, where.byte_size)  # checks only
    except BaseException:
        manager.release(lease)
        raise
    return lease


def _input_data(tensor: Tensor, view: memoryview, model: str) -> np.ndarray[Any, Any]:
    count = int(np.prod(tensor.shape)) if tensor.shape else 1
    if tensor.datatype is DataType.BYTES:
        return deserialize_bytes(view, count, tensor.name).reshape(tensor.shape)
    expected = count * tensor.datatype.itemsize
    if len(view) != expected:
        raise InvalidArgumentError(
            messages.input_byte_size_mismatch(tensor.name, model, expected, len(view))
        )
    return np.frombuffer(view, dtype=tensor.datatype.numpy_dtype).reshape(tensor.shape)


def write_outputs(
    manager: SharedMemoryManager, lease: Lease, request: InferenceRequest, response: InferenceResponse
) -> None:
    """Write the outputs asked for in regions into them (the lease holds the regions)."""
    placed = request.output_placements
    if not placed:
        return
    regions = {region.name: region for region in lease.regions}
    written = set()
    for tensor in response.outputs:
        where = placed.get(tensor.name)
        if where is None:
            continue
        if tensor.datatype is DataType.BYTES:
            raw = np.frombuffer(serialize_bytes(tensor.data), dtype=np.uint8)
        else:
            raw = np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8)
        if raw.size > where.byte_size:
            raise InvalidArgumentError(
                messages.shm_output_too_small(tensor.name, where.byte_size, raw.size)
            )
        view = manager.view(regions[where.region], where.offset, where.byte_size)
        np.frombuffer(view, dtype=np.uint8, count=raw.size)[:] = raw
        written.add(tensor.name)
    response.shared_memory_outputs = frozenset(written)


def _object_path(name: str, key: str) -> str:
    """The file of ``key`` in SHM_FOLDER, built from a checked name (never a client's path)."""
    bare = key.lstrip("/")
    if not bare:
        raise InvalidArgumentError(messages.shm_invalid_key(name, key))
    if bare.startswith(RESERVED_PREFIX):
        raise InvalidArgumentError(messages.shm_reserved_key(name, key, RESERVED_PREFIX))
    if "/" in bare or bare in (".", "..") or "\x00" in bare:
        raise InvalidArgumentError(messages.shm_invalid_key(name, key))
    return os.path.join(SHM_FOLDER, bare)


def _map(name: str, key: str, path: str, offset: int, byte_size: int) -> tuple[mmap.mmap, int]:
    """The object's mapping and its descriptor (the caller owns both)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # Triton: INTERNAL; a key that names nothing is the client's mistake
        raise InvalidArgumentError(messages.shm_open_failed(key)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InternalError(messages.shm_invalid_object(key))
        if offset + byte_size > info.st_size:
            raise InvalidArgumentError(messages.shm_register_invalid(name))
        if info.st_size == 0:
            raise InvalidArgumentError(messages.shm_register_failed(name, "the object is empty"))
        try:
            mapping = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(messages.shm_register_failed(name, str(exc))) from None
    except BaseException:
        os.close(fd)
        raise
    return mapping, fd


__all__ = [
    "BYTE_SIZE",
    "OFFSET",
    "REGION",
    "Lease",
    "Region",
    "SharedMemoryManager",
    "placement",
    "read_inputs",
    "write_outputs",
]
