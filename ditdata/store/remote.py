"""Stores in object storage: a URL opens as a read-only, checksum-verified local mirror.

    store = open_store("s3://bucket/store", cache_dir="~/cache", cache_limit="20GiB")

Any URL that fsspec knows (http://, https://, s3://, gs://, ...; file:// and plain paths
stay local) is read through fsspec (pip install 'ditkit[remote]'). Opening fetches
manifest.json and validates it like a local one; nothing else. The first read of a shard
downloads the files the manifest lists for it into the cache, checks each file's size and
sha256 ON ARRIVAL (a mismatch is a one-line StoreError naming the shard, the file and its
URL, and the data is never used), and publishes the shard in the cache by one rename, so
the cache, like a store, never shows a half shard under its final name. The local readers
then read the cached copy.

Cache layout (CACHE is --cache-dir; default $XDG_CACHE_HOME/ditkit/stores or
~/.cache/ditkit/stores):

    CACHE/.ditkit-cache.lock          held while the cache's size is accounted and trimmed
    CACHE/<identity>/manifest.json    the mirrored manifest (identity: its digest's first 16 hex)
    CACHE/<identity>/origin.json      the URL it came from
    CACHE/<identity>/shards/...       complete shards, exactly as in the store
    CACHE/<identity>/.locks/N.lock    shard N's lock; its mtime is the shard's last use
    CACHE/<identity>/.partial/N/      shard N being downloaded (removed before each try)

Processes sharing a cache (the streaming loader's workers, several runs) coordinate with
flock(2) on the shard's lock file: a download holds it exclusively (so a shard is fetched
once, and the others wait for it), a reader holds it shared while it reads the shard (this
process's most recent shard stays held until it moves to another one). Keeping the cache
under its limit removes the least recently used complete shards whose lock it can take
exclusively at once, so a shard someone is reading is never removed; the cache can then
exceed the limit by the shards being read at that moment. A limit smaller than the
store's largest shard is refused.

Transient failures (connection reset or dropped part way, timeouts, HTTP 5xx / 408 /
429) are retried with exponential backoff (RETRIES tries, BACKOFF_S doubling up to
MAX_BACKOFF_S); a file that arrives with the wrong size or digest is downloaded once more
before it is reported. Authentication failures (401/403, missing credentials) and missing
objects (404) are not retried: a one-line StoreError says which URL and what to do.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
import uuid
from contextlib import suppress
from pathlib import Path

from ditdata.common import bytesize, cache, files
from ditdata.common.errors import described
from ditdata.common.extras import missing_extra
from ditdata.common.lock import closed_in_forked_children

from . import manifest
from .errors import StoreError
from .reader import FeatureSet, Store

DEFAULT_CACHE_LIMIT = 50 * 2**30  # bytes (50 GiB): room for ImageNet-256 latents with flips
RETRIES = 5  # tries per file for transient errors
BACKOFF_S = 0.5  # the wait after the first failed try; doubles after each
MAX_BACKOFF_S = 8.0
CACHE_LOCK = ".ditkit-cache.lock"
CREDENTIALS_HINT = ("set credentials for it: s3:// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                    "gs:// GOOGLE_APPLICATION_CREDENTIALS (or `gcloud auth application-default login`)")


def parse_size(text, what: str = "--cache-limit") -> int:
    """Bytes of a size flag (ditdata.common.bytesize), a bad one as a StoreError."""
    try:
        return bytesize.parse_size(text, what)
    except ValueError as e:
        raise StoreError(str(e)) from None


def default_cache_dir() -> Path:
    return cache.cache_dir("stores")


# ---------------------------------------------------------------------------------------
# The remote side: fsspec, retries, readable errors
# ---------------------------------------------------------------------------------------
def _kind(e: BaseException) -> str:
    """'missing', 'auth', 'transient' or 'fatal' for an exception from an fsspec backend."""
    if isinstance(e, FileNotFoundError):
        return "missing"
    if isinstance(e, PermissionError):
        return "auth"
    status = getattr(e, "status", None) or getattr(e, "code", None)  # aiohttp / gcsfs
    if isinstance(status, int) and 400 <= status < 600:
        if status in (401, 403):
            return "auth"
        if status == 404:
            return "missing"
        return "transient" if status in (408, 429) or status >= 500 else "fatal"
    if "Credentials" in type(e).__name__:  # botocore's NoCredentialsError, PartialCredentialsError
        return "auth"
    if isinstance(e, ConnectionError | TimeoutError | asyncio.TimeoutError | OSError):
        return "transient"
    module = type(e).__module__ or ""
    if module.split(".")[0] in ("aiohttp", "botocore", "aiobotocore", "urllib3", "requests", "google"):
        return "transient"  # their connection, payload and read errors
    return "fatal"


class Remote:
    """A store's location in object storage: fetch its files, retrying what may pass."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        try:
            import fsspec
        except ImportError as e:
            raise missing_extra(f"{url}: reading stores from URLs", "remote", e, StoreError) from None
        try:
            self.fs, self.base = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except ImportError as e:  # the protocol's package (aiohttp, s3fs, gcsfs) is absent
            raise missing_extra(f"{url}: reading this URL", "remote", e, StoreError) from None
        except ValueError as e:
            raise StoreError(f"{url}: not a URL fsspec can read ({described(e)})") from None
        self.base = self.base.rstrip("/")

    def _retry(self, rel: str, action):
        url = f"{self.url}/{rel}"
        for attempt in range(RETRIES):
            try:
                return action(f"{self.base}/{rel}")
            except Exception as e:
                kind = _kind(e)
                if kind == "missing":
                    raise StoreError(f"{url}: not found (missing object); check the URL, or finish uploading "
                                     "the store") from None
                if kind == "auth":
                    raise StoreError(f"{url}: access denied ({described(e)}); the credentials are missing or "
                                     f"invalid: {CREDENTIALS_HINT}") from None
                if kind == "fatal" or attempt == RETRIES - 1:
                    tries = f" after {attempt + 1} tries" if attempt else ""
                    raise StoreError(f"{url}: download failed{tries} ({described(e)})") from None
                time.sleep(min(MAX_BACKOFF_S, BACKOFF_S * 2**attempt))

    def read_bytes(self, rel: str) -> bytes:
        return self._retry(rel, self.fs.cat_file)

    def fetch(self, rel: str, dest: Path, meta: dict, what: str) -> None:
        """Download `rel` to `dest` and check its size and sha256 against `meta`."""
        for again in (True, False):
            self._retry(rel, lambda path: self.fs.get_file(path, str(dest)))
            size = dest.stat().st_size
            if size == meta["size"] and files.sha256_file(dest) == meta["sha256"]:
                return
            if again:  # a transfer cut short without an error: once more before blaming the server
                time.sleep(BACKOFF_S)
                continue
            problem = (f"{size} bytes, the manifest records {meta['size']}" if size != meta["size"]
                       else "sha256 differs from the manifest")
            dest.unlink(missing_ok=True)
            raise StoreError(f"{self.url}/{rel}: {what}, file {rel}: checksum mismatch on arrival ({problem}); "
                             "the copy in object storage is corrupt: re-upload the store (the data was not used)")


# ---------------------------------------------------------------------------------------
# The local side: the cache and its locks
# ---------------------------------------------------------------------------------------
_pins = closed_in_forked_children()  # lock descriptors this process holds


def _shard_bytes(rec: dict) -> int:
    return sum(int(m["size"]) for m in rec["files"].values())


class Cache:
    """A cache directory holding mirrors of remote stores, trimmed to `limit` bytes."""

    def __init__(self, directory=None, limit=None):
        self.dir = Path(directory).expanduser() if directory else default_cache_dir()
        self.limit = DEFAULT_CACHE_LIMIT if limit in (None, "") else parse_size(limit)
        if self.limit <= 0:
            raise StoreError(f"--cache-limit {limit!r}: must be a positive size, e.g. 20GiB")

    def make_room(self, need: int) -> None:
        """Remove least recently used complete shards, not in use, until `need` more bytes fit."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / CACHE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            entries = list(self._entries())
            total = sum(e[1] for e in entries)
            for _, size, lock, final in sorted(entries, key=lambda e: e[0]):
                if total + need <= self.limit:
                    break
                if _evict(lock, final):
                    total -= size
        finally:
            os.close(fd)

    def _entries(self):
        """(last use, bytes, lock file, path) of every complete shard in the cache."""
        for mirror in self.dir.iterdir():
            try:
                m = files.read_json(mirror / manifest.MANIFEST)
                records = list(enumerate(m["shards"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            for i, rec in records:
                final = mirror / rec["path"]
                if final.exists():
                    lock = _lock_path(mirror, i)
                    try:
                        used = lock.stat().st_mtime
                    except OSError:
                        used = 0.0
                    yield used, _shard_bytes(rec), lock, final


def _lock_path(mirror: Path, index: int) -> Path:
    return mirror / ".locks" / f"{index:06d}.lock"


def _evict(lock: Path, final: Path) -> bool:
    """Remove a complete shard if nobody holds its lock (else leave it: it is in use)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not final.exists():
            return False
        doomed = final.parent / f".evicted-{uuid.uuid4().hex[:8]}-{final.name}"
        os.replace(final, doomed)  # gone from its name at once; deleted at leisure
    finally:
        os.close(fd)
    files.remove(doomed)
    return True


# ---------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------
class RemoteStore(Store):
    """A store at a URL, read through a local cache (module docstring). `root` is the
    local mirror directory; `url` the store's location, which `location` reports."""

    manifest_kind = "store"  # what its manifest must be (manifest.validate)

    def __init__(self, url: str, *, cache_dir=None, cache_limit=None, storage_options: dict | None = None,
                 verify: bool = False, identity: str | None = None):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.cache = Cache(cache_dir, cache_limit)
        self.remote = Remote(self.url, self.storage_options)
        m = self._manifest(identity)
        self.root = self.cache.dir / manifest.identity(m).removeprefix("sha256:")[:16]
        self._lazy = True  # opening checks nothing but the manifest: shards are checked on arrival
        self._pinned: tuple[int, int, int] | None = None  # (shard index, lock fd, pid)
        self._load(m, verify=False)
        self._lazy = False
        largest = max(self.shards, key=lambda s: _shard_bytes(s.record), default=None)
        if largest is not None and _shard_bytes(largest.record) > self.cache.limit:
            raise StoreError(f"--cache-limit {bytesize.format_size(self.cache.limit)} is smaller than the largest shard of "
                             f"{self.url} ({largest.name}, {bytesize.format_size(_shard_bytes(largest.record))}); "
                             "give at least that (a few shards' worth is better)")
        self._mirror(m)
        if verify:
            for shard in self.shards:
                self._check_files(shard, digests=True)

    def _manifest(self, identity: str | None) -> dict:
        where = f"{self.url}/{manifest.MANIFEST}"
        if identity is not None:  # a worker of a loader: the mirror's copy, no request
            local = self.cache.dir / identity.removeprefix("sha256:")[:16] / manifest.MANIFEST
            if local.is_file():
                m = files.read_json(local)
                manifest.validate(m, local, self.manifest_kind)
                if manifest.identity(m) == identity:
                    return m
        try:
            raw = self.remote.read_bytes(manifest.MANIFEST)
        except StoreError as e:
            if "not found" in str(e):
                raise StoreError(f"{where}: not found; {self.url} is not a latent store (or its upload has not "
                                 "finished: manifest.json is copied last)") from None
            raise
        try:
            m = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"{where}: not valid JSON ({e})") from None
        manifest.validate(m, where, self.manifest_kind)
        if identity is not None and manifest.identity(m) != identity:
            raise StoreError(f"{self.url}: the store changed while it was being read (its manifest's identity "
                             "differs); restart on the new store")
        return m

    def _mirror(self, m: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.root / manifest.MANIFEST).is_file():
            files.write_json_atomic(self.root / "origin.json", {"url": self.url})
        # (again when it changed without changing the identity: feature sets added since)
        if files.read_json_or_none(self.root / manifest.MANIFEST) != m:
            files.write_json_atomic(self.root / manifest.MANIFEST, m)

    # -- what the rest of the code asks a store --------------------------------------
    @property
    def location(self) -> str:
        return self.url

    def open_args(self) -> dict:
        return {"root": self.url, "cache_dir": str(self.cache.dir), "cache_limit": self.cache.limit,
                "storage_options": self.storage_options, "identity": self.identity}

    def read(self, shard, fields=None, start: int = 0, stop: int | None = None):
        s = self.shard(shard)
        self._pin(s)
        return super().read(s, fields, start, stop)

    def _check_files(self, shard, digests: bool) -> None:
        if self._lazy:
            return
        self._pin(shard)
        if digests:  # the cached copy too (it arrived verified; this catches later damage)
            super()._check_files(shard, digests=True)

    # -- the cached copy of a shard -----------------------------------------------------
    def _pin(self, shard) -> None:
        """Make the shard complete in the cache and hold it (shared) until the next one."""
        pid = os.getpid()
        if self._pinned is not None and self._pinned[2] != pid:
            self._pinned = None  # inherited through fork: the descriptor is not ours
        if self._pinned is not None and self._pinned[0] == shard.index:
            return
        # The previous shard's reads are done (read() returns copies): let it go first, so
        # making room for this one may remove it.
        self.release()
        self._pinned = (shard.index, self._acquire(shard), pid)

    def _acquire(self, shard) -> int:
        lock = _lock_path(self.root, shard.index)
        lock.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            _pins.add(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if not shard.path.exists():
                    fcntl.flock(fd, fcntl.LOCK_EX)  # (drops the shared lock first: no deadlock)
                    if not shard.path.exists():
                        self._download(shard)
                    fcntl.flock(fd, fcntl.LOCK_SH)
                if shard.path.exists():  # (converting a lock is not atomic: check once more)
                    os.utime(lock)  # its last use, for the eviction order
                    return fd
            except BaseException:
                _unpin(fd)
                raise
            _unpin(fd)

    def _download(self, shard) -> None:
        self.cache.make_room(_shard_bytes(shard.record))
        part = self.root / ".partial" / f"{shard.index:06d}"
        files.remove(part)  # a try killed part way (we hold the shard's lock: nobody else writes it)
        for rel, meta in shard.record["files"].items():
            dest = part / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.remote.fetch(rel, dest, meta, f"shard {shard.name!r}")
        staged = part / shard.record["path"]
        files.fsync_tree(staged)
        shard.path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, shard.path)
        files.fsync_dir(shard.path.parent)
        files.remove(part)

    def release(self) -> None:
        """Let go of the shard this store holds (it becomes evictable)."""
        if self._pinned is not None and self._pinned[2] == os.getpid():
            _unpin(self._pinned[1])
        self._pinned = None

    def __del__(self):
        with suppress(Exception):
            self.release()


def _unpin(fd: int) -> None:
    _pins.discard(fd)
    with suppress(OSError):
        os.close(fd)


class RemoteFeatureSet(RemoteStore, FeatureSet):
    """Feature set `name` of a RemoteStore: its own mirror in the same cache (keyed by the
    feature set's identity), its shards downloaded and checked on first read like the store's."""

    manifest_kind = manifest.FEATURES_KIND

    def __init__(self, store: RemoteStore, name: str, *, identity: str | None = None, verify: bool = False):
        entry = store.manifest["features"][name]
        super().__init__(f"{store.url}/{entry['path']}", cache_dir=store.cache.dir, cache_limit=store.cache.limit,
                         storage_options=store.storage_options, identity=identity, verify=verify)
