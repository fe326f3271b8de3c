"""Where models come from: the local repositories, storage keys (archives next to local model
folders, archives and folders under ``s3://`` repositories), URLs (SageMaker's ``POST
/models``), files carried in a repository-API load request, and the disk cache that archives
and S3 models are fetched through.

:class:`ModelSources` finds a model's :class:`~quiver.repository.local.ModelSource` (or the
stores a key may be in), fingerprints folders (a changed fingerprint is a changed model:
poll reloads it, and measured sizes belong to one fingerprint), owns the
:class:`~quiver.repository.cache.DiskCache` (opened on first use) and the private folders of
request-supplied files. It decides nothing about what is loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from quiver.backends.base import CACHE_FOLDERS
from quiver.errors import InvalidArgumentError, NotFoundError, UnavailableError, UnsupportedError
from quiver.lifecycle.archives import is_namespaced
from quiver.lifecycle.pool import LoadPool
from quiver.metrics.statistics import MultiModelStatistics
from quiver.repository.archive import ExtractLimits
from quiver.repository.cache import DEFAULT_REVALIDATE_TIMEOUT, CacheLease, CacheStats, DiskCache
from quiver.repository.local import CONFIG_FILENAME, LocalRepository, ModelSource
from quiver.repository.names import check_file_paths, check_key_name
from quiver.repository.storage import (
    LocalStorage,
    S3Storage,
    Storage,
    is_archive_key,
    model_keys,
    parse_s3_url,
    storage_for,
)

__all__ = ["DEFAULT_CACHE_BYTES", "ModelSources", "default_cache_dir", "fingerprint", "fingerprint_and_size"]

logger = logging.getLogger(__name__)


#: Seconds an S3 store's listing serves the repository index before it is listed again.
LISTING_TTL_S = 30.0

#: ``--model-cache-size`` when none is given.
DEFAULT_CACHE_BYTES = 20 << 30


def default_cache_dir() -> Path:
    """``$QUIVER_CACHE_DIR``, else ``quiver-model-cache-<uid>`` under the system temp folder."""
    configured = os.environ.get("QUIVER_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"quiver-model-cache-{os.getuid()}"


def fingerprint(path: Path) -> str:
    """Changes when any file under ``path`` is added, removed, resized or rewritten."""
    return fingerprint_and_size(path)[0]


class WalkObserver(Protocol):
    def folder(self, path: str) -> None:
        """``path`` (a folder) is about to be read."""

    def link(self, path: str) -> None:
        """``path`` is a symbolic link."""


def fingerprint_and_size(path: Path, observer: WalkObserver | None = None) -> tuple[str, int]:
    """:func:`fingerprint` of ``path``, and the bytes of the regular files under it (symbolic
    links not counted: :func:`quiver.lifecycle.memory.file_bytes`), in one walk: one ``stat``
    per file. Folders are walked top-down in name order, linked folders not entered (as
    ``os.walk``); a linked file counts in the fingerprint by what it names, a dangling one
    not at all. ``observer``: told of each folder before it is read and of each link met
    (:class:`~quiver.lifecycle.watch.FolderWatch`)."""
    digest = hashlib.blake2b(digest_size=16)
    total = 0

    def walk(folder: str, prefix: str) -> None:
        nonlocal total
        if observer is not None:
            observer.folder(folder)
        try:
            with os.scandir(folder) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError:
            return
        folders = []
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry)
                    continue
                if entry.is_symlink():
                    if observer is not None:
                        observer.link(entry.path)
                    if os.path.isdir(entry.path):
                        continue  # a linked folder: not entered, as os.walk does
                    st = os.stat(entry.path)
                else:
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_size
            except OSError:
                continue
            digest.update(f"{prefix}{entry.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        for entry in folders:
            walk(entry.path, f"{prefix}{entry.name}/")

    walk(os.fspath(path), "")
    return digest.hexdigest(), total


class ModelSources:
    def __init__(
        self,
        repositories: list[Path],
        *,
        pool: LoadPool,
        stats: MultiModelStatistics,
        remote_repositories: list[str] | tuple[str, ...] = (),
        s3_options: dict[str, Any] | None = None,
        cache_dir: Path | None = None,
        cache_size: int = DEFAULT_CACHE_BYTES,
        archive_limits: ExtractLimits | None = None,
        cache_revalidate_timeout: float = DEFAULT_REVALIDATE_TIMEOUT,
    ) -> None:
        self._pool = pool
        self._stats = stats
        self._repository = LocalRepository(repositories)
        # Where keys (archives, S3 folders) are looked up, in order: local folders, then S3.
        self._s3_options = dict(s3_options or {})
        self._stores: list[Storage] = [LocalStorage(root) for root in repositories]
        self._stores += [storage_for(url, **self._s3_options) for url in remote_repositories]
        self._url_stores: dict[str, Storage] = {}
        self._cache_dir = cache_dir
        self._cache_size = cache_size
        self._archive_limits = archive_limits  # None: the defaults, bytes capped at the cache size
        self._cache_revalidate_timeout = cache_revalidate_timeout
        self._cache: DiskCache | None = None
        self._cache_private: Path | None = None  # a fallback folder of our own, deleted at close
        self._cache_lock = asyncio.Lock()
        self._fingerprints: dict[str, str] = {}
        self._overrides: dict[str, Path] = {}  # models loaded from request-supplied files
        self._listings: dict[str, tuple[float, list[str]]] = {}  # S3 store -> (when, keys)
        self._local_listings: dict[str, tuple[int, list[str]]] = {}  # local store -> (mtime_ns, archives)
        self._index_names: tuple[tuple[frozenset[str], frozenset[str]], list[str]] | None = None

    # -- model folders -----------------------------------------------------------------

    async def scan(self) -> tuple[dict[str, ModelSource], dict[str, str]]:
        """Every model folder of the local repositories, and the names in more than one."""
        return await self._pool.run(self._repository.scan)

    async def lookup(self, name: str) -> ModelSource | None:
        """The model folder ``name``: a direct look at ``<repository>/<name>`` first (listing
        1,000 folders per on-demand miss costs), then a scan."""
        source = await self._pool.run(self.find, name)
        if source is not None:
            return source
        sources, _ = await self.scan()
        return sources.get(name)

    def find(self, name: str) -> ModelSource | None:
        """Blocking (a load thread): the model folder ``name`` by a direct look (one ``stat``
        per repository, no listing); ``None`` when none or several have it."""
        return self._repository.find(name)

    async def fingerprint(self, source: ModelSource) -> str:
        """The fingerprint of ``source``'s files, remembered as the loaded one."""
        current = self._fingerprints[source.name] = await self._pool.run(fingerprint, source.path)
        return current

    def remember_fingerprint(self, name: str, value: str) -> None:
        """``value`` (:func:`fingerprint` of its folder, taken on a load thread) is the loaded one."""
        self._fingerprints[name] = value

    async def changed(self, source: ModelSource) -> bool:
        """Whether ``source``'s files differ from those last loaded (or it never loaded)."""
        return self._fingerprints.get(source.name) != await self._pool.run(fingerprint, source.path)

    def fingerprint_of(self, name: str) -> str:
        return self._fingerprints.get(name, "")

    def forget_fingerprint(self, name: str) -> None:
        self._fingerprints.pop(name, None)

    @property
    def fingerprinted(self) -> list[str]:
        """Models with a remembered fingerprint (loaded, or tried)."""
        return list(self._fingerprints)

    # -- keys and URLs -----------------------------------------------------------------

    async def is_key(self, name: str) -> bool:
        """Whether ``name`` would be served from a storage key (archive, S3 folder) rather
        than a local model folder: no local model folder (nor request-supplied files) has it."""
        if name in self._overrides:
            return False
        # one stat per repository: no listing of the repositories per miss
        return not await self._pool.run(self._repository.has, name)

    def key_stores(self, name: str) -> list[Storage]:
        """The stores in which ``name``, not a local model folder, is looked up as a key:
        local repositories hold archives next to their model folders; S3 ones hold archives
        and folders. NotFoundError when none may hold it."""
        if is_namespaced(name):
            raise NotFoundError(
                f"Request for unknown model: '{name}' is not found (a model of an archive is served only while the "
                "archive's own model is loaded)"
            )
        check_key_name(name)
        archive = is_archive_key(name)
        stores = [s for s in self._stores if archive or not isinstance(s, LocalStorage)]
        if not stores:
            raise NotFoundError(f"Request for unknown model: '{name}' is not found (no such model in the model repository)")
        return stores

    async def store_for_url(self, url: str) -> tuple[Storage, str]:
        """(storage, key) for a model location: ``s3://bucket/prefix/key``, a local archive
        or folder."""
        return await self._pool.run(self._store_for_url, url)

    def _store_for_url(self, url: str) -> tuple[Storage, str]:
        if url.startswith("s3://"):
            bucket, prefix = parse_s3_url(url)
            path = prefix.rstrip("/")
            if not path:
                raise InvalidArgumentError(f"url '{url}' names a bucket, not a model in it")
            parent, _, key = path.rpartition("/")
            location = f"s3://{bucket}/{parent}/" if parent else f"s3://{bucket}/"
            for store in self._stores:
                if store.location == location:
                    return store, key
            known = self._url_stores.get(location)
            if known is None:
                known = self._url_stores[location] = S3Storage(location, **self._s3_options)
            return known, key
        local = url.removeprefix("file://")
        if "://" in local:
            raise UnsupportedError(f"cannot load from '{url}': only s3:// URLs and local paths are supported")
        target = Path(os.path.abspath(local))
        if str(target).startswith(("/dev/", "/proc/", "/sys/")) or str(target) in ("/dev", "/proc", "/sys"):
            raise InvalidArgumentError(f"url '{url}' may not be under /dev, /proc or /sys")
        if not target.exists():
            raise NotFoundError(f"url '{url}' does not exist")
        if not target.is_dir() and not is_archive_key(target.name):
            raise InvalidArgumentError(f"url '{url}' is neither a folder nor a .tar.gz archive")
        folder = str(target.parent)
        local_store = self._url_stores.get(folder)
        if local_store is None:
            local_store = self._url_stores[folder] = LocalStorage(target.parent)
        return local_store, target.name

    async def stored_keys(self, *, refresh: bool = False) -> set[str]:
        """The keys every store serves: archives next to local model folders, archives and
        folders under S3 prefixes (a store that cannot be listed is left out, with a warning).

        An S3 store's listing (paginated, 1,000 keys a page) is kept for
        :data:`LISTING_TTL_S` seconds and listed again after, or at once with ``refresh``:
        the index of 10,000 archives is not 10 requests to S3 each time. A miss never needs
        the listing (it asks the store for its key)."""
        names: set[str] = set()
        for store in self._stores:
            if isinstance(store, LocalStorage):
                names.update(await self._pool.run(self._local_keys, store))
                continue
            cached = self._listings.get(store.location)
            now = time.monotonic()
            if refresh or cached is None or now - cached[0] > LISTING_TTL_S:
                keys = await self._pool.run(_stored_keys, store)
                cached = self._listings[store.location] = (now, keys)
            names.update(cached[1])
        return names

    def _local_keys(self, store: LocalStorage) -> list[str]:
        """:func:`_stored_keys` of a local repository, listed again only when the folder's
        modification time changed (blocking)."""
        try:
            mtime = os.stat(store.root).st_mtime_ns
        except OSError:
            return []
        cached = self._local_listings.get(store.location)
        if cached is None or cached[0] != mtime:
            cached = self._local_listings[store.location] = (mtime, _stored_keys(store))
        return cached[1]

    async def index_names(self, *, keys: bool) -> list[str]:
        """Every model folder's name (and with ``keys`` every stored key), sorted; the sorted
        list is kept while the listings it came from are unchanged."""
        sources, _ = await self.scan()
        stored = await self.stored_keys() if keys else set()
        token = (frozenset(sources), frozenset(stored))
        if self._index_names is None or self._index_names[0] != token:
            self._index_names = (token, sorted(set(sources) | stored))
        return self._index_names[1]

    # -- the disk cache ----------------------------------------------------------------

    async def fetch(self, served: str, key: str, stores: list[Storage], *, check_later: bool = False) -> CacheLease:
        """A lease on ``key`` from the first store that has it (fetched into the cache);
        ``check_later``: see :meth:`DiskCache.acquire`."""
        cache = await self._disk_cache()
        for store in stores:
            try:
                return await cache.acquire(key, store, check_later=check_later)
            except NotFoundError:
                continue
        where = ", ".join(s.location for s in stores)
        raise NotFoundError(f"Request for unknown model: '{served}' is not found (no archive or folder '{key}' in {where})")

    def expire(self, key: str) -> None:
        """The next fetch of ``key`` asks its store first (:meth:`DiskCache.expire`)."""
        if self._cache is not None:
            self._cache.expire(key)

    async def _disk_cache(self) -> DiskCache:
        """The model cache, started on first use. When the default folder is held by another
        server process, a private folder under the temp folder is used instead."""
        async with self._cache_lock:
            if self._cache is not None:
                return self._cache
            explicit = self._cache_dir is not None
            cache = self._new_cache(self._cache_dir or default_cache_dir())
            try:
                await cache.start()
            except InvalidArgumentError as exc:  # another process holds the folder
                if explicit:
                    raise UnavailableError(f"model cache: {exc}") from None
                private = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="quiver-model-cache-"))
                logger.warning("%s; using %s for this process", exc, private)
                self._cache_private = private
                cache = self._new_cache(private)
                await cache.start()
            except OSError as exc:
                raise UnavailableError(f"model cache: cannot open {cache.root}: {exc}") from None
            self._cache = cache
            return cache

    def _new_cache(self, root: Path) -> DiskCache:
        def downloaded(key: str, size: int, duration_ns: int) -> None:
            self._stats.downloading_time_us.observe(duration_ns / 1000)

        return DiskCache(
            root,
            self._cache_size,
            limits=self._archive_limits,
            on_download=downloaded,
            revalidate_timeout=self._cache_revalidate_timeout,
            run=self._pool.run,  # a copy's files checked on a load thread
            keep=CACHE_FOLDERS,  # the backends' folders in the same place
        )

    @property
    def disk_cache_stats(self) -> CacheStats | None:
        return self._cache.stats if self._cache is not None else None

    @property
    def disk_cache_usage(self) -> tuple[int, int]:
        if self._cache is None:
            return 0, 0
        return self._cache.bytes_used + self._cache.bytes_reserved, self._cache.max_bytes

    # -- files from a load request -----------------------------------------------------

    def overridden(self, name: str) -> bool:
        """Whether ``name`` serves request-supplied files."""
        return name in self._overrides

    async def write_override(self, name: str, files: dict[str, bytes]) -> ModelSource:
        """Write request-supplied model files to a private folder: ``<version>/<file>`` paths
        only (checked by :func:`check_file_paths` before anything is written)."""
        check_file_paths(list(files), name)

        def write() -> Path:
            root = Path(tempfile.mkdtemp(prefix="quiver-load-"))
            try:
                folder = root / name
                folder.mkdir()
                for relative, content in files.items():
                    target = folder / relative
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(content)
                (folder / CONFIG_FILENAME).write_text("")  # the config comes from the request
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                raise
            return root

        try:
            root = await self._pool.run(write)
        except OSError as exc:  # a full or read-only temporary folder: the server's state
            raise UnavailableError(
                f"failed to load '{name}': cannot write its files under {tempfile.gettempdir()}: {exc}"
            ) from None
        return ModelSource(name, root, root / name)

    async def settle_override(self, name: str, new_root: Path | None, loaded: bool) -> None:
        """After a load of ``name``: once it loaded, the files it served before go (and the
        new ones, if any, are kept); when it did not, the new files go."""
        if loaded:
            await self.drop_override(name)
            if new_root is not None:
                self._overrides[name] = new_root
        elif new_root is not None:
            await self._remove_tree(new_root)

    async def drop_override(self, name: str) -> None:
        root = self._overrides.pop(name, None)
        if root is not None:
            await self._remove_tree(root)

    async def _remove_tree(self, root: Path) -> None:
        await self._pool.run(shutil.rmtree, root, True)

    async def close(self) -> None:
        """Delete request-supplied files, close the disk cache (and its private folder)."""
        for name in list(self._overrides):
            await self.drop_override(name)
        if self._cache is not None:
            await self._cache.close()
        if self._cache_private is not None:
            await self._remove_tree(self._cache_private)


def _stored_keys(store: Storage) -> list[str]:
    """The keys a store serves (blocking): archives next to a local repository's model
    folders (top level only; no walk through the folders), archives and folders in S3."""
    if isinstance(store, LocalStorage):
        try:
            with os.scandir(store.root) as entries:
                return [
                    e.name
                    for e in entries
                    if is_archive_key(e.name) and not e.name.startswith(".") and e.is_file()
                ]
        except OSError as exc:
            logger.warning("listing archives in %s failed: %s", store.location, exc)
            return []
    try:
        return model_keys(store.list())
    except Exception as exc:  # a store that is down must not take the index down with it
        logger.warning("listing models in %s failed: %s", store.location, exc)
        return []
