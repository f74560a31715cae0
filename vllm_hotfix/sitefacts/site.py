"""An image's site folders read from its layers, once for every judge of them (never by running the image).

What the file judges need of an image (:mod:`vllm_hotfix.judges.integrity`,
the pins) is read here in one pass: each site folder with every file
hashed, the bytes of the files asked for kept (each dist-info's METADATA
and RECORD always), the files the RECORDs list outside the site folders,
and the distributions the dist-infos describe. A site folder's facts are
kept per layer chain (:mod:`.layer_facts`), so an image over a known base
reads only its own layers.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..engine import FileFact, ImageInfo, Tree
from .dists import Dist, copies, distributions
from .layer_facts import site_tree


class TreeReader(Protocol):
    def read(self, paths: Sequence[str], keep: Callable[[str], bool] = ...) -> Tree: ...


class FileSource(Protocol):
    """Where an image's files are read from without running it: the Docker engine
    (:class:`~vllm_hotfix.engine.Engine`), podman's store
    (:class:`~vllm_hotfix.checking.launchers.podman.PodmanFiles`) where podman starts the image, or a registry's
    blobs (:class:`~vllm_hotfix.registry.blobs.RegistryImage`)."""

    def image(self, ref: str) -> ImageInfo | None: ...

    def files(self, image: str) -> AbstractContextManager[TreeReader]: ...


def keep_metadata(path: str) -> bool:
    """The files of a tree read whose bytes are needed: each dist-info's METADATA and RECORD."""
    folder, name = posixpath.split(path)
    return folder.endswith(".dist-info") and name in ("METADATA", "RECORD")


def keep_patched(site_dir: str, rels: Iterable[str]) -> Callable[[str], bool]:
    """What the landed check needs kept besides the metadata: the patched files and their pycs."""
    wanted = {posixpath.join(site_dir, rel) for rel in rels}
    caches = {posixpath.join(posixpath.dirname(p), "__pycache__") for p in wanted}

    def keep(path: str) -> bool:
        return path in wanted or (path.endswith(".pyc") and posixpath.dirname(path) in caches) or keep_metadata(path)

    return keep


@dataclass(frozen=True, slots=True)
class SiteFiles:
    """One image's site folders as read: the files, and the distributions installed in each folder."""

    tree: Tree  # every site folder read, and the files their RECORDs list outside them
    dists: Mapping[str, Mapping[str, Dist]]  # site folder -> canonical name -> its distribution (one per name)
    copies: Mapping[str, Sequence[tuple[str, str]]]  # site folder -> (name, version) of every dist-info, twins too
    architecture: str = ""  # as the image's config names it ("amd64"); "" where the source does not say


def read(engine: FileSource, image_id: str, site_dirs: Sequence[str], keep: Callable[[str], bool] = keep_metadata,
         cache: Path | None = None, say: Callable[[str], None] = lambda _l: None) -> SiteFiles:
    """The image's site folders ``site_dirs`` (every file hashed, the bytes ``keep`` names kept), and what the
    RECORDs of the first list outside them, read once.

    With ``cache``, each site folder's facts are kept per layer chain and only the layers above a kept chain are
    read (:mod:`.layer_facts`)."""
    info = engine.image(image_id)
    with engine.files(image_id) as reader:
        entries: dict[str, FileFact] = {}
        kept: dict[str, bytes] = {}
        missing: list[str] = []
        for site_dir in site_dirs:
            tree = site_tree(info, reader, cache, site_dir, keep, say) if cache is not None else reader.read(
                [site_dir], keep)
            entries.update(tree.entries)
            kept.update(tree.kept)
            missing.extend(tree.missing)
        read_tree = Tree(entries, kept, tuple(missing))
        dists = {site_dir: distributions(read_tree, site_dir) for site_dir in site_dirs}
        # The first folder is the one judged whole: what its distributions installed elsewhere is read too.
        inside = tuple(d.rstrip("/") + "/" for d in site_dirs)
        outside = sorted({p for d in dists[site_dirs[0]].values() for p, _ in d.rows
                          if not p.startswith(inside)}) if site_dirs else []
        more = reader.read(outside) if outside else Tree({}, {}, ())
    whole = Tree({**read_tree.entries, **more.entries}, read_tree.kept, read_tree.missing + more.missing)
    return SiteFiles(whole, dists, {site_dir: copies(read_tree, site_dir) for site_dir in site_dirs},
                     info.architecture if info is not None else "")


def read_site(engine: FileSource, image_id: str, site_dir: str, keep: Callable[[str], bool] = keep_metadata,
              cache: Path | None = None, say: Callable[[str], None] = lambda _l: None) -> Tree:
    """The files of one site folder (:func:`read`)."""
    return read(engine, image_id, [site_dir], keep, cache, say).tree
