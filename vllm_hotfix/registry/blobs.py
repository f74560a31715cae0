"""Files of an image read from its registry's blobs, for a GPU host the Docker engine never sees.

Where a Kubernetes Job starts the image, the copy judged must be the one the
cluster pulls: the registry's. This reader (an
:class:`~vllm_hotfix.sitefacts.site.FileSource`) takes the image's manifest by
digest, its config blob (whose digest is the image ID every engine gives
it) and its layer blobs, each checked against its digest as it streams, and
lays the layers over each other as an engine would: a ``.wh.NAME`` entry
removes NAME from the layers below, a ``.wh..wh..opq`` entry empties its
folder of them, and an entry that is not a folder replaces whatever the
layers below held at its path and under it. Every regular file is hashed on
the one pass over the layers (a hard link may point outside the folders
asked for), and the image's entries are kept for later reads, so the layers
are downloaded once; a blob may not run past the size its manifest gives.
Nothing is written to disk and nothing of the image runs.

A zstd-compressed layer is read through :mod:`.compression`; one that is
not a readable tar makes the read fail with one line; the file checks are
then incomplete, never passed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import requests
import urllib3

from ..engine import ImageInfo
from ..engine.dockerconfig import registry_of
from ..engine.files import FileFact, Tree
from ..errors import EngineError, PushError
from ..layers import Layer, apply, within
from ..layers.read import checked
from . import client as registry
from .compression import STREAM_ERRORS, uncompressed

log = logging.getLogger(__name__)

CHUNK = 1 << 20


class _Verified:
    """A file-like view of a blob's bytes that hashes them as they pass; :meth:`finish` checks the digest."""

    def __init__(self, response: requests.Response, digest: str, size: int, where: str) -> None:
        self._raw = response.raw
        self._digest = digest
        self._size = size
        self._seen = 0
        self._hash = hashlib.sha256()
        self._where = where

    def read(self, n: int = -1) -> bytes:
        try:
            data = self._raw.read(n if n is not None and n >= 0 else None, decode_content=False)
        except (OSError, requests.RequestException, urllib3.exceptions.HTTPError) as exc:
            raise EngineError(f"{self._where}: the download broke off ({type(exc).__name__})") from None
        self._seen += len(data)
        if self._seen > self._size:
            raise EngineError(f"{self._where}: the registry sent more than the {self._size} bytes its manifest "
                              "gives")
        self._hash.update(data)
        return data

    def close(self) -> None:
        self._raw.close()

    def finish(self) -> None:
        while self.read(CHUNK):
            pass
        got = f"sha256:{self._hash.hexdigest()}"
        if got != self._digest:
            raise EngineError(f"{self._where}: its bytes hash to {got}, not to the digest the manifest names")


@dataclass(frozen=True, slots=True)
class LayerRef:
    digest: str
    media_type: str
    size: int


def diff_ids(info: ImageInfo) -> list[str]:
    return [str(d) for d in ((info.attrs or {}).get("RootFS") or {}).get("Layers") or []]


class RegistryReader:
    """Reads folders of one image from its layer blobs (a :class:`~vllm_hotfix.sitefacts.site.TreeReader`).

    The first read passes over every layer once and keeps the facts of the
    whole filesystem; later reads answer from them, passing over the layers
    again only for bytes a caller wants kept that the first pass did not keep.
    """

    def __init__(self, client: registry.Client, repo: str, layers: Sequence[LayerRef],
                 diff_ids: Sequence[str]) -> None:
        if len(diff_ids) != len(layers):
            raise EngineError(f"{client.host}/{repo}: its manifest names {len(layers)} layer(s), its config "
                              f"{len(diff_ids)} diff ID(s)")
        self._client = client
        self._repo = repo
        self._layers = tuple(layers)
        self._diff_ids = tuple(diff_ids)
        self._entries: dict[str, FileFact] | None = None
        self._kept: dict[str, bytes] = {}

    def blob(self, layer: LayerRef) -> _Verified:
        where = f"layer {layer.digest[:19]} of {self._client.host}/{self._repo}"
        try:
            res = self._client.request("GET", f"/v2/{self._repo}/blobs/{layer.digest}",
                                       f"repository:{self._repo}:pull", stream=True)
        except PushError as exc:
            raise EngineError(f"{where}: {exc}") from None
        if not res.ok:
            res.close()
            raise EngineError(f"{where}: the registry answered {res.status_code}")
        return _Verified(res, layer.digest, layer.size, where)

    def layer(self, index: int, keep: Callable[[str], bool] = lambda _p: False, keep_max: int | None = None
              ) -> Layer:
        """Layer ``index`` (manifest order) read from its blob: the blob checked against its digest, its
        uncompressed tar against the config's diff ID, before any of it is used."""
        ref = self._layers[index]
        where = f"layer {ref.digest[:19]} of {self._client.host}/{self._repo}"
        blob = self.blob(ref)
        try:
            layer = checked(uncompressed(blob, ref.media_type), self._diff_ids[index], where, keep=keep,
                            keep_max=keep_max)
            blob.finish()
        except STREAM_ERRORS as exc:
            blob.finish()  # bytes other than the manifest names are the first thing to say (a damaged gzip trailer)
            raise EngineError(f"{where} is not a readable tar: {exc}") from None
        finally:
            blob.close()
        return layer

    def _scan(self, keep: Callable[[str], bool]) -> tuple[dict[str, FileFact], dict[str, bytes]]:
        """Every entry of the image, its layers laid over each other (:func:`vllm_hotfix.layers.apply`); the bytes
        of the files ``keep`` names. Every regular file is hashed on the one pass (a hard link may point outside
        the folders asked for)."""
        entries: dict[str, FileFact] = {}
        kept: dict[str, bytes] = {}
        for index in range(len(self._layers)):
            apply(self.layer(index, keep), entries, kept)
        log.info("read %d entries of %s from %d layer blob(s)", len(entries), self._repo, len(self._layers))
        return entries, kept

    def read(self, paths: Sequence[str], keep: Callable[[str], bool] = lambda _p: False) -> Tree:
        """The entries under each of ``paths`` as the image's layers, laid over each other, hold them."""
        wanted = [posixpath.normpath(p) for p in paths]

        def under(path: str) -> bool:
            return any(within(path, w) for w in wanted)

        if self._entries is None or any(under(p) and keep(p) and p not in self._kept
                                        for p, f in self._entries.items() if f.kind in ("file", "hardlink")):
            self._entries, more = self._scan(lambda p: under(p) and keep(p))
            self._kept.update(more)
        entries = {p: f for p, f in self._entries.items() if under(p)}
        kept = {p: b for p, b in self._kept.items() if p in entries and keep(p)}
        missing = tuple(w for w in wanted if not any(within(p, w) for p in entries))
        return Tree(entries, kept, missing)


class RegistryFiles:
    """One image in a registry, by manifest digest: its facts and files without an engine (a FileSource)."""

    def __init__(self, client: registry.Client, repo: str, manifest_digest: str) -> None:
        self._client = client
        self._repo = repo
        self._digest = manifest_digest
        self._info: ImageInfo | None = None
        self._layers: tuple[LayerRef, ...] = ()

    @property
    def name(self) -> str:
        return f"{self._client.host}/{self._repo}@{self._digest}"

    def _load(self) -> ImageInfo:
        if self._info is not None:
            return self._info
        try:
            manifest = self._client.manifest(self._repo, self._digest)
        except PushError as exc:
            raise EngineError(f"cannot read {self.name}: {exc}") from None
        if manifest is None:
            raise EngineError(f"registry {self._client.host} has no {self._repo}@{self._digest}")
        if manifest.is_index:
            raise EngineError(f"{self.name} is an index: name one platform's image by its digest")
        doc = manifest.json()
        config = doc.get("config") or {}
        config_digest = str(config.get("digest") or "")
        if not config_digest.startswith("sha256:"):
            raise EngineError(f"{self.name}: its manifest names no config")
        body = self._small_blob(config_digest)
        try:
            conf: dict[str, Any] = json.loads(body)
        except ValueError:
            raise EngineError(f"{self.name}: its config blob is not JSON") from None
        layers = doc.get("layers")
        if not isinstance(conf, dict) or not isinstance(conf.get("config") or {}, dict) or not isinstance(
                layers, list) or not all(isinstance(d, dict) and str(d.get("digest", "")).startswith("sha256:")
                                         and isinstance(d.get("size"), int) for d in layers):
            raise EngineError(f"{self.name}: its manifest or config is not an image's (layers or config malformed)")
        self._layers = tuple(LayerRef(str(d["digest"]), str(d.get("mediaType") or ""), int(d["size"]))
                             for d in layers)
        rootfs: dict[str, Any] = conf["rootfs"] if isinstance(conf.get("rootfs"), dict) else {}
        self._info = ImageInfo.from_inspect({
            "Id": config_digest, "Config": conf.get("config") or {}, "Os": conf.get("os") or "linux",
            "RootFS": {"Type": "layers", "Layers": [str(d) for d in rootfs.get("diff_ids") or []]},
            "Architecture": conf.get("architecture") or "", "Variant": conf.get("variant") or "",
            "RepoDigests": [f"{self._client.host}/{self._repo}@{self._digest}"],
            "Size": sum(layer.size for layer in self._layers),
        })
        return self._info

    def _small_blob(self, digest: str) -> bytes:
        try:
            res = self._client.request("GET", f"/v2/{self._repo}/blobs/{digest}", f"repository:{self._repo}:pull")
        except PushError as exc:
            raise EngineError(f"cannot read the config of {self.name}: {exc}") from None
        if not res.ok:
            raise EngineError(f"cannot read the config of {self.name}: the registry answered {res.status_code}")
        if registry.sha256(res.content) != digest:
            raise EngineError(f"the config of {self.name} does not hash to its digest {digest}")
        return res.content

    def image(self, ref: str) -> ImageInfo | None:
        """This image when ``ref`` is its ID or manifest digest; None for any other (a base is not read here)."""
        info = self._load()
        return info if ref in (info.id, self._digest) else None

    def _reader(self) -> RegistryReader:
        info = self._load()
        return RegistryReader(self._client, self._repo, self._layers, diff_ids(info))

    def top_layers(self, count: int, keep: Callable[[str], bool] = lambda _p: False,
                   keep_max: int | None = None) -> list[Layer]:
        """The image's top ``count`` layers, bottom first, one download at a time; each blob read to its end and
        checked against its digest, its uncompressed tar against the config's diff ID."""
        reader = self._reader()
        return [reader.layer(i, keep, keep_max) for i in range(len(self._layers) - count, len(self._layers))]

    @contextmanager
    def files(self, image: str) -> Iterator[RegistryReader]:
        info = self._load()
        if image not in (info.id, self._digest):
            raise EngineError(f"{self.name} holds image {info.id[:19]}, not {image[:19]}")
        yield self._reader()


def for_reference(client_for: Callable[[str], registry.Client], ref: str) -> RegistryFiles:
    """``HOST/REPO@sha256:...`` as a :class:`RegistryFiles`, with the client ``client_for(host)`` gives."""
    name, _, digest = ref.partition("@")
    if not digest.startswith("sha256:"):
        raise EngineError(f"{ref}: name the image by digest (NAME@sha256:...)")
    head, _, last = name.rpartition("/")
    name = f"{head}/{last.partition(':')[0]}" if head else last.partition(":")[0]  # NAME:TAG@DIGEST: the digest
    if registry_of(name) == "docker.io":
        hub, path = registry.docker_hub(name)
        return RegistryFiles(hub, path, digest)
    try:
        host, path = registry.split_repo(name)
    except PushError as exc:
        raise EngineError(str(exc)) from None
    return RegistryFiles(client_for(host), path, digest)
