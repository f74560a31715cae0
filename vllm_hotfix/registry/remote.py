"""A base image read from its registry: the manifest (or each platform's, from an index), the config, and
its layer blobs opened as streams; the client of each registry with the login Docker's config holds and
TLS as a Docker engine on this host would use it, without asking one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine import ImageInfo, registry_credentials, registry_of, split_reference
from ..engine.dockerconfig import registry_secure_without_engine
from ..errors import BaseImageError
from . import client as registry
from . import compression
from .layerscan import LayerRef
from .write import Repo


def repo_of(ref: str) -> tuple[Repo, str]:
    """The repository ``ref`` names, its client (login from Docker's config, TLS as an engine here would), and
    its tag or digest."""
    name, tag = split_reference(ref)
    if registry_of(ref) == "docker.io":
        hub, path = registry.docker_hub(name)
        return Repo(hub, path), tag
    host, path = registry.split_repo(name)
    client = registry.Client(host, secure=registry_secure_without_engine(host), credentials=registry_credentials(host))
    return Repo(client, path), tag


@dataclass
class Base:
    """One platform's base image as its registry holds it."""

    ref: str
    repo: Repo
    manifest: registry.Manifest
    config_digest: str
    config: dict[str, Any]
    layers: list[dict[str, Any]]
    bytes_read: int

    @property
    def os_arch(self) -> tuple[str, str, str]:
        """(os, architecture, variant) as its config gives them."""
        return (str(self.config.get("os") or ""), str(self.config.get("architecture") or ""),
                str(self.config.get("variant") or ""))

    def info(self) -> ImageInfo:
        name, _ = split_reference(self.ref)
        return ImageInfo.from_inspect({
            "Id": self.config_digest, "Config": self.config.get("config") or {}, "Os": self.config.get("os") or "",
            "Architecture": self.config.get("architecture") or "", "Variant": self.config.get("variant") or "",
            "RepoDigests": [f"{name}@{self.manifest.digest}"], "Size": sum(int(d["size"]) for d in self.layers)})


def read_blob(repo: Repo, digest: str, what: str) -> bytes:
    res = repo.client.request("GET", f"/v2/{repo.path}/blobs/{digest}", repo.pull)
    if not res.ok:
        raise BaseImageError(f"cannot read the {what} of {repo.name}: the registry answered {res.status_code}")
    if registry.sha256(res.content) != digest:
        raise BaseImageError(f"the {what} of {repo.name} does not hash to its digest {digest}")
    return res.content


def read_base(repo: Repo, ref: str, manifest: registry.Manifest) -> Base:
    doc = manifest.json()
    config_digest = str((doc.get("config") or {}).get("digest") or "")
    layers = doc.get("layers")
    if (not config_digest.startswith("sha256:") or not isinstance(layers, list)
            or not all(isinstance(d, dict) and str(d.get("digest", "")).startswith("sha256:")
                       and isinstance(d.get("size"), int) for d in layers)):
        raise BaseImageError(f"{ref}: its manifest is not an image's (config or layers malformed)")
    raw = read_blob(repo, config_digest, "config")
    try:
        config = json.loads(raw)
    except ValueError:
        raise BaseImageError(f"{ref}: its config blob is not JSON") from None
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") if isinstance(config, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
        raise BaseImageError(f"{ref}: its config names {len(diff_ids or [])} layers, its manifest {len(layers)}")
    return Base(ref, repo, manifest, config_digest, config, layers, manifest.size + len(raw))


def check_layer_heads(base: Base) -> None:
    """Refuse a base layer whose first bytes contradict its media type (zstd's frame under a gzip type, ...), for
    every layer of ``base``: those a build only carries over by digest are never read through the check that
    streams them (:mod:`.compression`), and a manifest that misnames one is malformed all the same.

    Each blob is asked for its first bytes alone (a range; a registry that ignores it is left after them)."""
    for index, layer in enumerate(base.layers, 1):
        digest, media_type = str(layer["digest"]), str(layer.get("mediaType") or "")
        if "foreign" in media_type or "nondistributable" in media_type:
            continue  # its bytes live at the URLs it names, not in this registry (and it is never mounted)
        where = f"layer {index}/{len(base.layers)} ({digest[:19]}) of {base.repo.name}"
        res = base.repo.client.request("GET", f"/v2/{base.repo.path}/blobs/{digest}", base.repo.pull, stream=True,
                                       headers={"Range": f"bytes=0-{compression.HEAD - 1}"})
        try:
            if not res.ok:
                raise BaseImageError(f"cannot read {where}: the registry answered {res.status_code}")
            head = b""
            while len(head) < compression.HEAD:
                got = res.raw.read(compression.HEAD - len(head), decode_content=False)
                if not got:
                    break
                head += got
        finally:
            res.close()
        problem = compression.disagreement(head, media_type)
        if problem:
            raise BaseImageError(f"{where}: {problem}; its manifest misnames the layer",
                                 hint="fix the base's manifest (each layer's media type as its bytes are "
                                      "compressed), or build from the engine")


def opener(repo: Repo) -> Callable[[LayerRef], Any]:
    def open_blob(layer: LayerRef) -> Any:
        res = repo.client.request("GET", f"/v2/{repo.path}/blobs/{layer.digest}", repo.pull, stream=True)
        if not res.ok:
            res.close()
            raise BaseImageError(f"cannot read layer {layer.digest[:19]} of {repo.name}: the registry answered "
                                 f"{res.status_code}")
        return _Raw(res)

    return open_blob


class _Raw:
    def __init__(self, res: Any) -> None:
        self._res = res

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._res.raw.read(None if n is None or n < 0 else n, decode_content=False)
        return data

    def close(self) -> None:
        self._res.close()
