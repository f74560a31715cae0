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
Where a layer touches a folder above the site folder, the whole site folder
is read through the archive as before, and kept. Where the engine is not a
local overlay2 one (another driver, a remote engine, podman's own store),
nothing is kept: the copy that runs is read whole every time.

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
import posixpath
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ..engine import FileFact, ImageInfo, Tree
from ..journal.cache import Store, host_key

log = logging.getLogger(__name__)

FORMAT = 1
OPAQUE = ("trusted.overlay.opaque", "user.overlay.opaque")
CHUNK = 1 << 20


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


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def opaque_state(path: str) -> bool | None:
    """Whether an overlay folder replaces the one below (None: its attributes cannot be read here)."""
    for name in OPAQUE:
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
        except OSError as exc:
            if exc.errno not in (61, 95):  # ENODATA: no such attribute; EOPNOTSUPP: none on this fs
                return None
    return False


def hash_file(path: str, want: bool) -> tuple[str, bytes | None]:
    digest = hashlib.sha256()
    parts: list[bytes] = []
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
            if want:
                parts.append(block)
    return digest.hexdigest(), b"".join(parts) if want else None


def apply_layer(folder: str, site_dir: str, entries: dict[str, FileFact], kept: dict[str, bytes],
                keep: Callable[[str], bool]) -> bool:
    """Apply one layer's folder to the facts of the site folder below it; False when it cannot be done here."""
    # A layer that removes, replaces or makes opaque a folder above the site folder changes all of it.
    parts = site_dir.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        above = os.path.join(folder, *parts[:i])
        try:
            st = os.lstat(above)
        except FileNotFoundError:
            return True  # the layer holds nothing at or under the site folder
        if not stat.S_ISDIR(st.st_mode) or opaque_state(above) is not False:
            return False
    root = os.path.join(folder, *parts)
    for top, dirs, files in os.walk(root):
        rel = os.path.relpath(top, folder)
        base = "/" + rel.replace(os.sep, "/")
        for name in sorted(dirs + files):
            full = os.path.join(top, name)
            path = posixpath.join(base, name)
            st = os.lstat(full)
            opaque = opaque_state(full) if stat.S_ISDIR(st.st_mode) else False
            if opaque is None:
                return False
            if is_whiteout(st) or opaque:
                # Removed, or replaced by this layer's folder: nothing below it survives from the layers under.
                for old in [p for p in entries if p == path or p.startswith(path + "/")]:
                    entries.pop(old)
                    kept.pop(old, None)
                if is_whiteout(st):
                    continue
            if stat.S_ISDIR(st.st_mode):
                entries[path] = FileFact(path, "dir", mode=stat.S_IMODE(st.st_mode))
            elif stat.S_ISLNK(st.st_mode):
                entries[path] = FileFact(path, "link", target=os.readlink(full), mode=stat.S_IMODE(st.st_mode))
                kept.pop(path, None)
            elif stat.S_ISREG(st.st_mode):
                sha, data = hash_file(full, keep(path))
                entries[path] = FileFact(path, "file", st.st_size, sha, mode=stat.S_IMODE(st.st_mode),
                                         mtime=int(st.st_mtime))
                if data is not None:
                    kept[path] = data
                else:
                    kept.pop(path, None)
            else:
                entries[path] = FileFact(path, "other", mode=stat.S_IMODE(st.st_mode))
    return True


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
        if all(apply_layer(folders[i], site_dir, entries, kept, keep)
                                       for i in range(start + 1, len(chains))):
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
