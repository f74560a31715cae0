"""What checkout ran on a GPU host that has no .git: a manifest made beside the commit, checked where it ran.

    python3 gpu-runs/source_manifest.py make OUT [--root DIR]
    python3 gpu-runs/source_manifest.py check MANIFEST [--root DIR] [--write FILE]

``make`` runs in the git checkout that sends the tree (the copy a GPU host
gets holds the tracked files, not .git). It refuses unless ``git status
--porcelain`` prints nothing (no change, no untracked file), then writes the
commit (``git rev-parse HEAD``), its tree ID, every tracked file with its
mode and git blob ID (``git ls-tree -r HEAD``), and the ignore patterns of
``.gitignore`` and ``.git/info/exclude`` (what may lie in the copy beside the
tracked files: caches, the carried bundle parts).

``check`` runs where the tree ran. It hashes every file the manifest names
as git does (``sha1("blob <size>\\0" + bytes)``; a link's target for a link),
builds the git tree ID of those files from the hashes found and the modes the
manifest gives, and lists files present that the manifest does not name and
no ignore pattern covers. It prints (and with ``--write`` keeps) JSON:
``commit``, ``tree`` (computed here), ``tree_expected`` (the manifest's),
``differ``, ``missing``, ``extra``, ``sender_clean`` and ``clean`` (the
sender had no change, the tree computed here is the commit's tree, and no
extra file lies in the copy); exit 0 when clean, 3 when not, 2 when the
manifest cannot be read.

What a clean result proves: the bytes of every tracked file here are the
bytes of the commit the manifest names (anyone with the repository can check
``git rev-parse COMMIT^{tree}`` against ``tree``), and no other file outside
the ignored paths was there. What it takes on trust: the file modes (from the
manifest: both scripts and tools are run through ``bash``/``python3``, so the
executable bit does not change what runs) and that the commit the manifest
names is the one whose tree that is (a wrong name is caught by the
``rev-parse`` above).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FORMAT = "vllm-hotfix-source/1"


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: git {' '.join(args)} in {root}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree_id(entries: dict[str, tuple[str, str]]) -> str:
    """The git tree ID of files ``path -> (mode, blob ID)`` (sub-trees made from the paths' folders)."""
    def build(prefix: str, names: dict[str, Any]) -> str:
        rows = []
        for name, node in names.items():
            if isinstance(node, dict):
                rows.append((name + "/", b"40000 " + name.encode() + b"\0" + bytes.fromhex(build(prefix + name + "/",
                                                                                             node))))
            else:
                mode, sha = node
                rows.append((name, f"{mode} ".encode() + name.encode() + b"\0" + bytes.fromhex(sha)))
        body = b"".join(row for _key, row in sorted(rows, key=lambda r: r[0].encode()))
        return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()

    root: dict[str, Any] = {}
    for path, value in entries.items():
        node = root
        *folders, name = path.split("/")
        for folder in folders:
            node = node.setdefault(folder, {})
        node[name] = value
    return build("", root)


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether a path (relative, with /) is covered by one of the gitignore-style ``patterns`` (a subset:
    ``/anchored``, ``folder/``, globs; no negation)."""
    parts = path.split("/")
    for raw in patterns:
        pat = raw.strip()
        if not pat or pat.startswith("#") or pat.startswith("!"):
            continue
        anchored = pat.startswith("/") or "/" in pat.rstrip("/")
        pat = pat.strip("/")
        for i in range(len(parts)):
            # Any leading folder (or the file itself) matched makes everything under it ignored.
            head = "/".join(parts[: i + 1])
            if anchored and fnmatch.fnmatchcase(head, pat):
                return True
            if not anchored and fnmatch.fnmatchcase(parts[i], pat):
                return True
    return False


def make(root: Path, out: Path) -> dict[str, Any]:
    dirty = _git(root, "status", "--porcelain")
    if dirty.strip():
        first = dirty.strip().splitlines()[0]
        raise SystemExit(f"error: {root} has uncommitted changes or untracked files ({first!r} ...): commit them "
                         "first; a record names a clean commit")
    files = []
    for line in _git(root, "ls-tree", "-r", "--full-tree", "HEAD").splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind == "blob":
            files.append([path, mode, sha])
    patterns: list[str] = []
    for name in (".gitignore", _git(root, "rev-parse", "--git-path", "info/exclude").strip()):
        p = Path(name) if os.path.isabs(name) else root / name
        if p.is_file():
            patterns += [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
    data = {"format": FORMAT, "commit": _git(root, "rev-parse", "HEAD").strip(),
            "tree": _git(root, "rev-parse", "HEAD^{tree}").strip(), "sender_clean": True,
            "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": files, "ignore": patterns}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return data


def check(manifest: dict[str, Any], root: Path) -> dict[str, Any]:
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), list):
        raise ValueError(f"not a {FORMAT} manifest")
    found: dict[str, tuple[str, str]] = {}
    differ, missing = [], []
    for path, mode, want in manifest["files"]:
        full = root / path
        try:
            data = os.readlink(full).encode() if mode == "120000" else full.read_bytes()
        except OSError:
            missing.append(path)
            found[path] = (mode, "0" * 40)
            continue
        have = blob_id(data)
        found[path] = (mode, have)
        if have != want:
            differ.append(path)
    named = set(found)
    patterns = [str(p) for p in manifest.get("ignore") or []] + ["/.git"]
    extra = []
    for top, dirs, files in os.walk(root):
        rel_top = os.path.relpath(top, root)
        rel_top = "" if rel_top == "." else rel_top.replace(os.sep, "/")
        dirs[:] = sorted(d for d in dirs if not ignored(f"{rel_top}/{d}".lstrip("/"), patterns))
        for f in sorted(files):
            rel = f"{rel_top}/{f}".lstrip("/")
            if rel not in named and not ignored(rel, patterns):
                extra.append(rel)
    tree = tree_id(found)
    clean = bool(manifest.get("sender_clean")) and tree == manifest.get("tree") and not extra
    return {"commit": manifest.get("commit"), "tree": tree, "tree_expected": manifest.get("tree"),
            "files": len(found), "differ": differ[:20], "missing": missing[:20], "extra": extra[:20],
            "sender_clean": bool(manifest.get("sender_clean")), "clean": clean,
            "how": "every tracked file hashed here as git does; tree built from those hashes and the manifest's "
                   "modes; files beside them that no ignore pattern covers listed as extra"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the manifest of this clean checkout's HEAD")
    m.add_argument("out", type=Path)
    c = sub.add_parser("check", help="check the files here against a manifest")
    c.add_argument("manifest", type=Path)
    c.add_argument("--write", type=Path, default=None)
    for p in (m, c):
        p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args(argv)
    if args.cmd == "make":
        data = make(args.root, args.out)
        print(f"{args.out}: commit {data['commit']}, tree {data['tree']}, {len(data['files'])} files")
        return 0
    try:
        result = check(json.loads(args.manifest.read_text(encoding="utf-8")), args.root)
    except (OSError, ValueError) as exc:
        print(f"error: --source manifest {args.manifest}: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, sort_keys=True)
    if args.write:
        args.write.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0 if result["clean"] else 3


if __name__ == "__main__":
    sys.exit(main())
