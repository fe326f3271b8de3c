"""Storage faults against a real ``quiver serve`` on its default S3 retries and timeouts, with
a real S3 server (SeaweedFS) behind a fault-injecting proxy and a local repository of
archives: S3 hung (SIGSTOP) or killed while a cached archive is requested, a new upload whose
download is cut or corrupted, a cache folder the kernel refuses to write into, a cache that
fills up mid-download, and files removed from a cache entry under a loaded model.

Each case asserts the answer (a cached copy served within a few seconds with a warning, or
503 / UNAVAILABLE / 507 naming the cache folder, never a 500) and that the next correct
request is answered correctly."""

from __future__ import annotations

import http.client
import json
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from support.archives import single_archive
from support.faults import file_size_limit, read_only
from support.s3 import FaultProxy, SeaweedS3
from support.server import QuiverServer

BUCKET = "models"
TARGET = "X-Amzn-SageMaker-Target-Model"


def x(value: float = 0.0) -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return [inp]


def gx(value: float = 0.0) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return [inp]


def out(client: httpclient.InferenceServerClient, model: str) -> float:
    return float(client.infer(model, x(0.0)).as_numpy("OUTPUT0")[0, 0])


def logged(server: QuiverServer, *texts: str, since: int = 0, timeout: float = 10.0) -> list[str]:
    """The log lines (from line ``since`` on) holding every one of ``texts``, waiting for the
    log reader to catch up."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in server.lines[since:] if all(t in line for t in texts)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def metrics(server: QuiverServer) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def sagemaker_invoke(server: QuiverServer, target: str) -> tuple[int, Any]:
    host, port = server.sagemaker_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [0, 0, 0, 0]}]}
    try:
        conn.request("POST", "/invocations", body=json.dumps(body), headers={TARGET: target})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with SeaweedS3(tmp_path_factory.mktemp("fault_s3")) as server:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="repo/keep.tar.gz", Body=single_archive(1.0))
        client.put_object(Bucket=BUCKET, Key="repo/keep2.tar.gz", Body=single_archive(2.0))
        client.put_object(Bucket=BUCKET, Key="repo/swap.tar.gz", Body=single_archive(10.0))
        yield server


@pytest.fixture(scope="module")
def proxy(s3: SeaweedS3) -> Iterator[FaultProxy]:
    with FaultProxy(s3.ports["s3"]) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("fault_local")
    for name, value in [("ro_old", 3.0), ("ro_new", 4.0), ("dmg", 5.0)]:
        (repo / f"{name}.tar.gz").write_bytes(single_archive(value))
    (repo / "big.tar.gz").write_bytes(single_archive(6.0, weight_mb=3))
    return repo


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault_cache")


@pytest.fixture(scope="module")
def server(s3: SeaweedS3, proxy: FaultProxy, local: Path, cache: Path) -> Iterator[QuiverServer]:
    # Quiver's defaults for S3 (5 attempts, 5 s connect / 30 s read) and for revalidation (3 s).
    args = (
        "--model-repository", f"s3://{BUCKET}/repo",
        "--model-control-mode=on_demand",
        "--model-cache-dir", str(cache),
    )  # fmt: skip
    env = {
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": proxy.endpoint,
        "SAGEMAKER_MULTI_MODEL": "true",
    }
    with QuiverServer(local, args=args, env=env, timeout=90) as server:
        yield server


def test_s3_hung_a_cached_archive_is_served_from_the_cache(server: QuiverServer, s3: SeaweedS3) -> None:
    http = httpclient.InferenceServerClient(server.url, network_timeout=120)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert out(http, "keep.tar.gz") == 1.0
    assert out(http, "keep2.tar.gz") == 2.0
    http.unload_model("keep.tar.gz")
    http.unload_model("keep2.tar.gz")
    s3.pause()
    try:
        started = time.monotonic()
        assert out(http, "keep.tar.gz") == 1.0
        took = time.monotonic() - started
        assert took < 10, took  # the 3 s revalidation timeout, then the cached copy
        started = time.monotonic()
        result = grpc.infer("keep2.tar.gz", gx(1.0), client_timeout=60)
        assert result.as_numpy("OUTPUT0").tolist() == [[3.0] * 4]
        assert time.monotonic() - started < 10
    finally:
        s3.resume()
    assert logged(server, "serving 'keep.tar.gz' from the model cache", "did not answer within 3 s")
    assert metrics(server)["quiver_disk_cache_stale_hit_total"] >= 2
    http.unload_model("keep.tar.gz")
    assert out(http, "keep.tar.gz") == 1.0  # the store answers again: a plain hit


def test_s3_killed_a_cached_archive_is_served_then_s3_comes_back(server: QuiverServer, s3: SeaweedS3) -> None:
    http = httpclient.InferenceServerClient(server.url, network_timeout=120)
    assert out(http, "keep.tar.gz") == 1.0
    http.unload_model("keep.tar.gz")
    s3.kill()
    try:
        started = time.monotonic()
        assert out(http, "keep.tar.gz") == 1.0
        assert time.monotonic() - started < 10
    finally:
        s3.start()
    http.unload_model("keep.tar.gz")
    assert out(http, "keep.tar.gz") == 1.0
    assert out(http, "swap.tar.gz") == 10.0


@pytest.mark.parametrize("fault", ["truncate", "corrupt"])
def test_a_new_upload_cut_or_corrupted_in_transit_leaves_the_cached_version_served(
    server: QuiverServer, s3: SeaweedS3, proxy: FaultProxy, fault: str
) -> None:
    http = httpclient.InferenceServerClient(server.url, network_timeout=120)
    bucket = s3.client()
    old, new = (10.0, 20.0) if fault == "truncate" else (20.0, 30.0)
    assert out(http, "swap.tar.gz") == old
    http.unload_model("swap.tar.gz")
    bucket.put_object(Bucket=BUCKET, Key="repo/swap.tar.gz", Body=single_archive(new))
    hits, mark = proxy.hits, len(server.lines)
    if fault == "truncate":
        proxy.truncate = ("swap.tar.gz", 100)
    else:
        proxy.corrupt = "swap.tar.gz"
    try:
        assert out(http, "swap.tar.gz") == old  # the new version could not be fetched
    finally:
        proxy.truncate = None
        proxy.corrupt = None
    assert proxy.hits > hits
    assert logged(server, "serving 'swap.tar.gz' from the model cache", since=mark)
    http.unload_model("swap.tar.gz")
    assert out(http, "swap.tar.gz") == new


def test_a_read_only_cache_folder_is_503_and_507_naming_it(server: QuiverServer, cache: Path) -> None:
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert out(http, "ro_old.tar.gz") == 3.0
    http.unload_model("ro_old.tar.gz")
    with read_only(cache):
        with pytest.raises(InferenceServerException) as info:
            http.infer("ro_new.tar.gz", x())
        assert info.value.status() == "503", info.value.message()
        assert f"model cache folder {cache} cannot be written" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            grpc.infer("ro_new.tar.gz", gx())
        assert info.value.status() == "StatusCode.UNAVAILABLE"
        assert str(cache) in info.value.message()
        status, body = sagemaker_invoke(server, "ro_new.tar.gz")
        assert status == 507 and str(cache) in body["error"], body
        assert out(http, "ro_old.tar.gz") == 3.0  # what is on disk still serves
    assert out(http, "ro_new.tar.gz") == 4.0
    status, body = sagemaker_invoke(server, "ro_new.tar.gz")
    assert status == 200 and body["outputs"][0]["data"] == [4.0] * 4


def test_a_cache_that_fills_up_mid_download_is_503_and_507(server: QuiverServer, cache: Path) -> None:
    http = httpclient.InferenceServerClient(server.url)
    assert server.process is not None
    with file_size_limit(server.process.pid, 1 << 20):  # the archive extracts to 3 MB
        with pytest.raises(InferenceServerException) as info:
            http.infer("big.tar.gz", x())
        assert info.value.status() == "503", info.value.message()
        assert f"model cache folder {cache} is full" in info.value.message()
        status, body = sagemaker_invoke(server, "big.tar.gz")
        assert status == 507 and f"model cache folder {cache} is full" in body["error"], body
    assert not list(cache.glob(".tmp-*"))
    assert out(http, "big.tar.gz") == 6.0


def test_files_removed_under_a_loaded_model_are_fetched_again_after_unload(server: QuiverServer, cache: Path) -> None:
    http = httpclient.InferenceServerClient(server.url)
    assert out(http, "dmg.tar.gz") == 5.0
    (entry,) = cache.glob("dmg.tar.gz-*")
    shutil.rmtree(entry / "content" / "1")
    assert out(http, "dmg.tar.gz") == 5.0  # the loaded model runs from memory
    http.unload_model("dmg.tar.gz")
    assert out(http, "dmg.tar.gz") == 5.0
    assert logged(server, "the entry of 'dmg.tar.gz'", "was changed or damaged", "missing", "fetched again")
    fresh = [p for p in cache.glob("dmg.tar.gz-*") if (p / "content" / "1" / "model.onnx").is_file()]
    assert len(fresh) == 1 and fresh[0] != entry
    assert metrics(server)["quiver_disk_cache_damaged_total"] >= 1
