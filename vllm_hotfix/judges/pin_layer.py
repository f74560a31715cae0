"""The pip layer of a patch set with pins, judged against the pinned wheels: what pip may write, and nothing else.

The Dockerfile builder installs each pinned wheel with ``pip install
--no-deps --force-reinstall --no-compile`` in one ``RUN`` step. What that
step may leave in its layer, given the wheels (found in the pin cache by the
hashes ``pins.txt`` names) and the base's site folder:

* each member of each wheel, exactly where pip installs it under the base
  Python's own install scheme (``sysconfig.get_paths()`` as the base's
  Python answers, read with its ``sys.path``): the wheel's root in
  ``purelib`` (``Root-Is-Purelib: true``) or ``platlib``, ``NAME.data/KEY``
  in the scheme's ``KEY`` folder (``headers`` in ``include/NAME``), holding
  exactly the member's bytes (a script's ``#!python`` line rewritten to a
  Python's path, as pip does);
* in each pinned distribution's ``.dist-info``: the files pip writes itself
  (``RECORD`` rewritten, ``INSTALLER``, ``REQUESTED``, ``direct_url.json``);
* a launcher in the scheme's ``scripts`` folder for each console or GUI script the wheel's
  ``entry_points.txt`` declares, importing what it names and nothing else;
* removals (whiteouts, opaque folders) only of what the base's copies of the
  pinned distributions own (their RECORD, their ``.dist-info``, the bytecode
  of their sources);
* folders above any of these.

No bytecode: ``--no-compile`` means a ``.pyc`` in this layer is not pip's.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import zipfile
from collections.abc import Mapping, Sequence
from email.parser import HeaderParser
from pathlib import Path

from .. import dist_record
from ..building import pins
from ..building.pinfile import PinSet
from ..engine import Engine, ImageInfo
from ..errors import PinError
from ..layers import Layer, LayerEntry, in_words
from ..sitefacts.dists import canonical
from ..sitefacts.site import keep_metadata, read_site
from .difference import Difference

PIP_FILES = ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")
_SCRIPT = re.compile(r"^\s*([\w.-]+)\s*=\s*([\w.]+)\s*:\s*([\w.]+)\s*$")


def _scripts(zf: zipfile.ZipFile) -> dict[str, tuple[str, str]]:
    """Console and GUI scripts a wheel declares: name -> (module, attribute)."""
    name = next((n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt") and n.count("/") == 1), None)
    out: dict[str, tuple[str, str]] = {}
    if name is None:
        return out
    section = ""
    for line in zf.read(name).decode("utf-8", "replace").splitlines():
        if line.strip().startswith("["):
            section = line.strip().strip("[]").strip()
        elif section in ("console_scripts", "gui_scripts") and (m := _SCRIPT.match(line)):
            out[m.group(1)] = (m.group(2), m.group(3))
    return out


def launcher_ok(data: bytes, module: str, attr: str) -> bool:
    """Whether a bin file is pip's launcher for ``module:attr``: a Python shebang, then only these lines."""
    lines = data.decode("utf-8", "replace").splitlines()
    if not lines or not re.match(r"^#!\S*python[\d.]*\s*$", lines[0]):
        return False
    top = attr.split(".")[0]
    allowed = {"# -*- coding: utf-8 -*-", "import re", "import sys", f"from {module} import {top}",
               "if __name__ == '__main__':", "if __name__ == \"__main__\":",
               "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])",
               f"    sys.exit({attr}())"}
    return all(line in allowed for line in lines[1:] if line.strip())


SCHEME_KEYS = ("purelib", "platlib", "scripts", "data", "include")


def _installed_path(member: str, scheme: Mapping[str, str], data_dir: str, root_is_purelib: bool,
                    dist: str) -> str | None:
    """Where pip installs a wheel member (relative to /) under the base Python's install ``scheme``, or None for
    a ``NAME.data`` folder pip does not know."""
    if member.startswith(data_dir + "/"):
        key, _, rest = member[len(data_dir) + 1:].partition("/")
        if key == "headers":
            return posixpath.join(scheme["include"], dist, rest).strip("/")
        if key not in ("purelib", "platlib", "scripts", "data"):
            return None
        return posixpath.join(scheme[key], rest).strip("/")
    return posixpath.join(scheme["purelib" if root_is_purelib else "platlib"], member).strip("/")


def _root_is_purelib(zf: zipfile.ZipFile, info_dir: str) -> bool:
    try:
        text = zf.read(f"{info_dir}/WHEEL").decode("utf-8", "replace")
    except KeyError:
        return True
    return HeaderParser().parsestr(text).get("Root-Is-Purelib", "true").strip().lower() == "true"


def _script_ok(data: bytes, member: bytes) -> bool:
    """Whether a file pip put in the scripts folder is the wheel's script: its bytes, or (pip rewrites a
    ``#!python`` first line to the interpreter's path) its bytes after a Python shebang."""
    if data == member:
        return True
    if not member.startswith((b"#!python", b"#!pythonw")):
        return False
    head, _, rest = data.partition(b"\n")
    return bool(re.match(rb"^#!\S*python[\d.]*\s*$", head)) and rest == member.partition(b"\n")[2]


def difference(layer: Layer, root: Path, pinset: PinSet, scheme: Mapping[str, str], sites: Sequence[str],
               base: ImageInfo, engine: Engine, cache: Path | None = None) -> Difference | None:
    """The first entry of the pip layer that pip could not have written from the pinned wheels (PinError: a wheel
    or the base's scheme this host lacks, so the layer cannot be judged).

    ``scheme``: the base Python's install scheme (``sysconfig.get_paths()``
    as the base itself answers: purelib, platlib, scripts, data, include),
    which places each member exactly where pip puts it. ``sites``: the
    base's site folders, where pip may remove the pinned distributions' old
    copies from."""
    lacking = [k for k in SCHEME_KEYS if not scheme.get(k)]
    if lacking:
        raise PinError(f"the base's Python gave no install scheme path {lacking[0]}: cannot place the wheels' "
                       "files")
    folders = [s.strip("/") for s in dict.fromkeys(sites) if s.strip("/")]
    files: dict[str, str] = {}  # path -> sha256 of the wheel member it must hold
    scripts: dict[str, bytes] = {}  # path in the scripts folder -> the wheel member's bytes
    launchers: dict[str, tuple[str, str]] = {}  # path of a console or GUI script launcher -> (module, attribute)
    pip_files: set[str] = set()
    names = set()
    scripts_dir = scheme["scripts"].strip("/")
    for pin in pinset.pins:
        wheel = pins.cached_wheel(root, pin)
        if wheel is None:
            raise PinError(f"{pinset.path.name} pins {pin.spelled} {pin.version}, and {pins.cache(root)} holds no "
                           "wheel of it with a hash it names: the layer cannot be judged against that pin (build the "
                           "patch set once to fetch it)")
        names.add(canonical(pin.name))
        with zipfile.ZipFile(wheel) as zf:
            info_dir = next(n.split("/", 1)[0] for n in zf.namelist() if n.split("/", 1)[0].endswith(".dist-info"))
            data_dir = info_dir[: -len(".dist-info")] + ".data"
            # Headers go to a folder named as the METADATA names the project (pip's scheme takes that name).
            meta = HeaderParser().parsestr(zf.read(f"{info_dir}/METADATA").decode("utf-8", "replace"))
            dist = meta.get("Name") or info_dir[: -len(".dist-info")].rsplit("-", 1)[0]
            purelib = _root_is_purelib(zf, info_dir)
            for member in zf.namelist():
                if member.endswith("/"):
                    continue
                if member.startswith(info_dir + "/") and member.split("/", 1)[1] in PIP_FILES:
                    continue
                where = _installed_path(member, scheme, data_dir, purelib, dist)
                if where is None:
                    raise PinError(f"{wheel.name}: {member} is in a {data_dir} folder pip does not install")
                body = zf.read(member)
                if member.startswith(f"{data_dir}/scripts/"):
                    scripts[where] = body
                else:
                    files[where] = hashlib.sha256(body).hexdigest()
            home = scheme["purelib" if purelib else "platlib"].strip("/")
            pip_files.update(f"{home}/{info_dir}/{f}" for f in PIP_FILES)
            launchers.update({f"{scripts_dir}/{name}": target for name, target in _scripts(zf).items()})
    owned: set[str] = set()
    below: dict[str, list[str]] = {}
    for site in folders:
        mine, inside = _owned_by_base(engine, base, "/" + site, names, cache)
        owned |= mine
        below.update(inside)
    # Paths relative to / here, as the wheel's members are placed.
    entries = {p.lstrip("/"): e for p, e in layer.entries.items()}
    data = {p.lstrip("/"): b for p, b in layer.kept.items()}
    for path in sorted(entries):
        why = _judge(path, entries, data, files, scripts, launchers, pip_files, owned, below)
        if why is not None:
            return why
    return None


def _removable(path: str, owned: set[str], below: Mapping[str, list[str]]) -> bool:
    """Whether pip may remove ``path``: the distributions own it, or it is a folder holding only what they own."""
    if path in owned:
        return True
    inside = below.get(path)
    return inside is not None and all(p in owned for p in inside)


def _judge(path: str, layer: Mapping[str, LayerEntry], data: Mapping[str, bytes], files: Mapping[str, str],
           scripts: Mapping[str, bytes], launchers: Mapping[str, tuple[str, str]], pip_files: set[str],
           owned: set[str], below: Mapping[str, list[str]]) -> Difference | None:
    node = layer[path]
    if node.kind in ("file", "hardlink"):
        if path in files:
            return None if files[path] == node.sha256 else Difference(
                f"/{path}", "sha256", files[path], node.sha256,
                f"/{path} is not the wheel's (sha256 {node.sha256[:12]}, the wheel's {files[path][:12]})")
        if path in pip_files:
            return None
        if path.endswith(".pyc"):
            return Difference(f"/{path}", "entry", "", in_words(node),
                              f"/{path}: bytecode, which pip --no-compile does not write")
        if path in scripts:
            if path in data and _script_ok(data[path], scripts[path]):
                return None
            return Difference(f"/{path}", "sha256", hashlib.sha256(scripts[path]).hexdigest(), node.sha256,
                              f"/{path} is not the wheel's script (its bytes after a Python shebang)")
        if path in launchers:
            module, attr = launchers[path]
            if path in data and launcher_ok(data[path], module, attr):
                return None
            return Difference(f"/{path}", "sha256", f"pip's launcher of {module}:{attr}", node.sha256,
                              f"/{path} is not pip's launcher of {module}:{attr}")
        return Difference(f"/{path}", "entry", "", in_words(node),
                          f"/{path} is not a file of a pinned wheel ({in_words(node)})")
    if node.kind == "whiteout" or (node.kind == "dir" and node.opaque):
        if _removable(path, owned, below):
            return None
        stray = sorted(p for p in below.get(path, ()) if p not in owned)
        return Difference(f"/{path}", "entry", "held by the base", in_words(node),
                          f"/{path} is {'removed' if node.kind == 'whiteout' else 'made opaque'}, and the base's "
                          f"pinned distributions do not own all it held (not /{stray[0] if stray else path})")
    if node.kind == "dir":
        inner = path + "/"
        if any(p.startswith(inner) for p in layer if layer[p].kind != "dir" or layer[p].opaque):
            return None
        if any(k.startswith(inner) for k in files) or node.mode & 0o1000 or not node.mode & 0o022:
            # A folder pip wrote into or passed through (its scratch folder under /tmp): it holds nothing here.
            return None
        return Difference(f"/{path}", "mode", "", f"{node.mode:o}",
                          f"/{path}: a folder pip does not make, writable by others (mode {node.mode:o})")
    return Difference(f"/{path}", "entry", "", in_words(node),
                      f"/{path} is not a file of a pinned wheel ({in_words(node)})")


def _owned_by_base(engine: Engine, base: ImageInfo, site_dir: str, names: set[str], cache: Path | None
                   ) -> tuple[set[str], dict[str, list[str]]]:
    """Paths (relative to /) the base's copies of the pinned distributions own (what pip may remove), and each
    folder of the base's site folder with every path below it."""
    tree = read_site(engine, base.id, site_dir, keep=keep_metadata, cache=cache)
    site = site_dir.strip("/")
    # Files and links only: a folder pip removes whole may hold folders, and those own nothing themselves.
    paths = sorted(p.strip("/") for p, f in tree.entries.items() if f.kind != "dir")
    below: dict[str, list[str]] = {}
    for p in paths:
        parts = p.split("/")
        for i in range(1, len(parts)):
            below.setdefault("/".join(parts[:i]), []).append(p)
    owned: set[str] = set()
    for path, data in tree.kept.items():
        folder, name = posixpath.split(path.strip("/"))
        if name != "RECORD" or not folder.endswith(".dist-info"):
            continue
        dist = posixpath.basename(folder)[: -len(".dist-info")].rsplit("-", 1)[0]
        if canonical(dist) not in names:
            continue
        owned.add(folder)
        owned.update(below.get(folder, []))
        for row in dist_record.read(data).rows:
            rel = row.under(site)
            owned.add(rel)
            if rel.endswith(".py"):
                parent, stem = posixpath.split(rel[:-3])
                owned.update(p for p in below.get(f"{parent}/__pycache__", []) if
                             posixpath.basename(p).startswith(stem + "."))
    return owned, below
