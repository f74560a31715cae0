"""The facts cache's storage: content-addressed blobs and indexes only this host can have written.

What a base image said about itself (and the patch results and bytecode made
from its files) is kept under ``build/cache/bases/<image ID>/`` so that a
second build on the same base starts no container:

- ``blobs/<sha256>``: a file's bytes, named by their own hash;
- ``index/<name>.json``: the facts and, per path, the hash of its blob,
  with an HMAC-SHA256 over the index's name, its image and its text.

Why a MAC and not only hashes: someone who can write ``build/`` can change a
cached file's bytes *and* the hash recorded beside them (the poisoned-cache
attack: one line added to a cached ``indexer.py``, its hash recomputed, and
the image carried the line). A hash kept in the same folder checks only for
damage. The MAC's key is a random secret of this host, kept outside the
project (``$XDG_STATE_HOME/vllm-hotfix/cache.key``, else
``~/.local/state/...``, mode 0600, created on first use), so whoever can
rewrite the cache cannot write an index this host will accept; and each blob
must hash to the name the accepted index gives it, so no blob can be swapped
under it. The MAC also covers the image folder and the index's name: an index
cannot be moved to another image or another key.

Re-deriving each file's hash from the image's dist-info RECORD on every read
was the other way: it needs RECORD read from the image on each build (the
container or the layer export the cache is there to save), and RECORD says
nothing of patch results or bytecode, which this cache keeps too.

The key is as safe as the account that owns it: whoever can read it can
forge an index, and could equally change the tool itself. A key file others
can read or write, or one inside the cache, is not used (a warning, then no
cache). Any mismatch (a MAC, a blob's hash, an unreadable file) is a miss
with one warning line naming the entry; the caller reads the image again and
the fresh entry replaces the bad one.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StorageError
from .atomic import write_atomic

log = logging.getLogger(__name__)

FORMAT = 3
KEY_BYTES = 32


def key_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "vllm-hotfix" / "cache.key"


@functools.cache
def _host_key(path: Path) -> bytes | None:
    """The host's cache key at ``path``, made on first use; None (after one warning) if it cannot be trusted."""
    try:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            try:
                write_atomic(path, os.urandom(KEY_BYTES), exclusive=True, mode=0o600)
            except StorageError:
                if not path.exists():  # else another run made it first: read theirs
                    raise
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            key = os.read(fd, KEY_BYTES + 1)
        finally:
            os.close(fd)
    except (OSError, StorageError) as exc:
        log.warning("facts cache off: cannot read or make its key %s: %s", path, exc)
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.warning("facts cache off: its key %s must be a file of this user that no one else can read or "
                    "write (chmod 600)", path)
        return None
    if len(key) != KEY_BYTES:
        log.warning("facts cache off: its key %s is not %d bytes; remove it to make a new one", path, KEY_BYTES)
        return None
    return key


def host_key(cache_root: Path) -> bytes | None:
    """The key for indexes under ``cache_root``; None when none can be trusted (no caching then)."""
    path = key_path()
    try:
        inside = path.resolve().is_relative_to(cache_root.resolve())
    except OSError:
        inside = True
    if inside:
        log.warning("facts cache off: its key %s lies inside the cache %s it is there to check", path, cache_root)
        return None
    return _host_key(path)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class Store:
    """One base image's cache folder, read and written through checks."""

    folder: Path  # build/cache/bases/<image ID hex>
    key: bytes

    @classmethod
    def open(cls, cache_root: Path, image_id: str) -> Store | None:
        key = host_key(cache_root)
        if key is None:
            return None
        return cls(cache_root / "bases" / image_id.removeprefix("sha256:"), key)

    # -- blobs ---------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        return self.folder / "blobs" / digest

    def put(self, data: bytes) -> str:
        """Keep ``data`` under its hash (once) and return the hash."""
        digest = sha256(data)
        path = self.blob_path(digest)
        if self._blob(path) != digest:  # absent, or damaged: write it (again)
            write_atomic(path, data)
        return digest

    @staticmethod
    def _blob(path: Path) -> str | None:
        try:
            return sha256(path.read_bytes())
        except OSError:
            return None

    def get(self, digest: object, what: str) -> bytes | None:
        """The blob named ``digest``, or None (with one warning) if it is missing or its bytes are not that hash."""
        if not isinstance(digest, str) or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            log.warning("facts cache: %s names no blob (%r); reading it from the image again", what, digest)
            return None
        path = self.blob_path(digest)
        try:
            data = path.read_bytes()
        except OSError as exc:
            log.warning("facts cache: blob %s of %s cannot be read (%s); reading it from the image again",
                        path, what, exc.strerror or exc)
            return None
        if sha256(data) != digest:
            log.warning("facts cache: blob %s of %s does not hash to its name; reading it from the image again",
                        path, what)
            return None
        return data

    # -- indexes -------------------------------------------------------------

    def index_path(self, name: str) -> Path:
        return self.folder / "index" / f"{name}.json"

    def _mac(self, name: str, text: str) -> str:
        message = "\0".join((f"vllm-hotfix cache {FORMAT}", self.folder.name, name, text)).encode()
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def read(self, name: str) -> dict[str, Any] | None:
        """The index ``name`` if this host wrote it as it stands; None if absent or (with one warning) not."""
        path = self.index_path(name)
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("facts cache: %s cannot be read (%s); reading the image again", path, exc)
            return None
        try:
            outer = json.loads(raw)
            text, mac = outer["body"], outer["mac"]
            if not isinstance(text, str) or not isinstance(mac, str):
                raise TypeError("body and mac must be strings")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("facts cache: %s is not a cache index (%s); reading the image again", path, exc)
            return None
        if not hmac.compare_digest(mac, self._mac(name, text)):
            log.warning("facts cache: %s was not written by this host as it stands (its MAC does not match); "
                        "reading the image again", path)
            return None
        try:
            body = json.loads(text)
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def write(self, name: str, body: dict[str, Any]) -> None:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        write_atomic(self.index_path(name), json.dumps({"mac": self._mac(name, text), "body": text}))
