"""The one layer model: what each source reads, and how the flattener lays layers over each other.

Table-driven, as go-containerregistry pins its whiteout rules: each case is
a stack of real layer tars (bottom first) and the paths the image shows,
with what each holds. The same stacks are read as overlay folders (a
whiteout a character device 0/0, an opaque folder its extended attribute)
where this host can make them.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import random
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
from layer_tars import REL, SITE, Blobs, folders, installed, layer, member, run

from vllm_hotfix.engine import ImageInfo
from vllm_hotfix.errors import BaseImageError, EngineError
from vllm_hotfix.judges import layer_read
from vllm_hotfix.layers import Layer, LayerEntry, apply, flatten, hides, said, squash
from vllm_hotfix.layers.read import checked, from_export, from_folder, from_tar
from vllm_hotfix.registry import layerscan
from vllm_hotfix.registry.compression import uncompressed
from vllm_hotfix.registry.layerscan import LayerRef, locate

# A member: (name, what) with what: bytes (a file), None (a folder), "->x" (a symbolic link), "=>x" (a hard link).
Member = tuple[str, "bytes | str | None"]


def tar(members: list[Member]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as out:
        for name, what in members:
            info = tarfile.TarInfo(name)
            if what is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                out.addfile(info)
            elif isinstance(what, str):
                info.type = tarfile.SYMTYPE if what.startswith("->") else tarfile.LNKTYPE
                info.linkname = what[2:]
                out.addfile(info)
            else:
                info.size, info.mode = len(what), 0o644
                out.addfile(info, io.BytesIO(what))
    return raw.getvalue()


def read(members: list[Member]) -> Layer:
    return from_tar(io.BytesIO(tar(members)))


def shown(layers: list[list[Member]]) -> dict[str, str]:
    """What the flattened image shows: path -> "dir", "link:TARGET", or the file's first bytes."""
    image = flatten(read(m) for m in layers)
    out = {}
    for path, e in image.entries.items():
        out[path] = ("dir" if e.kind == "dir" else f"link:{e.target}" if e.kind == "link"
                     else SHA.get(e.sha256, e.kind))
    return out


SHA = {hashlib.sha256(b).hexdigest(): b.decode() for b in (b"a", b"b", b"c", b"new")}

CASES = [
    # (what it pins, layers bottom first, what the image shows)
    ("a file over a file replaces it",
     [[("d", None), ("d/f", b"a")], [("d", None), ("d/f", b"b")]],
     {"/d": "dir", "/d/f": "b"}),
    ("a whiteout removes a file",
     [[("d", None), ("d/f", b"a"), ("d/g", b"b")], [("d", None), ("d/.wh.f", b"")]],
     {"/d": "dir", "/d/g": "b"}),
    ("a whiteout of a folder removes all below it",
     [[("d", None), ("d/e", None), ("d/e/f", b"a"), ("d/g", b"b")], [("d", None), ("d/.wh.e", b"")]],
     {"/d": "dir", "/d/g": "b"}),
    ("a whiteout of a name that is only a prefix removes nothing else",
     [[("d", None), ("d/e", b"a"), ("d/ee", b"b")], [("d", None), ("d/.wh.e", b"")]],
     {"/d": "dir", "/d/ee": "b"}),
    ("an opaque folder hides what the layers below hold in it, keeps its own",
     [[("d", None), ("d/f", b"a"), ("d/e", None), ("d/e/g", b"b")],
      [("d", None), ("d/.wh..wh..opq", b""), ("d/h", b"c")]],
     {"/d": "dir", "/d/h": "c"}),
    ("an opaque mark before its folder's own entry counts the same",
     [[("d", None), ("d/f", b"a")], [("d/.wh..wh..opq", b""), ("d", None), ("d/h", b"c")]],
     {"/d": "dir", "/d/h": "c"}),
    ("an opaque folder leaves its siblings alone",
     [[("d", None), ("d/f", b"a"), ("x", None), ("x/y", b"b")], [("d", None), ("d/.wh..wh..opq", b"")]],
     {"/d": "dir", "/x": "dir", "/x/y": "b"}),
    ("a file over a folder leaves none of the folder's files",
     [[("d", None), ("d/e", None), ("d/e/f", b"a"), ("d/e/g", None), ("d/e/g/h", b"b")], [("d", None), ("d/e", b"c")]],
     {"/d": "dir", "/d/e": "c"}),
    ("a link over a folder leaves none of the folder's files",
     [[("d", None), ("d/e", None), ("d/e/f", b"a")], [("d", None), ("d/e", "->/elsewhere")]],
     {"/d": "dir", "/d/e": "link:/elsewhere"}),
    ("a folder over a file, and its files after",
     [[("d", None), ("d/e", b"a")], [("d", None), ("d/e", None), ("d/e/f", b"b")]],
     {"/d": "dir", "/d/e": "dir", "/d/e/f": "b"}),
    ("a folder over a folder keeps what the folder held",
     [[("d", None), ("d/f", b"a")], [("d", None)]],
     {"/d": "dir", "/d/f": "a"}),
    ("a whiteout and a folder of the same name in one layer: the folder made anew (opaque)",
     [[("d", None), ("d/f", b"a")], [(".wh.d", b""), ("d", None), ("d/g", b"b")]],
     {"/d": "dir", "/d/g": "b"}),
    ("a whiteout then a file of the same name in a layer above",
     [[("d", None), ("d/f", b"a")], [("d", None), ("d/.wh.f", b"")], [("d", None), ("d/f", b"c")]],
     {"/d": "dir", "/d/f": "c"}),
    ("a hard link to a file of its own layer has that file's bytes",
     [[("d", None), ("d/f", b"a"), ("d/g", "=>d/f")]],
     {"/d": "dir", "/d/f": "a", "/d/g": "a"}),
    ("a hard link to a file of a layer below has that file's bytes",
     [[("d", None), ("d/f", b"b")], [("d", None), ("d/g", "=>d/f")]],
     {"/d": "dir", "/d/f": "b", "/d/g": "b"}),
    ("names with ./ and trailing slashes are the same paths",
     [[("./d/", None), ("./d/f", b"a")], [("d", None), ("./d/.wh.f", b"")]],
     {"/d": "dir"}),
]


@pytest.mark.parametrize(("layers", "image"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_layers_laid_over_each_other_show_what_an_engine_shows(layers: list[list[Member]],
                                                               image: dict[str, str]) -> None:
    assert shown(layers) == image


@pytest.mark.parametrize(("layers", "image"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_layers_squashed_newest_first_decide_each_path_as_the_flattener_shows_it(layers: list[list[Member]],
                                                                                 image: dict[str, str]) -> None:
    """The registry scan's way: each layer read (newest first) laid under the ones read before, and each path
    asked of the squash. Every path any layer names is shown as the flattened image shows it, or gone."""
    read_layers = [read(m) for m in layers]
    stack = layerscan.Stack()
    for newest in reversed(read_layers):
        stack.add(layerscan.Listing(newest))
    assert stack.top == squash(read_layers)  # laid under one by one, or squashed at once: one layer
    flat = flatten(read_layers)
    for path in {p for one in read_layers for p in one.entries} | set(flat.entries):
        got = layerscan.shown(stack.top, path)
        assert got is not layerscan.UNKNOWN, path  # a stack down to its first layer decides every path
        shows = got if not isinstance(got, LayerEntry) else replace(got, opaque=False)  # opaque: a mark, not a fact
        assert shows == flat.entries.get(path), path
    # Over nothing, a squash holds the image and what it would hide of layers below (whiteouts, opaque folders).
    assert {p: replace(e, opaque=False) for p, e in stack.top.entries.items() if e.kind != "whiteout"} == flat.entries


def test_a_squash_says_nothing_of_what_its_layers_do_not_name() -> None:
    top = squash([read([("d", None), ("d/f", b"a")]), read([("d", None), ("d/.wh..wh..opq", b""), ("x", b"b")])])
    assert said(top, "/e") is None and said(top, "/d/g").kind == "whiteout"  # under an opaque folder: gone
    assert said(top, "/x/y").kind == "whiteout"  # under a file: gone
    assert said(top, "/d").opaque and not said(top, "/x").opaque


def test_layer_tars_are_opened_only_by_the_layer_reader() -> None:
    """One reader of layer tars (issue 63): besides it, only the tool's tar writer and the engine's outer save
    archive (whose members the reader reads) call tarfile.open."""
    package = Path(__file__).resolve().parents[2] / "vllm_hotfix"
    opening = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if "tarfile.open(" in p.read_text())
    assert opening == ["engine/files.py", "layers/read.py", "tarball.py"]


def test_the_flattened_image_holds_no_whiteouts_and_no_opaque_marks() -> None:
    image = flatten([read([("d", None), ("d/f", b"a")]), read([("d/.wh..wh..opq", b""), ("d", None),
                                                                  (".wh.x", b"")])])
    assert {e.kind for e in image.entries.values()} == {"dir"} and not image.entries["/d"].opaque


@pytest.mark.parametrize(("name", "members"), [
    ("a file twice", [("d", None), ("d/f", b"a"), ("d/f", b"b")]),
    ("a folder twice", [("d", None), ("d", None)]),
    ("a file and a folder of one name", [("d", b"a"), ("d", None)]),
    ("a whiteout twice", [("d", None), ("d/.wh.f", b""), ("d/.wh.f", b"")]),
    ("an opaque mark twice", [("d", None), ("d/.wh..wh..opq", b""), ("d/.wh..wh..opq", b"")]),
    ("one path spelled two ways", [("d", None), ("d/f", b"a"), ("./d//f", b"b")]),
])
def test_a_layer_that_names_a_path_twice_is_refused(name: str, members: list[Member]) -> None:
    with pytest.raises(EngineError, match="twice"):
        read(members)


def test_an_opaque_mark_on_a_file_is_refused() -> None:
    with pytest.raises(EngineError, match="opaque"):
        read([("d", b"a"), ("d/.wh..wh..opq", b"")])


def test_the_tar_reader_keeps_only_the_bytes_asked_for_and_no_larger_than_the_limit() -> None:
    layer = from_tar(io.BytesIO(tar([("bin", None), ("bin/a", b"x" * 10), ("bin/b", b"y" * 100), ("c", b"z")])),
                     keep=lambda p: p.startswith("/bin/"), keep_max=50)
    assert layer.kept == {"/bin/a": b"x" * 10}
    assert layer.entries["/bin/b"].sha256 == hashlib.sha256(b"y" * 100).hexdigest()


@pytest.mark.parametrize(("path", "marks", "hidden"), [
    ("/usr/bin", {}, False),
    ("/baz/foo.txt", {"/baz": "whiteout"}, True),
    ("/baz/bar/foo.txt", {"/baz": "whiteout"}, True),
    ("/baz", {"/baz": "whiteout"}, True),
    ("/red/green", {"/red/blue": "whiteout"}, False),
    ("/red/yellow.txt", {"/red": "opaque"}, True),
    ("/red", {"/red": "opaque"}, False),
    ("/red/x", {"/red": "file"}, True),
    ("/red/x", {"/red": "dir"}, False),
])
def test_what_a_layer_hides_of_one_path(path: str, marks: dict[str, str], hidden: bool) -> None:
    entries = {p: LayerEntry(p, "dir", opaque=True) if k == "opaque" else LayerEntry(p, k) for p, k in marks.items()}
    assert hides(path, entries.get) is hidden


def test_a_layer_laid_over_a_site_folder_that_a_file_replaces_above_it_empties_it() -> None:
    entries = {"/s/p": LayerEntry("/s/p", "dir"), "/s/p/a.py": LayerEntry("/s/p/a.py", "file", sha256="1")}
    kept = {"/s/p/a.py": b"x"}
    apply(read([("s", b"not a folder")]), entries, kept, "/s/p")
    assert entries == {} and kept == {}


# -- overlay folders ------------------------------------------------------------------


def _make_folder(root: Path, members: list[Member]) -> bool:
    """The layer as an overlay folder holds it; False where this host cannot make a whiteout or an opaque mark."""
    for name, what in members:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        base = os.path.basename(name)
        if base == ".wh..wh..opq":
            try:
                os.setxattr(path.parent, "user.overlay.opaque", b"y")
            except OSError:
                return False
        elif base.startswith(".wh."):
            try:
                os.mknod(path.parent / base[4:], 0o600 | 0o020000, 0)  # a character device 0/0
            except OSError:
                return False
        elif what is None:
            path.mkdir(exist_ok=True)
        elif isinstance(what, str):
            if what.startswith("->"):
                path.symlink_to(what[2:])
            else:
                os.link(root / what[2:], path)
        else:
            path.write_bytes(what)
    return True


def _as_folders(layers: list[list[Member]]) -> bool:
    """Whether overlay folders can hold the case: no spelling of names (a folder has one), no whiteout beside a
    folder of its name (overlay makes that an opaque folder), no hard link across layers (overlay copies it up)."""
    for members in layers:
        names = {n for n, _ in members}
        for name, what in members:
            if name.startswith("./") or name.startswith(".wh.") and name[4:] in names:
                return False
            if isinstance(what, str) and what.startswith("=>") and what[2:] not in names:
                return False
    return True


FOLDER_CASES = [c for c in CASES if _as_folders(c[1])]


@pytest.mark.parametrize(("layers", "image"), [(c[1], c[2]) for c in FOLDER_CASES], ids=[c[0] for c in FOLDER_CASES])
def test_overlay_folders_read_as_layers_show_what_their_tars_show(tmp_path: Path, layers: list[list[Member]],
                                                                  image: dict[str, str]) -> None:
    read_layers = []
    for i, members in enumerate(layers):
        folder = tmp_path / str(i)
        folder.mkdir()
        if not _make_folder(folder, members):
            pytest.skip("this host cannot make overlay whiteouts or user.overlay.opaque marks")
        layer = from_folder(str(folder))
        assert layer is not None
        read_layers.append(layer)
    flat = flatten(read_layers)
    assert {p: ("dir" if e.kind == "dir" else f"link:{e.target}" if e.kind == "link" else SHA.get(e.sha256))
            for p, e in flat.entries.items()} == image


def test_an_opaque_mark_that_cannot_be_read_is_no_answer_never_not_opaque(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"a")

    def refused(path: str, name: str, follow_symlinks: bool = True) -> bytes:
        # A host that may not read trusted.* attributes (not root): the kernel's answer, not one this host gives.
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(os, "getxattr", refused)
    assert from_folder(str(tmp_path)) is None
    assert from_folder(str(tmp_path), under="/d") is None


def test_an_image_whose_opaque_mark_cannot_be_read_is_read_from_its_export(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    lower.mkdir(), upper.mkdir()
    (upper / "d").mkdir()
    blobs = [tar([("d", None), ("d/f", b"a")]), tar([("d", None), ("d/.wh..wh..opq", b""), ("d/g", b"b")])]
    info = ImageInfo.from_inspect({"Id": "sha256:" + "1" * 64, "GraphDriver": {
        "Name": "overlay2", "Data": {"LowerDir": str(lower), "UpperDir": str(upper)}}, "RootFS": {
        "Layers": ["sha256:" + hashlib.sha256(b).hexdigest() for b in blobs]}})
    exported: list[int] = []

    def export() -> list[io.BytesIO]:
        exported.append(1)
        return [io.BytesIO(b) for b in blobs]

    monkeypatch.setattr(os, "getxattr", lambda *_a, **_k: (_ for _ in ()).throw(PermissionError(errno.EACCES, "no")))
    [top] = layer_read.from_folders_or(export)(info, 1)
    assert exported == [1] and top.entries["/d"].opaque and "/d/g" in top.entries


# -- diff IDs -------------------------------------------------------------------------


def test_a_layer_whose_uncompressed_tar_is_not_its_diff_id_is_refused() -> None:
    raw = tar([("d", None), ("d/f", b"a")])
    blob = gzip.compress(raw, mtime=0)
    good = "sha256:" + hashlib.sha256(raw).hexdigest()
    for media, body in (("application/vnd.oci.image.layer.v1.tar+gzip", blob),
                        ("application/vnd.oci.image.layer.v1.tar", raw)):
        assert "/d/f" in checked(uncompressed(io.BytesIO(body), media), good, "layer 1").entries
    with pytest.raises(EngineError, match="diff ID"):
        checked(uncompressed(io.BytesIO(blob), "application/vnd.oci.image.layer.v1.tar+gzip"),
                "sha256:" + hashlib.sha256(blob).hexdigest(), "layer 1")


def test_an_export_is_read_by_diff_id_and_one_it_lacks_is_named() -> None:
    blobs = [tar([("a", b"a")]), tar([("b", b"b")])]
    ids = ["sha256:" + hashlib.sha256(b).hexdigest() for b in blobs]
    [top] = from_export([io.BytesIO(b"not a tar at all" * 64), *(io.BytesIO(b) for b in reversed(blobs))], ids, 1,
                        "image x")
    assert set(top.entries) == {"/b"}
    with pytest.raises(EngineError, match="lacks layer"):
        from_export([io.BytesIO(blobs[0])], ids, 1, "image x")


# -- the registry scan: a base's layers read newest first, left once every wanted path is decided ------------


def test_one_layer_gives_site_version_folders_and_the_file() -> None:
    got = run(Blobs([layer(installed())]))
    assert got.site_dir == f"/{SITE}" and got.package_dir == f"/{SITE}/vllm" and got.version == "0.25.1"
    assert [f.path for f in got.folders] == [f"/{'/'.join(SITE.split('/')[:i])}" for i in range(1, 6)]
    assert got.folders[0].mode == 0o755 and got.folders[0].mtime == 1
    assert got.files[REL] == {"kind": "file", "real": True, "mode": 0o644, "data": b"x = 1\n"}
    assert not got.notes and got.layers_read == 1


def test_the_newest_layer_holding_the_file_wins_and_lower_layers_are_not_opened() -> None:
    upper = layer([*folders(f"{SITE}/vllm/models/m"), member(f"{SITE}/{REL}", b"x = 2\n", mode=0o600)])
    blobs = Blobs([layer([member("opt/filler", b"\0" * 4096)]), layer(installed()), upper])
    got = run(blobs)
    assert got.files[REL]["data"] == b"x = 2\n" and got.files[REL]["mode"] == 0o600
    assert blobs.opened == [2, 1]  # the filler layer below the package is never read
    assert got.folders[-1].mtime == 5  # a folder's facts come from the newest layer that lists it


MISSING = {"kind": "missing", "real": True, "mode": 0, "data": None}
SCAN_CASES = [
    # (what it pins, the layer above the installation, what the scan says of the patched file)
    ("a whiteout of the file removes it",
     [*folders(f"{SITE}/vllm/models/m"), member(f"{SITE}/vllm/models/m/.wh.indexer.py", b"")], MISSING),
    ("a whiteout of a folder above removes it",
     [*folders(f"{SITE}/vllm/models"), member(f"{SITE}/vllm/models/.wh.m", b"")], MISSING),
    ("an opaque folder above hides it",
     [*folders(f"{SITE}/vllm/models/m"), member(f"{SITE}/vllm/models/m/.wh..wh..opq", b"")], MISSING),
    ("an opaque folder above, with the file made anew in it",
     [*folders(f"{SITE}/vllm/models/m"), member(f"{SITE}/vllm/models/m/.wh..wh..opq", b""),
      member(f"{SITE}/{REL}", b"x = 3\n")], {"kind": "file", "real": True, "mode": 0o644, "data": b"x = 3\n"}),
    ("a file in place of a folder above removes it",
     [*folders(f"{SITE}/vllm/models"), member(f"{SITE}/vllm/models/m", b"not a folder")], MISSING),
    # Reached through a link: refused as the engine path refuses it (its probe sees the link on the way).
    ("a link in place of a folder above",
     [*folders(f"{SITE}/vllm/models"), member(f"{SITE}/vllm/models/m", kind="link", target="/x")],
     {"kind": "file", "real": False, "mode": 0, "data": None}),
    ("a folder of the same name above keeps it",
     folders(f"{SITE}/vllm/models/m"), {"kind": "file", "real": True, "mode": 0o644, "data": b"x = 1\n"}),
]


@pytest.mark.parametrize(("upper", "said"), [(c[1], c[2]) for c in SCAN_CASES], ids=[c[0] for c in SCAN_CASES])
def test_whiteouts_opaque_folders_and_links_decide_for_the_layers_below(upper: list, said: dict) -> None:
    assert run(Blobs([layer(installed()), layer(upper)])).files[REL] == said


def test_a_sorted_layer_is_left_once_past_the_files_and_an_unsorted_one_is_read_to_its_end() -> None:
    noise = random.Random(5)
    tail = [member(f"{SITE}/zzz/big{i}", noise.randbytes(1 << 18)) for i in range(8)]
    sorted_layer = layer(installed(extra=tail))
    blobs = Blobs([sorted_layer])
    got = run(blobs)
    assert got.bytes_read < len(sorted_layer) / 2, (got.bytes_read, len(sorted_layer))
    shuffled = layer(list(reversed(installed(extra=tail))), ordered=False)
    assert run(Blobs([shuffled])).bytes_read == len(shuffled)


def test_stale_pycs_are_those_the_image_shows() -> None:
    cache = f"{SITE}/vllm/models/m/__pycache__"
    lower = layer(installed(extra=[*folders(cache), member(f"{cache}/indexer.cpython-311.pyc", b"A" * 20),
                                   member(f"{cache}/indexer.cpython-311.opt-1.pyc", b"B" * 20)]))
    upper = layer([*folders(cache), member(f"{cache}/.wh.indexer.cpython-311.opt-1.pyc", b""),
                   member(f"{cache}/indexer.cpython-312.pyc", b"C" * 20)])
    got = run(Blobs([lower, upper]))
    assert got.pycs[REL] == {"vllm/models/m/__pycache__/indexer.cpython-311.pyc": b"A" * 20,
                             "vllm/models/m/__pycache__/indexer.cpython-312.pyc": b"C" * 20}


def test_no_installation_two_installations_and_a_bad_digest_are_named() -> None:
    with pytest.raises(BaseImageError, match="no layer holds an installed vllm"):
        run(Blobs([layer([member("etc/hostname", b"x")])]))
    other = [(n.replace(SITE, "opt/venv/site"), *rest) for n, *rest in installed()]
    # Two installations that the layers read show (here one layer, not in path order, so read whole).
    with pytest.raises(BaseImageError, match="installed in /opt/venv/site and /usr"):
        run(Blobs([layer([*installed(), *folders("opt/venv/site"), *other], ordered=False)]))
    blobs = Blobs([layer(installed())])
    refs = blobs.refs
    bad = [LayerRef("sha256:" + "0" * 64, refs[0].media_type, refs[0].size)]
    with pytest.raises(BaseImageError, match="hash to"):
        locate(bad, lambda _r: io.BytesIO(blobs.blobs[0]), "vllm", [REL], "test/base")
    # A layer that says zstd but is not: one line naming it, not a traceback.
    with pytest.raises(BaseImageError, match="is not a readable tar"):
        locate([LayerRef(refs[0].digest, "application/vnd.oci.image.layer.v1.tar+zstd", refs[0].size)],
               blobs.open, "vllm", [REL], "test/base")
    # A path named twice in a layer: the one reader's refusal, as the base's fault.
    with pytest.raises(BaseImageError, match="twice"):
        run(Blobs([layer([*installed(), member(f"{SITE}/{REL}", b"x = 2\n")], ordered=False, unique=False)]))
