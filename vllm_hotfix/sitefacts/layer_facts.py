"""File facts of an image's site folder, kept per layer chain so that a new image on a known base reads only its
own layers.

A patched image is its base's layers plus the hotfix's (one, for the
Dockerfile and the assemble builder alike). Reading its whole site folder
through the engine's archive (every file of torch, vLLM and their
requirements hashed) took 21 to 27 s on the GPU host for the tiny model's
17 GB base, most of a warm smoke's file phase. So the facts read are kept
under the image's *chain ID* (the OCI chain of its layers' diff IDs, which
names the content of every layer up to that one): a later read of any image
whose layers begin with a kept chain starts from those facts and applies
only the layers above it, and an image read before is not read again.

The layers above are read from the engine's own storage where it is local
and the overlay2 driver keeps them as folders (``GraphDriver`` ``UpperDir``
and ``LowerDir``, the image's layers top first): each layer's folder holds
the files it adds or changes, a character device 0/0 for each it removes,
and ``trusted.overlay.opaque=y`` on a folder that replaces the one below.
Each is read (:func:`vllm_hotfix.layers.read.from_folder`, the site folder
and each folder above it) and laid over the kept facts by the one flattener
(:func:`vllm_hotfix.layers.apply`), so a layer that removes, replaces or
empties a folder above the site folder empties the facts too. A folder
whose opaque mark this host cannot read sends the whole site folder through
the archive, as before, and kept. Where the engine is not a local overlay2
one (another driver, a remote engine, podman's own store), nothing is kept:
the copy that runs is read whole every time.

The facts are kept with the facts cache's storage (:class:`~vllm_hotfix.journal.cache.Store`):
under ``VLLM_HOTFIX_CACHE/layers/<chain ID>/``, an index only this host can
have written (MAC) and the kept bytes (dist-info metadata, the patched files
and their bytecode) as blobs named by their hash. Bytes the caller wants
that a kept tree lacks are read from the image, those files alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ..engine import FileFact, ImageInfo, Tree
from ..journal.cache import Store, host_key
from ..layers import apply
from ..layers.read import from_folder

log = logging.getLogger(__name__)

FORMAT = 1


class Reader(Protocol):
    def read(self, paths: Sequence[str], keep: Callable[[str], bool] = ...) -> Tree: ...


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """The OCI chain IDs of a layer stack: each names the content of every layer up to it."""
    chains: list[str] = []
    for diff in diff_ids:
        chains.append(diff if not chains else
                      "sha256:" + hashlib.sha256(f"{chains[-1]} {diff}".encode()).hexdigest())
    return chains


def _store(cache: Path, chain: str) -> Store | None:
    key = host_key(cache)
    return Store(cache / "layers" / chain.removeprefix("sha256:"), key) if key is not None else None


def _name(site_dir: str) -> str:
    return "site-" + hashlib.sha256(site_dir.encode()).hexdigest()[:16]


def load(cache: Path, chain: str, site_dir: str) -> Tree | None:
    """The facts kept for ``chain`` (None: none, or not written by this host as they stand)."""
    store = _store(cache, chain)
    body = store.read(_name(site_dir)) if store is not None else None
    if store is None or body is None or body.get("format") != FORMAT or body.get("site_dir") != site_dir:
        return None
    entries = {row[0]: FileFact(*row) for row in body.get("entries") or []}
    kept = {}
    for path, digest in (body.get("kept") or {}).items():
        data = store.get(digest, f"{path} of layer chain {chain[:19]}")
        if data is not None:
            kept[path] = data
    return Tree(entries, kept, tuple(body.get("missing") or ()))


def keep_tree(cache: Path, chain: str, site_dir: str, tree: Tree) -> None:
    store = _store(cache, chain)
    if store is None:
        return
    rows = [[f.path, f.kind, f.size, f.sha256, f.target, f.mode, f.mtime] for f in tree.entries.values()]
    kept = {path: store.put(data) for path, data in tree.kept.items()}
    store.write(_name(site_dir), {"format": FORMAT, "site_dir": site_dir, "entries": rows, "kept": kept,
                                  "missing": list(tree.missing)})


def layer_folders(info: ImageInfo, drivers: tuple[str, ...] = ("overlay2",)) -> list[str] | None:
    """The overlay folders of the image's layers, bottom first (None: not a local image of one of ``drivers``:
    the Docker engine's overlay2, podman's overlay)."""
    driver = (info.attrs or {}).get("GraphDriver") or {}
    data = driver.get("Data") or {}
    if driver.get("Name") not in drivers or not data.get("UpperDir"):
        return None
    lower = [p for p in str(data.get("LowerDir") or "").split(":") if p]
    folders = [*reversed(lower), str(data["UpperDir"])]
    layers = ((info.attrs or {}).get("RootFS") or {}).get("Layers") or []
    if len(folders) != len(layers) or not all(os.path.isdir(f) and os.access(f, os.R_OK | os.X_OK)
                                              for f in folders):
        return None
    return folders


def site_tree(info: ImageInfo | None, reader: Reader, cache: Path, site_dir: str, keep: Callable[[str], bool],
              say: Callable[[str], None] = lambda _l: None) -> Tree:
    """The facts of ``site_dir`` in the image: kept ones, kept ones of a lower chain and the layers above, or a
    whole read through ``reader`` (kept for next time)."""
    folders = layer_folders(info) if info is not None else None
    # Which image: a smoke reads the image's and its base's, one line each.
    of = f" of {info.id.removeprefix('sha256:')[:12]}" if info is not None and info.id else ""
    if folders is None:
        # Facts are kept only where the layers above a kept chain can be read here: a local overlay2 engine.
        # Elsewhere (podman's own store, a remote engine) the copy that runs is read whole, every time.
        say(f"    site folder facts{of}: every layer read (not a local overlay2 engine: nothing kept)")
        return reader.read([site_dir], keep)
    layers = [str(d) for d in (((info.attrs if info else None) or {}).get("RootFS") or {}).get("Layers") or []]
    chains = chain_ids(layers)
    tree, start = None, -1
    for i in range(len(chains) - 1, -1, -1):
        tree = load(cache, chains[i], site_dir)
        if tree is not None:
            start = i
            break
    how = ""
    if tree is not None and start < len(chains) - 1:
        entries, kept = dict(tree.entries), dict(tree.kept)
        above = [from_folder(folders[i], keep=keep, under=site_dir) for i in range(start + 1, len(chains))]
        if all(layer is not None for layer in above):
            for layer in above:
                assert layer is not None
                apply(layer, entries, kept, site_dir)
            tree = Tree(entries, kept, tree.missing)
            how = (f"the facts of its first {start + 1} layer(s) kept from before, its top "
                   f"{len(chains) - start - 1} layer(s) read")
        else:
            tree = None
    elif tree is not None:
        how = "the facts kept from an earlier read of the same layers"
    if tree is None:
        tree = reader.read([site_dir], keep)
        how = "every layer read"
    if chains:
        keep_tree(cache, chains[-1], site_dir, tree)
    wanted = sorted(p for p, f in tree.entries.items() if f.kind == "file" and p not in tree.kept and keep(p))
    if wanted:
        more = reader.read(wanted, keep)
        tree = Tree(tree.entries, {**tree.kept, **more.kept}, tree.missing)
    say(f"    site folder facts{of}: {how}")
    return tree
