"""Local model folders unchanged since their last walk (lifecycle/watch.py): a miss of such a
folder neither finds nor walks it again; any change to its files, its version folders or its
repository's entry for it makes the next miss walk it, so nothing stale is ever loaded."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from lifecycle_fakes import World, answer, install_fake_backend, serving

from quiver.errors import QuiverError
from quiver.lifecycle import admission as admission_module
from quiver.lifecycle.sources import fingerprint_and_size
from quiver.lifecycle.watch import FolderWatch, filesystem_of
from quiver.repository.local import LocalRepository, ModelSource

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/mountinfo"), reason="inotify: Linux")


def folder(repo: Path, name: str) -> ModelSource:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(f'name: "{name}"\n')
    (repo / name / "1" / "model.onnx").write_bytes(b"\0" * 100)
    found = LocalRepository([repo]).find(name)
    assert found is not None
    return found


def test_a_walk_is_kept_until_a_file_a_folder_or_the_repository_entry_changes(tmp_path: Path) -> None:
    watch = FolderWatch([tmp_path])
    assert watch.active, f"{filesystem_of(tmp_path)} should be watched"
    sources = {name: folder(tmp_path, name) for name in ("a", "b", "c", "d", "e", "f")}
    try:
        walked = {name: watch.walk(source, fingerprint_and_size) for name, source in sources.items()}
        watch.read_changes()
        for name, source in sources.items():
            assert watch.unchanged(name) == (source, *walked[name])
            assert walked[name] == fingerprint_and_size(source.path)
        (tmp_path / "a" / "1" / "model.onnx").write_bytes(b"\1" * 100)  # rewritten, same size
        (tmp_path / "b" / "config.pbtxt").write_text('name: "b"\nmax_batch_size: 4\n')
        (tmp_path / "c" / "2").mkdir()  # a new version folder
        os.utime(tmp_path / "d" / "1" / "model.onnx", ns=(1, 1))  # only its times
        (tmp_path / "e").rename(tmp_path / "e-old")  # the folder renamed away
        watch.read_changes()
        for name in ("a", "b", "c", "d", "e"):
            assert watch.unchanged(name) is None, name
        assert watch.unchanged("f") == (sources["f"], *walked["f"])  # untouched: still kept
        folder(tmp_path, "g")
        watch.read_changes()
        assert watch.unchanged("g") is None  # never walked
        again = watch.walk(sources["a"], fingerprint_and_size)
        watch.read_changes()
        assert again != walked["a"] and watch.unchanged("a") == (sources["a"], *again)
    finally:
        watch.close()
    assert watch.unchanged("a") is None and not watch.active


def test_a_folder_with_a_linked_file_is_walked_every_time(tmp_path: Path) -> None:
    outside = tmp_path / "outside.onnx"
    outside.write_bytes(b"\0" * 10)
    repo = tmp_path / "repo"
    source = folder(repo, "a")
    (repo / "a" / "1" / "model.onnx").unlink()
    (repo / "a" / "1" / "model.onnx").symlink_to(outside)  # its target can change unseen
    watch = FolderWatch([repo])
    try:
        assert watch.walk(source, fingerprint_and_size) == fingerprint_and_size(source.path)
        assert watch.unchanged("a") is None
    finally:
        watch.close()


def test_nothing_is_kept_for_a_repository_on_a_network_filesystem(tmp_path: Path) -> None:
    mounts = "36 1 0:40 / / rw - ext4 /dev/vda rw\n37 36 0:41 / /models rw - nfs4 server:/m rw\n"
    assert filesystem_of(Path("/models/x"), mounts) == "nfs4"
    assert filesystem_of(Path("/srv"), mounts) == "ext4"
    watch = FolderWatch([Path("/models")], mounts=mounts)
    assert not watch.active
    source = ModelSource("a", tmp_path, tmp_path / "a")
    folder(tmp_path, "a")
    assert watch.walk(source, fingerprint_and_size) == fingerprint_and_size(source.path)
    assert watch.unchanged("a") is None


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    return install_fake_backend(monkeypatch)


def test_a_miss_of_an_unchanged_folder_walks_nothing_and_a_changed_one_loads_as_it_is_now(
    tmp_path: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[str] = []
    real = admission_module.fingerprint_and_size

    def counting(path: Path, *args: Any) -> tuple[str, int]:
        walks.append(path.name)
        return real(path, *args)

    monkeypatch.setattr(admission_module, "fingerprint_and_size", counting)

    async def main() -> None:
        async with serving(tmp_path, world, 50_000, {"a": 4_000, "b": 4_000}) as (service, manager):
            assert await answer(service, "a", 2.0) == 2.0
            assert walks == ["a"]
            await manager.unload("a")
            assert await answer(service, "a", 3.0) == 3.0
            assert walks == ["a"]  # evicted and loaded again: neither found nor walked
            assert "v" not in manager.get("a").config.parameters
            await manager.unload("a")
            config = tmp_path / "a" / "config.pbtxt"
            config.write_text(config.read_text() + 'parameters { key: "v" value: { string_value: "2" } }\n')
            assert await answer(service, "a", 4.0) == 4.0  # changed just before: seen
            assert walks == ["a", "a"]  # changed: walked, and loaded with the new configuration
            assert manager.get("a").config.parameters["v"] == "2"
            assert await answer(service, "b") == 1.0
            await manager.unload("b")
            (tmp_path / "b").rename(tmp_path / "b-gone")
            with pytest.raises(QuiverError, match="'b'"):
                await answer(service, "b")  # its folder went: not loaded from what was kept

    asyncio.run(main())
