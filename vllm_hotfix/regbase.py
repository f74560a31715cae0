"""A base image read from its registry: the manifest (or each platform's, from an index), the config, and
its layer blobs opened as streams; the client of each registry with the login Docker's config holds and
TLS as a Docker engine on this host would use it, without asking one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import platforms, registry
from .engine import ImageInfo, registry_credentials, registry_of, split_reference
from .engine.dockerconfig import registry_secure_without_engine
from .errors import BaseImageError
from .layerscan import LayerRef
from .platforms import Platform
from .regwrite import Repo


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
    def platform(self) -> Platform | None:
        return platforms.of(str(self.config.get("os") or ""), str(self.config.get("architecture") or ""))

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


def bases(base_ref: str, wanted: list[Platform] | None, asked: bool, say: Callable[[str], None]
          ) -> tuple[dict[Platform | None, Base], registry.Manifest]:
    """Each platform's base (None: the one image a plain manifest names, built under the plain tag)."""
    repo, tag = repo_of(base_ref)
    say(f"==> reading base {base_ref} from {repo.client.host}")
    top = repo.client.manifest(repo.path, tag)
    if top is None:
        raise BaseImageError(f"registry {repo.client.host} has no {base_ref}",
                             hint="check --base/--base-repo, or push the base there first")
    name, _ = split_reference(base_ref)
    if not top.is_index:
        one = read_base(repo, base_ref, top)
        if not asked:
            return {None: one}, top
        plat = one.platform
        if wanted is not None and (len(wanted) != 1 or wanted[0] != plat):
            raise BaseImageError(f"base {base_ref} is one {one.config.get('os')}/{one.config.get('architecture')} "
                                 f"image, not an index over {', '.join(map(str, wanted))}")
        return {plat: one}, top
    offered: dict[Platform, str] = {}
    for kid in registry.children(top):
        plat = platforms.of(kid.os, kid.architecture, kid.variant)
        if plat is not None and plat not in offered:
            offered[plat] = kid.digest
    chosen = wanted if wanted is not None else list(offered)
    lacking = [str(w) for w in chosen if w not in offered]
    if lacking:
        raise BaseImageError(f"base {base_ref} is an index over {', '.join(map(str, offered)) or 'nothing'}; "
                             f"it has no {', '.join(lacking)} image")
    say(f"    base {base_ref} is an index ({top.digest}); building for {', '.join(map(str, chosen))}")
    out: dict[Platform | None, Base] = {}
    for plat in chosen:
        found = repo.client.manifest(repo.path, offered[plat])
        if found is None or found.is_index:
            raise BaseImageError(f"{name}@{offered[plat]} ({plat}) is not an image in {repo.client.host}")
        out[plat] = read_base(repo, f"{name}@{offered[plat]}", found)
        if out[plat].platform != plat:
            raise BaseImageError(f"{name}@{offered[plat]} is listed as {plat} but its config says otherwise")
    return out, top


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
