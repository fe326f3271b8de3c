"""S3Storage and DiskCache against a real SeaweedFS server (SigV4 checked) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import io
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quiver.errors import NotFoundError, UnavailableError
from quiver.repository.cache import DiskCache
from quiver.repository.storage import RetryPolicy, S3Storage, model_keys, storage_for
from support.s3 import FaultProxy, SeaweedS3

BUCKET = "models"
FAST = RetryPolicy(attempts=4, base_delay=0.05, max_delay=0.2, connect_timeout=0.5, read_timeout=0.5)


def archive_bytes(model: str, payload: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in [(f"{model}/config.pbtxt", f"name: '{model}'".encode()), (f"{model}/1/model.bin", payload)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with SeaweedS3(tmp_path_factory.mktemp("s3")) as server:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="repo/resnet.tar.gz", Body=archive_bytes("resnet", b"r" * 200_000))
        client.put_object(Bucket=BUCKET, Key="repo/plain/config.pbtxt", Body=b"name: 'plain'")
        client.put_object(Bucket=BUCKET, Key="repo/plain/1/model.bin", Body=b"p" * 5000)
        yield server


def storage(endpoint: str, retry: RetryPolicy = FAST, **kw: str) -> S3Storage:
    return S3Storage(
        f"s3://{BUCKET}/repo", endpoint_url=endpoint, region="us-east-1",
        access_key_id=kw.get("key", "quivertestkey"), secret_access_key=kw.get("secret", "quivertestsecret"),
        retry=retry,
    )  # fmt: skip


def test_list_stat_download(s3: SeaweedS3, tmp_path: Path) -> None:
    store = storage(s3.endpoint)
    objects = store.list()
    assert [o.key for o in objects] == ["plain/1/model.bin", "plain/config.pbtxt", "resnet.tar.gz"]
    assert model_keys(objects) == ["plain", "resnet.tar.gz"]
    obj = store.stat("resnet.tar.gz")
    assert obj.md5 is not None and obj.size == objects[2].size
    got = store.download("resnet.tar.gz", tmp_path / "r.tar.gz")
    data = (tmp_path / "r.tar.gz").read_bytes()
    assert got.md5 == obj.md5 == hashlib.md5(data).hexdigest() and len(data) == obj.size
    with pytest.raises(NotFoundError, match=r"bucket 'models' key 'repo/nothing.tar.gz'"):
        store.stat("nothing.tar.gz")


def test_cache_over_s3_verifies_etag_and_hits(s3: SeaweedS3, tmp_path: Path) -> None:
    async def main() -> None:
        store = storage(s3.endpoint)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        path = await cache.fetch("resnet.tar.gz", store)
        assert (path / "resnet/1/model.bin").read_bytes() == b"r" * 200_000
        plain = await cache.fetch("plain", store)
        assert (plain / "1/model.bin").read_bytes() == b"p" * 5000
        assert await cache.fetch("resnet.tar.gz", store) == path
        assert (cache.stats.misses, cache.stats.hits) == (2, 1)
        await cache.close()

    asyncio.run(main())


def test_corrupted_body_fails_the_md5_check(s3: SeaweedS3, tmp_path: Path) -> None:
    async def main() -> None:
        with FaultProxy(s3.ports["s3"]) as proxy:
            proxy.corrupt = "resnet.tar.gz"
            cache = DiskCache(tmp_path / "cache", 10 << 20)
            with pytest.raises(UnavailableError, match=r"checksum|does not match ETag"):
                await cache.fetch("resnet.tar.gz", storage(proxy.endpoint))
            assert proxy.hits == FAST.attempts and cache.entries() == []
            await cache.close()

    asyncio.run(main())


def test_truncated_body_is_retried_then_unavailable(s3: SeaweedS3, tmp_path: Path) -> None:
    with FaultProxy(s3.ports["s3"]) as proxy:
        proxy.truncate = ("resnet.tar.gz", 100)
        store = storage(proxy.endpoint)
        with pytest.raises(UnavailableError, match=r"bucket 'models' key 'repo/resnet.tar.gz'.*after 4 attempts"):
            store.download("resnet.tar.gz", tmp_path / "r.tar.gz")
        assert proxy.hits == 4
        proxy.hits = 0
        proxy.truncate = ("resnet.tar.gz", 100)

        def heal() -> None:  # the body is cut twice, then the network heals
            deadline = time.monotonic() + 10
            while proxy.hits < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            proxy.truncate = None

        threading.Thread(target=heal).start()
        retry = RetryPolicy(attempts=10, base_delay=0.1, max_delay=0.1, connect_timeout=0.5, read_timeout=0.5)
        got = storage(proxy.endpoint, retry).download("resnet.tar.gz", tmp_path / "r.tar.gz")
        assert got.object.size == (tmp_path / "r.tar.gz").stat().st_size and proxy.hits == 2


def test_slow_server_is_retried(s3: SeaweedS3, tmp_path: Path) -> None:
    retry = RetryPolicy(attempts=8, base_delay=0.1, max_delay=0.3, connect_timeout=0.3, read_timeout=0.3)
    store = storage(s3.endpoint, retry)
    s3.pause()
    resumer = threading.Timer(1.0, s3.resume)
    resumer.start()
    try:
        got = store.download("plain/1/model.bin", tmp_path / "m.bin")
    finally:
        resumer.join()
        s3.resume()
    assert (tmp_path / "m.bin").read_bytes() == b"p" * 5000 and got.md5 == got.object.md5


def test_a_quick_view_gives_up_after_one_short_attempt(s3: SeaweedS3, tmp_path: Path) -> None:
    """with_timeout: the disk cache's revalidation, which must not wait out the retries."""
    patient = storage(s3.endpoint, RetryPolicy(attempts=5, connect_timeout=30, read_timeout=30))
    quick = patient.with_timeout(0.5)
    assert quick is patient.with_timeout(0.5) and quick.location == patient.location
    assert quick.stat("resnet.tar.gz") == patient.stat("resnet.tar.gz")
    s3.pause()
    try:
        started = time.monotonic()
        with pytest.raises(UnavailableError, match=r"stat of .*'repo/resnet.tar.gz'.* after 1 attempts"):
            quick.stat("resnet.tar.gz")
        assert time.monotonic() - started < 3

        async def main() -> None:  # the cache serves what it holds, within its timeout
            cache = DiskCache(tmp_path / "cache", 10 << 20, revalidate_timeout=0.5)
            s3.resume()
            first = await cache.fetch("plain", patient)
            s3.pause()
            began = time.monotonic()
            assert await cache.fetch("plain", patient) == first
            assert time.monotonic() - began < 3 and cache.stats.stale_hits == 1
            s3.resume()
            await cache.close()

        asyncio.run(main())
    finally:
        s3.resume()


def test_server_down_then_back(s3: SeaweedS3, tmp_path: Path) -> None:
    proxy = FaultProxy(s3.ports["s3"])  # not started: connections are refused
    store = storage(proxy.endpoint)
    started = time.monotonic()
    with pytest.raises(UnavailableError, match=r"stat of bucket 'models' key 'repo/resnet.tar.gz'.*4 attempts"):
        store.stat("resnet.tar.gz")
    assert time.monotonic() - started < 5
    threading.Timer(0.3, proxy.start).start()
    try:
        retry = RetryPolicy(attempts=10, base_delay=0.1, max_delay=0.2, connect_timeout=0.5, read_timeout=1)
        assert storage(proxy.endpoint, retry).stat("resnet.tar.gz").size > 0
    finally:
        time.sleep(0.35)
        proxy.stop()


def test_bad_credentials_are_not_retried(s3: SeaweedS3) -> None:
    store = storage(s3.endpoint, RetryPolicy(attempts=5, base_delay=5), secret="wrong")
    started = time.monotonic()
    with pytest.raises(UnavailableError, match=r"SignatureDoesNotMatch"):
        store.list()
    assert time.monotonic() - started < 2


def test_environment_variables(s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the S3-specific one wins
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = storage_for(f"s3://{BUCKET}/repo/plain", retry=FAST)
    assert [o.key for o in store.list()] == ["1/model.bin", "config.pbtxt"]
