"""Models in S3 (a real SeaweedFS server on 127.0.0.1), served on demand through the disk
cache: single flight, a memory budget over ~30 archives under a skewed concurrent mix, S3
down and back, a new upload under the same key, SageMaker's POST /models with s3:// and
local archive URLs, and hostile archives from S3 (the CVE-2025-4517 chain, a bomb past the
expansion ratio, too many members) writing nothing outside the cache."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from support.archives import (
    ADD,
    cache_extraction_path_len,
    cve_2025_4517_archive,
    listing,
    onnx_bytes,
    pipeline_archive,
    single_archive,
    tar_gz,
    zeros_bomb_archive,
)
from support.models import add_constant_onnx
from support.s3 import SeaweedS3
from support.server import QuiverServer

BUCKET = "models"
N_ARCHIVES = 30
WEIGHT_MB = 8
MB = 1 << 20
TARGET = "X-Amzn-SageMaker-Target-Model"


def x(value: float = 0.0) -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return [inp]


def ax(value: float = 0.0) -> list[aiohttpclient.InferInput]:
    inp = aiohttpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return [inp]


def metrics(server: QuiverServer) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def ready(client: httpclient.InferenceServerClient) -> list[str]:
    return [e["name"] for e in client.get_model_repository_index() if e.get("state") == "READY"]


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


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with SeaweedS3(tmp_path_factory.mktemp("s3_models")) as server:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        put = client.put_object
        put(Bucket=BUCKET, Key="repo/one.tar.gz", Body=single_archive(1.0))
        put(Bucket=BUCKET, Key="repo/pipe.tar.gz", Body=pipeline_archive(5.0))
        put(Bucket=BUCKET, Key="repo/folder_model/config.pbtxt", Body=ADD.format(name="folder_model").encode())
        put(Bucket=BUCKET, Key="repo/folder_model/1/model.onnx", Body=onnx_bytes(add_constant_onnx(9.0)))
        for i in range(N_ARCHIVES):
            body = single_archive(float(i), folder=f"z{i}", name=f"z{i}", weight_mb=WEIGHT_MB)
            put(Bucket=BUCKET, Key=f"repo/z{i:02d}.tar.gz", Body=body)
        put(Bucket=BUCKET, Key="elsewhere/sm_model.tar.gz", Body=single_archive(40.0))
        yield server


@pytest.fixture(scope="module")
def local_archives(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sm_local")
    (folder / "local_model.tar.gz").write_bytes(pipeline_archive(50.0))
    return folder


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's cache folder, alone in a sentinel folder holding a file ``flag``."""
    sentinel = tmp_path_factory.mktemp("s3_cache").resolve()
    (sentinel / "flag").write_bytes(b"original")
    return sentinel / "cache"


@pytest.fixture(scope="module")
def server(s3: SeaweedS3, cache: Path) -> Iterator[QuiverServer]:
    args = (
        "--model-repository", f"s3://{BUCKET}/repo",
        "--model-control-mode=on_demand",
        "--model-memory-limit", f"{3 * WEIGHT_MB + 20}M",
        "--model-cache-dir", str(cache),
        "--model-cache-size", f"{10 * WEIGHT_MB}M",
        "--s3-timeout", "0.5", "--s3-retries", "2",
        "--model-load-wait-timeout", "30",
        "--model-archive-max-files", "1000",
    )  # fmt: skip
    env = {
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": s3.endpoint,
        "SAGEMAKER_MULTI_MODEL": "true",
    }
    with QuiverServer(args=args, env=env) as server:
        yield server


def test_single_flight_one_download(server: QuiverServer) -> None:
    async def main() -> None:
        async with aiohttpclient.InferenceServerClient(server.url) as client:
            results = await asyncio.gather(*(client.infer("one.tar.gz", ax(float(i))) for i in range(10)))
            for i, result in enumerate(results):
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), i + 1.0))

    asyncio.run(main())
    assert server.log.count("model cache: fetched 'one.tar.gz'") == 1
    assert server.wait_for_log("loaded model 'one.tar.gz' version")  # logged after the answers
    assert server.log.count("loaded model 'one.tar.gz' version") == 1
    # A folder of objects in S3 is a model too; an S3 ensemble archive is its own namespace.
    client = httpclient.InferenceServerClient(server.url)
    assert client.infer("folder_model", x(1.0)).as_numpy("OUTPUT0").tolist() == [[10.0] * 4]
    inp = httpclient.InferInput("IN", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    assert client.infer("pipe.tar.gz", [inp]).as_numpy("OUT").tolist() == [[105.0] * 4]
    values = metrics(server)
    assert values["quiver_model_downloading_time_us_count"] == values["quiver_disk_cache_miss_total"] >= 3
    with pytest.raises(InferenceServerException) as info:
        client.infer("missing.tar.gz", x())
    assert info.value.status() == "404"


def test_budget_holds_a_few_of_many_archives(server: QuiverServer) -> None:
    """A skewed concurrent mix over 30 archives with memory for about 3: every answer right,
    models evicted (and their archives evicted from the disk cache, which holds about 10)."""
    client = httpclient.InferenceServerClient(server.url)
    rng = random.Random(11)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(N_ARCHIVES)]
    trace = rng.choices(range(N_ARCHIVES), weights, k=90)
    most = 0

    async def main() -> None:
        nonlocal most
        async with aiohttpclient.InferenceServerClient(server.url) as aclient:
            for start in range(0, len(trace), 6):
                chunk = trace[start : start + 6]
                results = await asyncio.gather(*(aclient.infer(f"z{i:02d}.tar.gz", ax(1.0)) for i in chunk))
                for i, result in zip(chunk, results, strict=True):
                    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), 1.0 + i))
                most = max(most, len([n for n in ready(client) if n.startswith("z")]))

    asyncio.run(main())
    sizes = {m: int(b) for m, b in re.findall(r"loaded model '(z\d\d\.tar\.gz)' version.* it takes (\d+) bytes", server.log)}
    resident = [n for n in ready(client) if n in sizes]
    assert sum(sizes[m] for m in resident) <= (3 * WEIGHT_MB + 20) * MB
    assert most < len(set(trace))

    def counts() -> tuple[int, int, int]:
        loads = len(re.findall(r"loaded model 'z\d\d\.tar\.gz' version", server.log))
        evicted = len(re.findall(r"unloaded model 'z\d\d\.tar\.gz' \(evicted to make room", server.log))
        return loads, evicted, len([n for n in ready(client) if n in sizes])

    deadline = time.monotonic() + 10  # an eviction ahead of need may still be unloading
    while (c := counts())[0] != c[1] + c[2] and time.monotonic() < deadline:
        time.sleep(0.1)
    loads, evicted, loaded = counts()
    assert evicted > 0
    assert loads == evicted + loaded  # each model loaded once per miss
    values = metrics(server)
    assert values["quiver_model_memory_used_bytes"] <= values["quiver_model_memory_limit_bytes"]
    assert "model cache: evicting 'z" in server.log  # archives of models not loaded left the disk


def test_an_evicted_archive_is_loaded_again_from_the_cache_without_waiting_for_s3(
    server: QuiverServer, s3: SeaweedS3
) -> None:
    """--model-cache-revalidate=background (the default): a model evicted from memory loads
    again from its cached copy at once, the store asked in the background, so a stopped S3
    is not waited for (asking first would wait out the 3 s revalidation timeout and count a
    stale hit)."""
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    assert client.infer("z20.tar.gz", x(1.0)).as_numpy("OUTPUT0").tolist() == [[21.0] * 4]
    for i in range(21, N_ARCHIVES):
        if "z20.tar.gz" not in ready(client):
            break
        client.infer(f"z{i}.tar.gz", x())
    assert "z20.tar.gz" not in ready(client), "z20.tar.gz was never evicted"
    before = metrics(server)
    s3.pause()
    try:
        assert client.infer("z20.tar.gz", x(2.0)).as_numpy("OUTPUT0").tolist() == [[22.0] * 4]
        after = metrics(server)
    finally:
        s3.resume()
    assert after["quiver_disk_cache_checked_later_total"] == before["quiver_disk_cache_checked_later_total"] + 1
    assert after["quiver_disk_cache_stale_hit_total"] == before["quiver_disk_cache_stale_hit_total"]
    assert after["quiver_disk_cache_miss_total"] == before["quiver_disk_cache_miss_total"]


def test_s3_down_is_unavailable_then_served(server: QuiverServer, s3: SeaweedS3) -> None:
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    s3.pause()
    try:
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as info:
            client.infer("z29.tar.gz", x())
        assert info.value.status() == "503", info.value.message()
        assert "failed after 2 attempts" in info.value.message()
        assert time.monotonic() - started < 20
    finally:
        s3.resume()
    assert client.infer("z29.tar.gz", x(1.0)).as_numpy("OUTPUT0").tolist() == [[30.0] * 4]


def test_new_upload_under_the_same_key_after_unload(server: QuiverServer, s3: SeaweedS3) -> None:
    bucket = s3.client()
    bucket.put_object(Bucket=BUCKET, Key="repo/swap.tar.gz", Body=single_archive(10.0))
    client = httpclient.InferenceServerClient(server.url)
    assert client.infer("swap.tar.gz", x()).as_numpy("OUTPUT0").tolist() == [[10.0] * 4]
    bucket.put_object(Bucket=BUCKET, Key="repo/swap.tar.gz", Body=single_archive(20.0))
    assert client.infer("swap.tar.gz", x()).as_numpy("OUTPUT0").tolist() == [[10.0] * 4]
    client.unload_model("swap.tar.gz")
    assert client.infer("swap.tar.gz", x()).as_numpy("OUTPUT0").tolist() == [[20.0] * 4]
    bucket.delete_object(Bucket=BUCKET, Key="repo/swap.tar.gz")
    client.unload_model("swap.tar.gz")
    with pytest.raises(InferenceServerException) as info:
        client.infer("swap.tar.gz", x())
    assert info.value.status() == "404"


def test_sagemaker_load_from_s3_and_local_archive(server: QuiverServer, local_archives: Path) -> None:
    base = server.sagemaker_url
    url = f"s3://{BUCKET}/elsewhere/sm_model.tar.gz"
    status, _ = post(base, "/models", {"model_name": "sm-hash-1", "url": url}, {TARGET: "sm_model.tar.gz"})
    assert status == 200
    status, body = post(base, "/models", {"model_name": "sm-hash-1", "url": url})
    assert status == 409, body
    status, body = post(base, "/models", {"model_name": "sm-hash-2", "url": str(local_archives / "local_model.tar.gz")})
    assert status == 200, body
    request = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}]}
    status, body = post(base, "/invocations", request, {TARGET: "sm_model.tar.gz"})
    assert status == 200 and body["outputs"][0]["data"] == [41.0] * 4, body
    request = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}]}
    status, body = post(base, "/invocations", request, {TARGET: "sm-hash-2"})
    assert status == 200 and body["outputs"][0]["data"] == [151.0] * 4, body
    status, body = post(base, "/models", {"model_name": "sm-hash-3", "url": f"s3://{BUCKET}/elsewhere/ghost.tar.gz"})
    assert status == 404, body
    status, body = post(base, "/models", {"model_name": "sm-hash-4", "url": str(local_archives / "nope.tar.gz")})
    assert status == 404, body


def test_index_lists_s3_keys_and_the_repository_api_loads_them(server: QuiverServer) -> None:
    """The repository index lists the archives and folders under the S3 prefix, loaded or
    not (names only until loaded); the repository API's load takes an S3 key."""
    client = httpclient.InferenceServerClient(server.url)
    entries = client.get_model_repository_index()
    names = {e["name"] for e in entries}
    assert {"one.tar.gz", "pipe.tar.gz", "folder_model"} <= names
    assert {f"z{i:02d}.tar.gz" for i in range(N_ARCHIVES)} <= names
    assert "sm_model.tar.gz" not in names  # outside the repository's prefix
    client.load_model("folder_model")
    assert client.infer("folder_model", x(1.0)).as_numpy("OUTPUT0").tolist() == [[10.0] * 4]
    entry = next(e for e in client.get_model_repository_index() if e["name"] == "folder_model" and "version" in e)
    assert entry["state"] == "READY"


@pytest.mark.parametrize("kind", ["cve", "bomb", "members"])
@pytest.mark.parametrize("route", ["target_model", "post_models"])
def test_hostile_archives_from_s3_are_refused_and_write_nothing_outside(
    server: QuiverServer, s3: SeaweedS3, cache: Path, kind: str, route: str
) -> None:
    """From S3, by SageMaker TargetModel (a key under the repository's prefix) and by POST
    /models with an s3:// url: the CVE-2025-4517 chain aimed at the folder holding the cache;
    72 MiB of zeros in ~70 KiB (under the 80M cache, past 100 times its size: the ratio stops
    it at 64 MiB); 1,001 empty members against --model-archive-max-files 1000. A 400 naming
    the archive, nothing outside the cache, and the next correct request answered."""
    sentinel = cache.parent
    name = f"hostile_{kind}_{route}.tar.gz"
    if kind == "cve":
        body = cve_2025_4517_archive(cache_extraction_path_len(cache))
        texts = [f"archive '{name}': member 'a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p/lll", "passes through the symlink 'a'"]
    elif kind == "bomb":
        body = zeros_bomb_archive(members=72)
        texts = [f"archive '{name}' expands more than 100 times its {len(body)} compressed bytes", "member 'bomb/1/weights"]
    else:
        body = tar_gz({f"many/{i:04d}": b"" for i in range(1001)})
        texts = [f"archive '{name}' has more than 1000 members", "(stopped at 'many/1000')"]
    key = f"repo/{name}" if route == "target_model" else f"elsewhere/{name}"
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=body)
    before = listing(sentinel, skip=cache)
    if route == "target_model":
        status, reply = post(server.sagemaker_url, "/invocations", ONES, {TARGET: name})
    else:
        status, reply = post(server.sagemaker_url, "/models", {"model_name": f"hostile-{kind}", "url": f"s3://{BUCKET}/{key}"})
    message = reply["error"]
    assert listing(sentinel, skip=cache) == before and sorted(before) == ["flag"], message
    assert (sentinel / "flag").read_bytes() == b"original"
    assert status == 400, message
    for text in texts:
        assert text in message, message
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    status, reply = post(server.sagemaker_url, "/invocations", ONES, {TARGET: "one.tar.gz"})
    assert status == 200 and reply["outputs"][0]["data"] == [2.0] * 4, reply


ONES = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}]}
