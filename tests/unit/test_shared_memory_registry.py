"""The shared-memory registry's pure parts: region parameters as Triton checks them, keys that
are names not paths, and the registry's bookkeeping over a real /dev/shm object."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from quiver.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from quiver.shared_memory import SharedMemoryManager, placement
from quiver.types import Placement


def test_placement_parameters() -> None:
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 64, "other": 1}
    assert placement(params, "X", grpc=True) == Placement("r", 0, 64)
    assert params == {"other": 1}  # the transport's parameters are taken out
    assert placement({"binary_data": True}, "X", grpc=False) is None
    cases = [
        ({"shared_memory_offset": 4}, "'shared_memory_offset' can not be specified without 'shared_memory_region' parameter for tensor 'X'"),
        ({"shared_memory_region": "r"}, "'shared_memory_byte_size' must be specified along with 'shared_memory_region' parameter for tensor 'X'"),
        ({"shared_memory_region": 3, "shared_memory_byte_size": 4}, "invalid value type for 'shared_memory_region' parameter for tensor 'X', expected string_param."),
        ({"shared_memory_region": "r", "shared_memory_byte_size": "4"}, "invalid value type for 'shared_memory_byte_size' parameter for tensor 'X', expected int64_param."),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 4, "shared_memory_offset": -1}, "invalid value type for 'shared_memory_offset'"),
    ]
    for params, message in cases:
        with pytest.raises(InvalidArgumentError) as caught:
            placement(dict(params), "X", grpc=True)
        assert message in str(caught.value)
    with pytest.raises(InvalidArgumentError, match="Unable to parse 'shared_memory_byte_size' of tensor 'X'"):
        placement({"shared_memory_region": "r", "shared_memory_byte_size": True}, "X", grpc=False)


@pytest.fixture
def key() -> Iterator[str]:
    name = f"quiver_unit_{uuid.uuid4().hex[:12]}"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as handle:
        handle.write(bytes(range(64)))
    yield "/" + name
    os.unlink(path)


def test_register_use_and_unregister(key: str) -> None:
    manager = SharedMemoryManager(allow_client=True)
    manager.register_system("r", key, 16, 32)
    assert manager.system_status() == [{"name": "r", "key": key, "offset": 16, "byte_size": 32}]
    with pytest.raises(AlreadyExistsError, match="shared memory region 'r' already in manager"):
        manager.register_system("r", key, 0, 8)
    lease = manager.acquire(["r"])
    view = manager.view(lease.regions[0], 4, 8)
    assert bytes(view) == bytes(range(20, 28))  # region offset 16 + tensor offset 4
    del view
    manager.unregister_system("r")  # in use: stays until released
    assert [s["name"] for s in manager.system_status()] == ["r"]
    manager.release(lease)
    assert manager.system_status() == []
    with pytest.raises(NotFoundError, match="Unable to find shared memory region: 'r'"):
        manager.acquire(["r"])
    manager.close()


def test_keys_are_names_not_paths(key: str) -> None:
    manager = SharedMemoryManager(allow_client=True)
    for bad in ("/", "//", "/a/b", "/..", "x/../y"):
        with pytest.raises(InvalidArgumentError, match="invalid shm key"):
            manager.register_system("r", bad, 0, 8)
    manager.register_system("r", "///" + key.lstrip("/"), 0, 8)  # leading slashes, as shm_open
    with pytest.raises(InvalidArgumentError, match="invalid args"):
        manager.register_system("s", key, 60, 8)
    manager.close()


def test_shrunk_object_is_refused(key: str) -> None:
    manager = SharedMemoryManager(allow_client=True)
    manager.register_system("r", key, 0, 64)
    os.truncate("/dev/shm" + key, 16)
    with pytest.raises(InvalidArgumentError, match="no longer its registered size"):
        manager.acquire(["r"])
    manager.close()


def test_client_shared_memory_off() -> None:
    manager = SharedMemoryManager()
    assert manager.system_status() == [] and manager.cuda_status() == []
    for call in (
        lambda: manager.register_system("r", "/k", 0, 8),
        lambda: manager.unregister_system(),
        lambda: manager.register_cuda("r"),
    ):
        with pytest.raises(UnsupportedError, match="Client shared memory is disabled"):
            call()
