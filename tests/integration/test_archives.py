"""Archives in a local repository folder, served by key on demand through the disk cache:
HTTP and gRPC, namespacing (two archives with a composing model of the same name), hostile
archives (the CVE-2025-4517 symlink chain and a decompression bomb, by key, by SageMaker
TargetModel and by POST /models: nothing written outside the cache), a new upload under the
same key, a deleted archive, metrics."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from support.archives import (
    ADD,
    cache_extraction_path_len,
    configless_archive,
    cve_2025_4517_archive,
    listing,
    pipeline_archive,
    single_archive,
    tar_gz,
    traversal_archive,
    zeros_bomb_archive,
)
from support.models import add_constant_onnx, write_onnx
from support.server import QuiverServer


def x(value: float = 0.0, name: str = "INPUT0") -> list[httpclient.InferInput]:
    inp = httpclient.InferInput(name, [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return [inp]


def metrics(server: QuiverServer) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("archives")
    write_onnx(repo, "plain", add_constant_onnx(7.0), ADD.format(name="plain"))
    (repo / "single_v0.tar.gz").write_bytes(single_archive(3.0))
    (repo / "nested.tgz").write_bytes(single_archive(4.0, folder="resnet", name="resnet"))
    (repo / "pipe_a.tar.gz").write_bytes(pipeline_archive(1.0))
    (repo / "pipe_b.tar.gz").write_bytes(pipeline_archive(2.0))
    (repo / "evil.tar.gz").write_bytes(traversal_archive())
    (repo / "notgz.tar.gz").write_bytes(b"this is not a gzip file at all")
    (repo / "noconfig.tar.gz").write_bytes(configless_archive())
    (repo / "two_models.tar.gz").write_bytes(
        tar_gz({"a/config.pbtxt": ADD.format(name="a").encode(), "b/config.pbtxt": ADD.format(name="b").encode()})
    )
    return repo


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's cache folder, alone in a sentinel folder that holds a file ``flag``: the
    folder three levels above where the cache extracts (``<cache>/.tmp-*/content``)."""
    sentinel = tmp_path_factory.mktemp("archive_cache").resolve()
    (sentinel / "flag").write_bytes(b"original")
    return sentinel / "cache"


@pytest.fixture(scope="module")
def server(repo: Path, cache: Path) -> Iterator[QuiverServer]:
    args = ("--model-control-mode=on_demand", "--model-cache-dir", str(cache), "--model-cache-size", "64M")
    with QuiverServer(repo, args=args, env={"SAGEMAKER_MULTI_MODEL": "true"}) as server:
        yield server


def test_archives_served_by_key_over_http_and_grpc(server: QuiverServer) -> None:
    http = httpclient.InferenceServerClient(server.url)
    out = http.infer("single_v0.tar.gz", x(1.0)).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, np.full((1, 4), 4.0))
    assert http.get_model_metadata("single_v0.tar.gz")["name"] == "single_v0.tar.gz"
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), 2.0, np.float32))
    np.testing.assert_array_equal(grpc.infer("nested.tgz", [inp]).as_numpy("OUTPUT0"), np.full((1, 4), 6.0))
    np.testing.assert_array_equal(grpc.infer("single_v0.tar.gz", [inp]).as_numpy("OUTPUT0"), np.full((1, 4), 5.0))
    # Local model folders keep working as before.
    np.testing.assert_array_equal(http.infer("plain", x(1.0)).as_numpy("OUTPUT0"), np.full((1, 4), 8.0))


def test_each_archive_is_its_own_namespace(server: QuiverServer) -> None:
    """pipe_a and pipe_b both hold 'preprocess' (adding 1 and 2) and 'post': served side by
    side, each ensemble runs its own archive's models."""

    async def main() -> None:
        async with aiohttpclient.InferenceServerClient(server.url) as client:
            calls = []
            for i in range(12):
                inp = aiohttpclient.InferInput("IN", [1, 4], "FP32")
                inp.set_data_from_numpy(np.full((1, 4), float(i), np.float32))
                calls.append(client.infer("pipe_a.tar.gz" if i % 2 else "pipe_b.tar.gz", [inp]))
            results = await asyncio.gather(*calls)
            for i, result in enumerate(results):
                expected = i + (1.0 if i % 2 else 2.0) + 100.0
                np.testing.assert_array_equal(result.as_numpy("OUT"), np.full((1, 4), expected))

    asyncio.run(main())
    http = httpclient.InferenceServerClient(server.url)
    ready = {e["name"] for e in http.get_model_repository_index() if e.get("state") == "READY"}
    assert {"pipe_a.tar.gz", "pipe_a.tar.gz::preprocess", "pipe_b.tar.gz::preprocess"} <= ready
    steps = http.get_model_config("pipe_a.tar.gz")["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["pipe_a.tar.gz::preprocess", "pipe_a.tar.gz::post"]
    # Unloading the archive's model unloads its namespace; the other archive keeps serving.
    http.unload_model("pipe_a.tar.gz")
    ready = {e["name"] for e in http.get_model_repository_index() if e.get("state") == "READY"}
    assert not any(n.startswith("pipe_a.tar.gz") for n in ready)
    assert "pipe_b.tar.gz::preprocess" in ready
    inp = httpclient.InferInput("IN", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    np.testing.assert_array_equal(http.infer("pipe_a.tar.gz", [inp]).as_numpy("OUT"), np.full((1, 4), 101.0))


@pytest.mark.parametrize(
    ("name", "texts"),
    [
        ("evil.tar.gz", ["archive 'evil.tar.gz'", "'../escape.txt'"]),
        ("notgz.tar.gz", ["archive 'notgz.tar.gz'", "not a valid tar.gz"]),
        ("noconfig.tar.gz", ["archive 'noconfig.tar.gz'", "config.pbtxt"]),
        ("two_models.tar.gz", ["archive 'two_models.tar.gz'", "cannot tell which"]),
        ("bad$name.tar.gz", ["'bad$name.tar.gz' is not a valid model name"]),
    ],
)
def test_hostile_archives_and_names_are_invalid_arguments(server: QuiverServer, name: str, texts: list[str]) -> None:
    http = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as info:
        http.infer(name, x())
    assert info.value.status() == "400", info.value.message()
    for text in texts:
        assert text in info.value.message()
    assert http.infer("single_v0.tar.gz", x()).as_numpy("OUTPUT0") is not None  # still serving


def test_new_upload_is_served_after_unload_and_deleted_stops(server: QuiverServer, repo: Path) -> None:
    http = httpclient.InferenceServerClient(server.url)
    (repo / "swap.tar.gz").write_bytes(single_archive(10.0))
    assert http.infer("swap.tar.gz", x()).as_numpy("OUTPUT0").tolist() == [[10.0] * 4]
    (repo / "swap.tar.gz").write_bytes(single_archive(20.0))
    assert http.infer("swap.tar.gz", x()).as_numpy("OUTPUT0").tolist() == [[10.0] * 4]  # still loaded
    http.unload_model("swap.tar.gz")
    assert http.infer("swap.tar.gz", x()).as_numpy("OUTPUT0").tolist() == [[20.0] * 4]
    (repo / "swap.tar.gz").unlink()
    assert http.infer("swap.tar.gz", x()).as_numpy("OUTPUT0").tolist() == [[20.0] * 4]  # loaded: serves
    http.unload_model("swap.tar.gz")
    with pytest.raises(InferenceServerException) as info:
        http.infer("swap.tar.gz", x())
    assert info.value.status() == "404"


def test_download_metrics(server: QuiverServer) -> None:
    http = httpclient.InferenceServerClient(server.url)
    http.infer("single_v0.tar.gz", x())
    values = metrics(server)
    assert values["quiver_model_downloading_time_us_count"] >= 2
    assert values["quiver_disk_cache_miss_total"] >= 2
    assert "quiver_disk_cache_hit_total" in values
    assert 0 < values["quiver_disk_cache_used_bytes"] <= values["quiver_disk_cache_size_bytes"]


def test_repository_index_lists_archives_never_loaded(server: QuiverServer, repo: Path) -> None:
    """Archives next to the model folders are in the index before any request, with only a
    name (as never-loaded folders are); other files and hidden archives are not."""
    (repo / "listed_only.tar.gz").write_bytes(single_archive(5.0))
    (repo / ".hidden.tar.gz").write_bytes(single_archive(5.0))
    (repo / "notes.txt").write_text("not a model")
    for client in (
        httpclient.InferenceServerClient(server.url),
        grpcclient.InferenceServerClient(server.grpc_url),
    ):
        index = client.get_model_repository_index()
        entries = index if isinstance(index, list) else [
            {k: v for k, v in (("name", m.name), ("version", m.version), ("state", m.state)) if v}
            for m in index.models
        ]
        by_name = {e["name"]: e for e in entries}
        assert by_name["listed_only.tar.gz"] == {"name": "listed_only.tar.gz"}
        assert {"nested.tgz", "pipe_b.tar.gz", "evil.tar.gz"} <= set(by_name)
        assert ".hidden.tar.gz" not in by_name and "notes.txt" not in by_name
    http = httpclient.InferenceServerClient(server.url)
    http.infer("listed_only.tar.gz", x())
    entry = next(e for e in http.get_model_repository_index() if e["name"] == "listed_only.tar.gz")
    assert entry["state"] == "READY"
    # Deleted and unloaded: gone from the index too (its namespace is forgotten).
    (repo / "listed_only.tar.gz").unlink()
    http.unload_model("listed_only.tar.gz")
    entries = [e for e in http.get_model_repository_index() if e["name"] == "listed_only.tar.gz"]
    assert all(e.get("state") != "READY" for e in entries)


def test_repository_api_loads_archive_keys(server: QuiverServer, repo: Path) -> None:
    """POST /v2/repository/models/<key>/load and gRPC RepositoryModelLoad load an archive key
    as an on-demand request would; loading a loaded key again fetches it again (a new upload
    is served); config overrides, unknown keys and bad archives are refused."""
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    (repo / "api_a.tar.gz").write_bytes(single_archive(30.0))
    (repo / "api_b.tgz").write_bytes(pipeline_archive(3.0))
    http.load_model("api_a.tar.gz")
    assert http.is_model_ready("api_a.tar.gz")
    grpc.load_model("api_b.tgz")
    assert grpc.is_model_ready("api_b.tgz") and http.is_model_ready("api_b.tgz::preprocess")
    assert http.infer("api_a.tar.gz", x(1.0)).as_numpy("OUTPUT0").tolist() == [[31.0] * 4]
    inp = httpclient.InferInput("IN", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    assert http.infer("api_b.tgz", [inp]).as_numpy("OUT").tolist() == [[103.0] * 4]
    # A new upload, then load again: the new archive serves.
    (repo / "api_a.tar.gz").write_bytes(single_archive(40.0))
    http.load_model("api_a.tar.gz")
    assert http.infer("api_a.tar.gz", x(1.0)).as_numpy("OUTPUT0").tolist() == [[41.0] * 4]
    http.unload_model("api_a.tar.gz")
    grpc.unload_model("api_b.tgz")
    assert not http.is_model_ready("api_a.tar.gz") and not http.is_model_ready("api_b.tgz::preprocess")

    with pytest.raises(InferenceServerException) as info:
        http.load_model("api_a.tar.gz", config='{"backend": "onnxruntime"}')
    assert info.value.status() == "400" and "not supported for archive" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        http.load_model("missing.tar.gz")
    assert info.value.status() == "404", info.value.message()
    with pytest.raises(InferenceServerException) as info:
        grpc.load_model("evil.tar.gz")
    assert "'../escape.txt'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        http.load_model("pipe_a.tar.gz::preprocess")
    assert info.value.status() == "404", info.value.message()
    # Folders load through the API as before.
    http.load_model("plain")
    assert http.is_model_ready("plain")


def test_hundreds_of_archives_hammered_under_a_budget(tmp_path: Path) -> None:
    """200 small archives, memory for about 12 (each counts at least its files plus the
    2 MiB per-model overhead), a skewed concurrent mix: every answer right, the budget never
    exceeded, every load one miss."""
    import random
    import re

    repo = tmp_path / "archives"
    repo.mkdir()
    for i in range(200):
        (repo / f"a{i:03d}.tar.gz").write_bytes(single_archive(float(i)))
    limit = 12 * (2 << 20) + (16 << 20)  # plus the first session's one-time cost
    args = ("--model-control-mode=on_demand", "--model-memory-limit", str(limit))
    with QuiverServer(repo, args=args) as server:
        rng = random.Random(3)
        weights = [1 / (rank + 1) for rank in range(200)]
        trace = rng.choices(range(200), weights, k=400)
        used: list[float] = []

        def memory_used() -> float:
            with urllib.request.urlopen(server.metrics_url) as response:
                text = response.read().decode()
            return next(
                s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "quiver_model_memory_used_bytes"
            )

        async def main() -> None:
            async with aiohttpclient.InferenceServerClient(server.url, conn_limit=16) as client:
                for start in range(0, len(trace), 8):
                    chunk = trace[start : start + 8]

                    async def one(i: int) -> None:
                        inp = aiohttpclient.InferInput("INPUT0", [1, 4], "FP32")
                        inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
                        result = await client.infer(f"a{i:03d}.tar.gz", [inp])
                        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), float(i)))

                    await asyncio.gather(*(one(i) for i in chunk))
                    used.append(memory_used())

        asyncio.run(main())
        assert max(used) <= limit
        with urllib.request.urlopen(server.metrics_url) as response:
            text = response.read().decode()
        misses = int(re.search(r"^quiver_model_cache_miss_total (\S+)$", text, re.M).group(1).split(".")[0])  # type: ignore[union-attr]
        loads = len(re.findall(r"loaded model 'a\d{3}\.tar\.gz' version", server.log))
        evictions = len(re.findall(r"evicted to make room", server.log))
        assert evictions > 0
        assert loads <= misses  # concurrent first requests share one load
        assert loads >= len(set(trace))  # every distinct archive loaded at least once


def post(base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else None
    finally:
        conn.close()


ONES = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}]}


@pytest.mark.parametrize("kind", ["cve", "bomb"])
@pytest.mark.parametrize("route", ["v2", "target_model", "post_models"])
def test_escaping_and_bomb_archives_are_refused_and_write_nothing_outside(
    server: QuiverServer, repo: Path, cache: Path, tmp_path: Path, kind: str, route: str
) -> None:
    """The CVE-2025-4517 chain, aimed at the folder holding the cache, and a bomb of ~1000x
    (past the 64M cache): by key over v2, by SageMaker TargetModel, and by POST /models with
    a local archive. Each is a 400 naming the archive and the member; nothing outside the
    cache changes; the next correct request is answered."""
    sentinel = cache.parent
    name = f"{kind}_{route}.tar.gz"
    if kind == "cve":
        data = cve_2025_4517_archive(cache_extraction_path_len(cache))
        texts = [f"archive '{name}'", "member 'a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p/lll", "passes through the symlink 'a'"]
    else:
        data = zeros_bomb_archive()
        assert len(data) < 1 << 20
        texts = [f"archive '{name}' expands past the cap of {64 << 20} bytes", "member 'bomb/1/weights"]
    folder = repo if route != "post_models" else tmp_path
    (folder / name).write_bytes(data)
    before = listing(sentinel, skip=cache)
    if route == "v2":
        client = httpclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as info:
            client.infer(name, x())
        status, message = int(info.value.status() or 0), info.value.message()
    elif route == "target_model":
        status, body = post(server.sagemaker_url, "/invocations", ONES, {"X-Amzn-SageMaker-Target-Model": name})
        message = body["error"]
    else:
        status, body = post(server.sagemaker_url, "/models", {"model_name": f"hash-{kind}", "url": str(folder / name)})
        message = body["error"]
    assert listing(sentinel, skip=cache) == before and sorted(before) == ["flag"], message
    assert (sentinel / "flag").read_bytes() == b"original"
    assert status == 400, message
    for text in texts:
        assert text in message, message
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]  # the work folder is gone
    # The next correct request is answered correctly, by every route.
    assert httpclient.InferenceServerClient(server.url).infer("single_v0.tar.gz", x(1.0)).as_numpy("OUTPUT0").tolist() == [[4.0] * 4]
    status, body = post(server.sagemaker_url, "/invocations", ONES, {"X-Amzn-SageMaker-Target-Model": "nested.tgz"})
    assert status == 200 and body["outputs"][0]["data"] == [5.0] * 4, body


def test_archive_max_bytes_flag_reaches_extraction(tmp_path: Path) -> None:
    """--model-archive-max-bytes below the cache size is the cap extraction enforces."""
    (tmp_path / "small.tar.gz").write_bytes(single_archive(3.0))
    (tmp_path / "heavy.tar.gz").write_bytes(single_archive(3.0, weight_mb=2))
    args = ("--model-control-mode=on_demand", "--model-cache-dir", str(tmp_path / "cache"), "--model-archive-max-bytes", "1M")
    with QuiverServer(tmp_path, args=args) as server:
        client = httpclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as info:
            client.infer("heavy.tar.gz", x())
        assert info.value.status() == "400", info.value.message()
        assert "archive 'heavy.tar.gz' expands past the cap of 1048576 bytes (member '1/model.onnx'" in info.value.message()
        assert client.infer("small.tar.gz", x(1.0)).as_numpy("OUTPUT0").tolist() == [[4.0] * 4]
