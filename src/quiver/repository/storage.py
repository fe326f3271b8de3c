"""Where model files come from: a local folder or an S3-compatible bucket.

A :class:`Storage` is a flat namespace of objects addressed by ``/``-separated keys relative
to its root (a folder, or ``s3://bucket/prefix``), as S3 is. A model is either a folder of
objects (``resnet/config.pbtxt``, ``resnet/1/model.onnx``) or one ``.tar.gz`` archive key
(``resnet_v0.tar.gz``), SageMaker style. :func:`model_keys` turns a listing into those names.

Every method blocks (disk or network I/O): callers on the event loop run them in a thread.
Errors are Quiver errors: a missing key is :class:`NotFoundError`, a store that cannot be
reached after the retries is :class:`UnavailableError` naming bucket and key, a key that
tries to leave the root or that the filesystem would refuse is :class:`InvalidArgumentError`
(:func:`quiver.repository.names.check_key`). ``OSError`` raised while writing the
destination file (a full disk) is left as it is for the caller, which owns that file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from quiver.errors import InvalidArgumentError, NotFoundError, UnavailableError
from quiver.repository.names import check_key

logger = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
CHUNK_BYTES = 1 << 20

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object: its key relative to the storage root, size in bytes, ETag, modification time.

    ``etag`` is the store's ETag without quotes. For S3 a single-part upload's ETag is the MD5
    of the content (:attr:`md5` returns it); multipart ETags (``<hex>-<parts>``) and local
    ETags (``<size>-<mtime_ns>`` in hex) are opaque version tags.
    """

    key: str
    size: int
    etag: str
    modified: datetime | None = None

    @property
    def md5(self) -> str | None:
        """The content MD5 when the ETag is a plain MD5 (32 hex digits), else None."""
        tag = self.etag.lower()
        if len(tag) == 32 and all(c in "0123456789abcdef" for c in tag):
            return tag
        return None


@dataclass(frozen=True, slots=True)
class Downloaded:
    """What :meth:`Storage.download` wrote: the object as served and the MD5 of the bytes."""

    object: StoredObject
    md5: str


#: ``Storage.download``'s ``on_start``: called with the object as the store names it, before
#: its body is read.
OnStart = Callable[[StoredObject], None]


@runtime_checkable
class Storage(Protocol):
    """A source of model files. All methods block; run them in a thread from async code."""

    @property
    def location(self) -> str:
        """Where this storage points, for messages and logs (a path or ``s3://bucket/prefix``)."""
        ...

    def list(self, prefix: str = "") -> list[StoredObject]:
        """Every object whose key starts with ``prefix`` (recursive, sorted by key)."""
        ...

    def stat(self, key: str) -> StoredObject:
        """One object's size and ETag; :class:`NotFoundError` when there is none."""
        ...

    def download(
        self, key: str, dest: Path, *, etag: str | None = None, on_start: OnStart | None = None
    ) -> Downloaded:
        """Stream ``key`` into the file ``dest`` (created or truncated).

        With ``etag``, the download fails if the object is no longer that version. A body
        shorter than announced is an error (after retries), never a short file that looks
        complete; ``dest`` is then in an unspecified state and the caller deletes it.
        ``on_start(object)`` is called when the store has named the object's size and ETag,
        before the body is read (once per attempt); what it raises ends the download.
        """
        ...


def is_archive_key(key: str) -> bool:
    """True for SageMaker-style archive keys (``.tar.gz`` or ``.tgz``)."""
    return key.lower().endswith(ARCHIVE_SUFFIXES)


def model_keys(objects: Iterable[StoredObject], prefix: str = "") -> list[str]:
    """The models in a listing: each top-level archive key and each top-level folder name.

    Keys are taken relative to ``prefix``; hidden names (starting with ``.``) are skipped.
    """
    names: set[str] = set()
    for obj in objects:
        if not obj.key.startswith(prefix):
            continue
        rest = obj.key[len(prefix) :].lstrip("/")
        if not rest or rest.startswith("."):
            continue
        head, sep, _ = rest.partition("/")
        if sep or is_archive_key(head):
            names.add(head)
    return sorted(names)


class LocalStorage:
    """A local folder as storage: keys are paths relative to ``root``.

    Folder symlinks are not followed when listing; file symlinks are read through. The ETag
    of a file is ``<size>-<mtime_ns>`` in hex, so any rewrite of the file is a new version.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).absolute()
        if not self.root.is_dir():
            raise InvalidArgumentError(f"model repository '{self.root}' is not a directory")

    @property
    def location(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _object(self, key: str, st: os.stat_result) -> StoredObject:
        return StoredObject(
            key=key,
            size=st.st_size,
            etag=f"{st.st_size:x}-{st.st_mtime_ns:x}",
            modified=datetime.fromtimestamp(st.st_mtime, tz=UTC),
        )

    def list(self, prefix: str = "") -> list[StoredObject]:
        check_key(prefix, allow_empty=True)
        # Walk only the deepest folder the prefix names, then filter by the full prefix.
        base_key = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root / base_key if base_key else self.root
        if not base.is_dir():
            return []
        found: list[StoredObject] = []
        for folder, dirs, files in os.walk(base):
            dirs.sort()
            rel_folder = Path(folder).relative_to(self.root).as_posix()
            for name in files:
                key = name if rel_folder == "." else f"{rel_folder}/{name}"
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(folder, name))
                except FileNotFoundError:
                    continue  # removed while listing, or a dangling symlink
                if stat_mod.S_ISREG(st.st_mode):
                    found.append(self._object(key, st))
        found.sort(key=lambda o: o.key)
        return found

    def stat(self, key: str) -> StoredObject:
        path = self._path(key)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise NotFoundError(f"'{key}' not found in {self.location}") from None
        if not stat_mod.S_ISREG(st.st_mode):
            raise NotFoundError(f"'{key}' in {self.location} is not a file")
        return self._object(key, st)

    def download(
        self, key: str, dest: Path, *, etag: str | None = None, on_start: OnStart | None = None
    ) -> Downloaded:
        path = self._path(key)
        try:
            src = open(path, "rb")  # noqa: SIM115 - closed below, kept open while copying
        except FileNotFoundError:
            raise NotFoundError(f"'{key}' not found in {self.location}") from None
        with src:
            st = os.fstat(src.fileno())
            obj = self._object(key, st)
            if etag is not None and etag != obj.etag:
                raise UnavailableError(f"'{key}' in {self.location} changed while being fetched")
            if on_start is not None:
                on_start(obj)
            digest = hashlib.md5(usedforsecurity=False)
            written = 0
            with open(dest, "wb") as out:
                while chunk := src.read(CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
        if written != obj.size:
            raise UnavailableError(
                f"'{key}' in {self.location}: read {written} bytes, expected {obj.size}"
            )
        return Downloaded(obj, digest.hexdigest())


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How S3 calls are retried: ``attempts`` in all, exponential backoff with full jitter.

    Retried: throttling, HTTP 5xx, connection errors, timeouts and truncated bodies. Not
    retried: missing keys or buckets, denied access, bad signatures, other 4xx.
    """

    attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 5.0
    connect_timeout: float = 5.0
    read_timeout: float = 30.0

    def delay(self, attempt: int) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        return random.uniform(0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))


_RETRYABLE_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "SlowDown",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "BandwidthLimitExceeded",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})


class _Retry(Exception):
    """A failure worth another attempt; ``reason`` says what happened."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (``bucket``, ``some/prefix/``); the prefix may be empty."""
    if not url.startswith("s3://"):
        raise InvalidArgumentError(f"'{url}' is not an s3:// URL")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise InvalidArgumentError(f"'{url}' names no bucket")
    prefix = prefix.strip("/")
    if prefix:
        check_key(prefix)
        prefix += "/"
    return bucket, prefix


def endpoint_from_env() -> str | None:
    """The S3 endpoint the AWS variables name: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


class S3Storage:
    """An ``s3://bucket/prefix`` on AWS or any S3-compatible store, through boto3.

    Explicit arguments win; otherwise boto3's usual sources apply (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_REGION`` /
    ``AWS_DEFAULT_REGION``, instance roles), and the endpoint comes from
    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``. With a custom endpoint, path-style
    addressing is used (what S3-compatible stores expect) unless ``addressing_style`` says
    otherwise. botocore's own retries are off: :class:`RetryPolicy` retries every call,
    including a body cut short mid-download, then raises :class:`UnavailableError`.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        profile: str | None = None,
        addressing_style: str | None = None,
        retry: RetryPolicy | None = None,
        max_pool_connections: int = 16,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = parse_s3_url(url)
        self._url = url
        self._options: dict[str, Any] = {
            "endpoint_url": endpoint_url,
            "region": region,
            "access_key_id": access_key_id,
            "secret_access_key": secret_access_key,
            "session_token": session_token,
            "profile": profile,
            "addressing_style": addressing_style,
            "max_pool_connections": max_pool_connections,
            "sleep": sleep,
        }
        self._quick: dict[float, S3Storage] = {}
        self._quick_lock = threading.Lock()
        self.retry = retry or RetryPolicy()
        if self.retry.attempts < 1:
            raise InvalidArgumentError("S3 retry attempts must be at least 1")
        self.endpoint_url = endpoint_url or endpoint_from_env()
        style = addressing_style or ("path" if self.endpoint_url else "auto")
        config = Config(
            connect_timeout=self.retry.connect_timeout,
            read_timeout=self.retry.read_timeout,
            retries={"max_attempts": 1, "mode": "standard"},
            s3={"addressing_style": style},
            max_pool_connections=max_pool_connections,
        )
        session = boto3.session.Session(profile_name=profile) if profile else boto3.session.Session()
        self._client: Any = session.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=region,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            aws_session_token=session_token,
            config=config,
        )
        self._sleep = sleep

    @property
    def location(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def __repr__(self) -> str:
        return f"S3Storage({self.location!r}, endpoint_url={self.endpoint_url!r})"

    def with_timeout(self, seconds: float) -> S3Storage:
        """The same bucket and prefix, through a client whose calls make one attempt and
        give up after about ``seconds`` (connect and read timeouts): for a quick question,
        such as the disk cache's check of a key it already holds, that must not wait out
        the retries of a store that is down or hung. Made once per ``seconds``."""
        with self._quick_lock:
            quick = self._quick.get(seconds)
            if quick is None:
                policy = RetryPolicy(attempts=1, connect_timeout=seconds, read_timeout=seconds)
                quick = S3Storage(self._url, retry=policy, **self._options)
                self._quick[seconds] = quick
            return quick

    # -- the retry loop and error translation ---------------------------------------------

    def _where(self, key: str | None) -> str:
        if key is None:
            return f"bucket '{self.bucket}' prefix '{self.prefix}'"
        return f"bucket '{self.bucket}' key '{self.prefix}{key}'"

    def _classify(self, exc: Exception, key: str | None) -> Exception:
        """A Quiver error to raise now, or a :class:`_Retry` for another attempt."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            FlexibleChecksumError,
            HTTPClientError,
            IncompleteReadError,
            NoCredentialsError,
            PartialCredentialsError,
            ReadTimeoutError,
            ResponseStreamingError,
        )
        from botocore.exceptions import ConnectionError as BotoConnectionError

        where = self._where(key)
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            message = error.get("Message") or code or str(exc)
            if code in _RETRYABLE_CODES or status >= 500 or status == 429:
                return _Retry(f"{code or status}: {message}")
            if code in _NOT_FOUND_CODES or status == 404:
                return NotFoundError(f"S3 {where} not found ({code or status})")
            if code == "PreconditionFailed" or status == 412:
                return UnavailableError(f"S3 {where} changed while being fetched")
            return UnavailableError(f"S3 {where}: {code or status}: {message}")
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return UnavailableError(f"S3 {where}: no usable credentials: {exc}")
        if isinstance(
            exc,
            BotoConnectionError
            | HTTPClientError
            | ReadTimeoutError
            | IncompleteReadError
            | ResponseStreamingError
            | FlexibleChecksumError,
        ):
            return _Retry(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, BotoCoreError):
            return UnavailableError(f"S3 {where}: {exc}")
        return exc

    def _call(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries; translate the final failure."""
        last = ""
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return fn()
            except _Retry as retry:
                last = retry.reason
            except Exception as exc:
                translated = self._classify(exc, key)
                if not isinstance(translated, _Retry):
                    if translated is exc:
                        raise
                    raise translated from exc
                last = translated.reason
            if attempt < self.retry.attempts:
                delay = self.retry.delay(attempt)
                logger.warning(
                    "S3 %s of %s failed (attempt %d of %d, retrying in %.2fs): %s",
                    what, self._where(key), attempt, self.retry.attempts, delay, last,
                )
                self._sleep(delay)
        raise UnavailableError(
            f"S3 {what} of {self._where(key)} at {self.endpoint_url or 'AWS'} failed after "
            f"{self.retry.attempts} attempts: {last}"
        )

    # -- the Storage protocol ---------------------------------------------------------------

    def list(self, prefix: str = "") -> list[StoredObject]:
        check_key(prefix, allow_empty=True)
        full = self.prefix + prefix

        def run() -> list[StoredObject]:
            found: list[StoredObject] = []
            token: str | None = None
            while True:
                args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
                if token:
                    args["ContinuationToken"] = token
                page = self._client.list_objects_v2(**args)
                for item in page.get("Contents", ()):
                    key = str(item["Key"])[len(self.prefix) :]
                    if not key or key.endswith("/"):
                        continue  # folder markers
                    found.append(
                        StoredObject(
                            key, int(item["Size"]), str(item.get("ETag", "")).strip('"'),
                            item.get("LastModified"),
                        )
                    )
                if not page.get("IsTruncated"):
                    break
                token = page.get("NextContinuationToken")
            found.sort(key=lambda o: o.key)
            return found

        return self._call("list", prefix or None, run)

    def stat(self, key: str) -> StoredObject:
        check_key(key)

        def run() -> StoredObject:
            head = self._client.head_object(Bucket=self.bucket, Key=self.prefix + key)
            return StoredObject(
                key, int(head["ContentLength"]), str(head.get("ETag", "")).strip('"'),
                head.get("LastModified"),
            )

        return self._call("stat", key, run)

    def download(
        self, key: str, dest: Path, *, etag: str | None = None, on_start: OnStart | None = None
    ) -> Downloaded:
        check_key(key)
        pinned = [etag]  # the version the first response named; retries ask for the same one

        def run() -> Downloaded:
            args: dict[str, Any] = {"Bucket": self.bucket, "Key": self.prefix + key}
            if pinned[0]:
                args["IfMatch"] = f'"{pinned[0]}"'
            response = self._client.get_object(**args)
            obj = StoredObject(
                key, int(response["ContentLength"]), str(response.get("ETag", "")).strip('"'),
                response.get("LastModified"),
            )
            pinned[0] = pinned[0] or obj.etag or None
            body = response["Body"]
            if on_start is not None:
                try:
                    on_start(obj)
                except BaseException:
                    body.close()
                    raise
            digest = hashlib.md5(usedforsecurity=False)
            written = 0
            try:
                with open(dest, "wb") as out:
                    while True:
                        try:
                            chunk = body.read(CHUNK_BYTES)
                        except Exception as exc:
                            translated = self._classify(exc, key)
                            if isinstance(translated, _Retry):
                                raise _Retry(
                                    f"body cut after {written} of {obj.size} bytes: {translated.reason}"
                                ) from exc
                            raise
                        if not chunk:
                            break
                        out.write(chunk)  # OSError (disk full) goes to the caller unretried
                        digest.update(chunk)
                        written += len(chunk)
            finally:
                body.close()
            if written != obj.size:
                raise _Retry(f"body cut short: {written} of {obj.size} bytes")
            return Downloaded(obj, digest.hexdigest())

        return self._call("download", key, run)


def storage_for(location: str, **options: Any) -> Storage:
    """The storage for a ``--model-repository`` location: ``s3://bucket/prefix`` or a folder.

    ``options`` go to :class:`S3Storage` (endpoint_url, region, access_key_id,
    secret_access_key, session_token, profile, addressing_style, retry); a local folder
    takes none.
    """
    if location.startswith("s3://"):
        return S3Storage(location, **options)
    if "://" in location:
        raise InvalidArgumentError(f"unsupported model repository location '{location}'")
    if options:
        raise InvalidArgumentError(
            f"options {sorted(options)} apply to s3:// locations, not to '{location}'"
        )
    return LocalStorage(Path(location))


__all__ = [
    "ARCHIVE_SUFFIXES",
    "Downloaded",
    "LocalStorage",
    "OnStart",
    "RetryPolicy",
    "S3Storage",
    "Storage",
    "StoredObject",
    "check_key",
    "endpoint_from_env",
    "is_archive_key",
    "model_keys",
    "parse_s3_url",
    "storage_for",
]
