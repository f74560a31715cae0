"""Gzipped layer tars of a base with vLLM installed, and a registry stand-in that serves them by digest: what the
unit tests of the registry's layer scan read (no registry, no engine)."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile

from vllm_hotfix.registry.layerscan import LayerRef, Located, locate

SITE = "usr/local/lib/python3.12/dist-packages"
REL = "vllm/models/m/indexer.py"
RECORD = b"vllm/__init__.py,,\nvllm/models/m/indexer.py,,\n"
META = b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.25.1\n"


def member(name: str, data: bytes | None = None, *, kind: str = "file", mode: int = 0o644, mtime: int = 7,
           target: str = "") -> tuple[str, bytes | None, str, int, int, str]:
    return (name, data, kind, mode, mtime, target)


def layer(members: list[tuple[str, bytes | None, str, int, int, str]], *, ordered: bool = True,
          unique: bool = True) -> bytes:
    """A gzipped layer tar; a path listed twice is written once (the last), unless ``unique`` is False."""
    raw = io.BytesIO()
    kept = list({m[0]: m for m in members}.values()) if unique else members  # one entry per path, as a layer has
    items = sorted(kept, key=lambda m: m[0].split("/")) if ordered else kept
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, kind, mode, mtime, target in items:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = mode, mtime
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, target
                tar.addfile(info)
            else:
                info.size = len(data or b"")
                tar.addfile(info, io.BytesIO(data or b""))
    return gzip.compress(raw.getvalue(), mtime=0)


def folders(path: str) -> list[tuple[str, bytes | None, str, int, int, str]]:
    parts = path.split("/")
    return [member("/".join(parts[:i]), kind="dir", mode=0o755, mtime=i) for i in range(1, len(parts) + 1)]


def installed(indexer: bytes = b"x = 1\n", extra: list | None = None) -> list:
    return [*folders(f"{SITE}/vllm/models/m"), member(f"{SITE}/vllm/__init__.py", b""),
            member(f"{SITE}/{REL}", indexer), *folders(f"{SITE}/vllm-0.25.1.dist-info"),
            member(f"{SITE}/vllm-0.25.1.dist-info/METADATA", META),
            member(f"{SITE}/vllm-0.25.1.dist-info/RECORD", RECORD), *(extra or [])]


class Blobs:
    """Layers by digest, and which were opened (a registry stand-in for the pure reader)."""

    def __init__(self, blobs: list[bytes]) -> None:
        self.blobs = blobs
        self.opened: list[int] = []

    @property
    def refs(self) -> list[LayerRef]:
        return [LayerRef("sha256:" + hashlib.sha256(b).hexdigest(), "application/vnd.oci.image.layer.v1.tar+gzip",
                         len(b)) for b in self.blobs]

    def open(self, ref: LayerRef) -> io.BytesIO:
        index = [r.digest for r in self.refs].index(ref.digest)
        self.opened.append(index)
        return io.BytesIO(self.blobs[index])


def run(blobs: Blobs, rels: tuple[str, ...] = (REL,)) -> Located:
    return locate(blobs.refs, blobs.open, "vllm", list(rels), "test/base")
