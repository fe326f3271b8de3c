"""Model sources: folders and keys in the local repositories, URLs, fingerprints, and files
carried in a load request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from quiver.errors import InvalidArgumentError, NotFoundError
from quiver.lifecycle.memory import file_bytes
from quiver.lifecycle.pool import LoadPool
from quiver.lifecycle.sources import ModelSources, fingerprint, fingerprint_and_size
from quiver.metrics.statistics import MultiModelStatistics
from quiver.repository.storage import LocalStorage

T = TypeVar("T")


def run(sources_of: Callable[[ModelSources], Coroutine[Any, Any, T]], repo: Path) -> T:
    pool = LoadPool(2)
    sources = ModelSources([repo], pool=pool, stats=MultiModelStatistics())

    async def main() -> T:
        try:
            return await sources_of(sources)
        finally:
            await sources.close()

    try:
        return asyncio.run(main())
    finally:
        pool.shutdown()


def test_folders_keys_and_fingerprints(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text('backend: "identity"')
    (tmp_path / "resnet.tar.gz").write_bytes(b"not really")
    (tmp_path / ".hidden.tar.gz").write_bytes(b"")

    async def check(sources: ModelSources) -> None:
        found = await sources.lookup("m")
        assert found is not None and found.path == tmp_path / "m"
        assert await sources.lookup("nothing") is None
        assert not await sources.is_key("m") and await sources.is_key("resnet.tar.gz")
        assert await sources.stored_keys() == {"resnet.tar.gz"}
        stores = sources.key_stores("resnet.tar.gz")
        assert [type(s) for s in stores] == [LocalStorage]
        with pytest.raises(NotFoundError, match="no such model"):
            sources.key_stores("folder_key")  # a folder key is looked up in S3 only
        with pytest.raises(NotFoundError, match="served only while the archive's own model is loaded"):
            sources.key_stores("resnet.tar.gz::pre")
        with pytest.raises(InvalidArgumentError):
            sources.key_stores("bad name!")
        assert await sources.changed(found)  # never loaded
        await sources.fingerprint(found)
        assert not await sources.changed(found) and sources.fingerprinted == ["m"]
        weights = tmp_path / "m" / "1" / "model.bin"
        weights.write_bytes(b"x")
        assert await sources.changed(found)
        sources.forget_fingerprint("m")
        assert sources.fingerprint_of("m") == ""

    run(check, tmp_path)


def test_one_walk_gives_the_fingerprint_and_the_bytes_of_the_files(tmp_path: Path) -> None:
    """The fingerprint and the file bytes a prediction uses come from one walk: the bytes are
    :func:`file_bytes`'s (links not counted); the fingerprint moves when a file is added,
    removed, resized or rewritten, also inside a version folder and through a linked file,
    and not for a linked folder's content (not entered) nor a dangling link."""
    model = tmp_path / "m"
    (model / "1" / "sub").mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "identity"')
    (model / "1" / "model.bin").write_bytes(b"w" * 1000)
    (model / "1" / "sub" / "part").write_bytes(b"p" * 24)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"o" * 5000)
    (model / "2").symlink_to(outside, target_is_directory=True)
    (model / "1" / "linked").symlink_to(outside / "big")
    (model / "dangling").symlink_to(tmp_path / "nothing")

    first, size = fingerprint_and_size(model)
    assert first == fingerprint(model)
    assert size == file_bytes(model) == len('backend: "identity"') + 1000 + 24
    (outside / "other").write_bytes(b"x")  # inside the linked folder: not entered
    assert fingerprint(model) == first
    (outside / "big").write_bytes(b"o" * 5001)  # the linked file changed
    changed = fingerprint(model)
    assert changed != first
    (model / "1" / "sub" / "part").write_bytes(b"q" * 25)
    assert fingerprint(model) != changed
    assert fingerprint_and_size(model)[1] == file_bytes(model) == len('backend: "identity"') + 1000 + 25
    (model / "1" / "sub" / "part").unlink()
    assert fingerprint_and_size(model)[1] == len('backend: "identity"') + 1000
    assert fingerprint_and_size(tmp_path / "missing") == (fingerprint(tmp_path / "missing"), 0)


def test_urls(tmp_path: Path) -> None:
    (tmp_path / "folder" / "m").mkdir(parents=True)
    (tmp_path / "a.tar.gz").write_bytes(b"")
    (tmp_path / "plain.txt").write_text("")

    async def check(sources: ModelSources) -> None:
        store, key = await sources.store_for_url(f"file://{tmp_path / 'a.tar.gz'}")
        assert isinstance(store, LocalStorage) and store.root == tmp_path and key == "a.tar.gz"
        again, _ = await sources.store_for_url(str(tmp_path / "folder"))
        assert again is store  # one store per folder
        with pytest.raises(NotFoundError):
            await sources.store_for_url(str(tmp_path / "missing"))
        with pytest.raises(InvalidArgumentError, match="neither a folder nor"):
            await sources.store_for_url(str(tmp_path / "plain.txt"))
        with pytest.raises(InvalidArgumentError, match="/dev"):
            await sources.store_for_url("/dev/null")
        with pytest.raises(InvalidArgumentError, match="names a bucket"):
            await sources.store_for_url("s3://bucket")

    run(check, tmp_path)


def test_request_files_are_kept_while_they_serve(tmp_path: Path) -> None:
    async def check(sources: ModelSources) -> None:
        first = await sources.write_override("m", {"1/model.onnx": b"one"})
        assert (first.path / "1" / "model.onnx").read_bytes() == b"one"
        assert (first.path / "config.pbtxt").read_text() == ""  # the config comes from the request
        await sources.settle_override("m", first.repository, loaded=True)
        assert sources.overridden("m") and not await sources.is_key("m")
        second = await sources.write_override("m", {"2/model.onnx": b"two"})
        await sources.settle_override("m", second.repository, loaded=False)  # failed: its files go
        assert not second.repository.exists() and first.repository.exists()
        third = await sources.write_override("m", {"3/model.onnx": b"three"})
        await sources.settle_override("m", third.repository, loaded=True)  # replaced: the old go
        assert not first.repository.exists() and third.repository.exists()
        with pytest.raises(InvalidArgumentError):
            await sources.write_override("m", {"../escape": b""})
        await sources.drop_override("m")
        assert not third.repository.exists() and not sources.overridden("m")

    run(check, tmp_path)
