"""What the disk cache's entry check costs: stat every file vs hash every file.

Before the disk cache hands out an entry it compares the files with the entry's manifest
(``quiver.repository.cache``): on every fetch each file is ``lstat``-ed (size, inode,
mtime, ctime); a file is hashed (SHA-256) only when those differ, and every file is hashed
once per process, at the entry's first fetch after start-up. This measures, for an entry
of one big file and for one of many small files:

- ``record``: building the manifest (walk + hash every file), paid once per download;
- ``check (stat)``: the per-fetch check, files unchanged;
- ``check (hash, warm)``: the full check with the files in the page cache;
- ``check (hash, cold)``: the full check after the files were dropped from the page cache
  (``posix_fadvise(DONTNEED)`` on those files only), as at the first fetch after a restart;
- ``acquire (hit)``: a whole :meth:`DiskCache.acquire` of a cached key from a local folder
  store (revalidation, stat check, pin), median of many.

Run: ``python -m benchmarks.cache_check [--mb 100] [--small-files 1000] [--repeat 20]``.
Writes ``benchmarks/results/cache_check.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import command_line, environment
from quiver.repository.cache import DiskCache, check_tree, record_tree
from quiver.repository.storage import LocalStorage

HERE = Path(__file__).resolve().parent


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def drop_from_page_cache(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cold(folder: Path, records: dict[str, Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        drop_from_page_cache(folder)
        start = time.perf_counter()
        problem, _ = check_tree(folder, records, deep=True)
        times.append(time.perf_counter() - start)
        assert not problem, problem
    return statistics.median(times)


def make_model(root: Path, name: str, files: list[tuple[str, int]]) -> Path:
    folder = root / name
    for rel, size in files:
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            left = size
            while left:
                chunk = os.urandom(min(left, 1 << 22))
                f.write(chunk)
                left -= len(chunk)
    (folder / "config.pbtxt").write_text(f'name: "{name}"\n')
    return folder


async def measure(root: Path, name: str, repeat: int) -> dict[str, Any]:
    storage = LocalStorage(root / "store")
    cache = DiskCache(root / "cache", 64 << 30)
    lease = await cache.acquire(name, storage)
    content = lease.path
    lease.release()
    records = record_tree(content)
    files = sum(1 for r in records.values() if r.kind == "file")
    size = sum(r.size for r in records.values())

    def deep() -> None:
        problem, _ = check_tree(content, records, deep=True)
        assert not problem, problem

    def shallow() -> None:
        problem, _ = check_tree(content, records, deep=False)
        assert not problem, problem

    hits = []
    for _ in range(max(repeat, 50)):
        start = time.perf_counter()
        lease = await cache.acquire(name, storage)
        hits.append(time.perf_counter() - start)
        lease.release()
    result = {
        "entry": name,
        "files": files,
        "bytes": size,
        "record_s": timed(lambda: record_tree(content), max(3, repeat // 4)),
        "check_stat_s": timed(shallow, repeat * 10),
        "check_hash_warm_s": timed(deep, max(3, repeat // 4)),
        "check_hash_cold_s": cold(content, records, max(3, repeat // 4)),
        "acquire_hit_s": statistics.median(hits),
    }
    await cache.close()
    return result


def fmt_s(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mb", type=int, default=100, help="size of the one-file entry (default: 100)")
    parser.add_argument("--small-files", type=int, default=1000, help="files of 10 KiB in the other entry")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--output-dir", type=Path, default=HERE / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="quiver-cache-check-") as tmp:
        root = Path(tmp)
        store = root / "store"
        make_model(store, "big", [("1/model.onnx", args.mb << 20)])
        make_model(store, "many", [(f"1/part{i:05d}.bin", 10 << 10) for i in range(args.small_files)])
        results = [asyncio.run(measure(root, name, args.repeat)) for name in ("big", "many")]
    lines = [
        "# Disk cache entry check: stat vs hash",
        "",
        f"`{command_line()}`",
        "",
        "| entry | files | MB | record (hash all, once per download) | check: stat (every fetch) | "
        "check: hash, warm | check: hash, cold (first fetch after start) | acquire, hit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['entry']} | {r['files']} | {r['bytes'] / (1 << 20):.1f} | {fmt_s(r['record_s'])} | "
            f"{fmt_s(r['check_stat_s'])} | {fmt_s(r['check_hash_warm_s'])} | "
            f"{fmt_s(r['check_hash_cold_s'])} | {fmt_s(r['acquire_hit_s'])} |"
        )
    env = environment(["quiver"])
    lines += ["", f"{env['date']}, {env['nproc']} cores, {env['cpu_model']}, Python {env['python']}."]
    table = "\n".join(lines) + "\n"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "cache_check.md").write_text(table)
    (args.output_dir / "cache_check.json").write_text(
        json.dumps({"command": command_line(), "environment": env, "results": results}, indent=2)
    )
    print(table)


if __name__ == "__main__":
    main()
