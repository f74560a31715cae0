"""File facts judged from an image's layers: the tar-stream hashing and the comparisons, no engine."""

from __future__ import annotations

import hashlib
import io
import py_compile
import tarfile
from pathlib import Path

import pytest

from vllm_hotfix.engine import FileFact, Tree
from vllm_hotfix.engine.files import CHUNK, scan_tar
from vllm_hotfix.judges import integrity
from vllm_hotfix.sitefacts.site import keep_metadata

SITE = "/site"


def _tar(members: list[tuple[str, bytes | str | None]]) -> bytes:
    """bytes: a file; str: a symbolic link to it; None: a folder."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def test_tar_stream_hashes_in_one_pass_keeps_only_what_is_asked_and_reports_links() -> None:
    big = bytes(range(256)) * (CHUNK // 256 + 1_000)  # more than one of the scanner's chunks
    raw = _tar([("pkg", None), ("pkg/a.py", b"x = 1\n"), ("pkg/big.so", big), ("pkg/ln.py", "../elsewhere.py"),
                ("pkg-1.dist-info/RECORD", b"rows")])
    small = _tar([("pkg", None), ("pkg/a.py", b"x = 1\n"), ("pkg/ln.py", "../elsewhere.py"),
                  ("pkg-1.dist-info/RECORD", b"rows")])
    # The engine streams arbitrary chunk sizes; the answer does not depend on them (one byte at a time on
    # the members without the big one: a million one-byte chunks cost a second).
    for archive, size in ((raw, 7), (raw, 4096), (raw, len(raw)), (small, 1)):
        entries, kept = scan_tar(_chunks(archive, size), SITE, keep_metadata)
        if archive is raw:
            assert entries[f"{SITE}/pkg/big.so"].sha256 == hashlib.sha256(big).hexdigest()
        assert entries[f"{SITE}/pkg/a.py"].kind == "file" and entries[f"{SITE}/pkg"].kind == "dir"
        assert entries[f"{SITE}/pkg/a.py"].sha256 == hashlib.sha256(b"x = 1\n").hexdigest()
        link = entries[f"{SITE}/pkg/ln.py"]
        assert link.kind == "link" and link.target == "../elsewhere.py" and not link.sha256
        assert kept == {f"{SITE}/pkg-1.dist-info/RECORD": b"rows"}


def _site(files: dict[str, bytes | str], record: dict[str, bytes] | None = None, requires: str = "") -> Tree:
    """A site folder holding ``files``, with a dist-info for pkg whose RECORD lists ``record`` (default: files)."""
    listed = files if record is None else record
    rows = "".join(f"{rel},sha256={integrity.record_hash(hashlib.sha256(data).hexdigest())},{len(data)}\n"
                   for rel, data in listed.items() if isinstance(data, bytes))
    rows += "pkg-1.dist-info/RECORD,,\n"
    meta = f"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n{requires}".encode()
    members: list[tuple[str, bytes | str | None]] = [
        *files.items(), ("pkg-1.dist-info/METADATA", meta), ("pkg-1.dist-info/RECORD", rows.encode())]
    entries, kept = scan_tar(_chunks(_tar(members), 512), SITE, keep_metadata)
    return Tree(entries, kept)


CLEAN = {"pkg/__init__.py": b"", "pkg/mod.py": b"y = 1\n", "pkg/_C.abi3.so": b"\x7fELF"}


def test_a_clean_tree_passes() -> None:
    found = integrity.scan(_site(CLEAN), SITE, "pkg")
    judged = integrity.judge(found, "pkg", None)
    assert judged.check["status"] == "pass" and judged.check["data"]["answered_by"] == "filesystem"
    assert found.checked == 3 and not judged.compiled_missing and not judged.compiled_missing_base


def test_a_changed_file_outside_the_patch_set_is_named() -> None:
    tree = _site({**CLEAN, "pkg/mod.py": b"y = 2\n"}, record=CLEAN)
    judged = integrity.judge(integrity.scan(tree, SITE, "pkg"), "pkg", None)
    assert judged.check["status"] == "fail" and "pkg: pkg/mod.py" in judged.check["detail"]


def test_patched_files_are_held_to_their_expected_hash_not_record() -> None:
    patched = {**CLEAN, "pkg/mod.py": b"y = 3\n"}
    tree = _site(patched, record=CLEAN)
    good = {"pkg/mod.py": hashlib.sha256(b"y = 3\n").hexdigest()}
    assert integrity.judge(integrity.scan(tree, SITE, "pkg", good), "pkg", None).check["status"] == "pass"
    other = {"pkg/mod.py": hashlib.sha256(b"y = 4\n").hexdigest()}
    assert integrity.judge(integrity.scan(tree, SITE, "pkg", other), "pkg", None).check["status"] == "fail"


def test_unlisted_files_are_named_except_the_patched_files_bytecode() -> None:
    tree = _site({**CLEAN, "pkg/__pycache__/mod.cpython-311.pyc": b"pyc", "pkg/extra.py": b"evil()\n"},
                 record=CLEAN)
    patched = {"pkg/mod.py": hashlib.sha256(b"y = 1\n").hexdigest()}
    judged = integrity.judge(integrity.scan(tree, SITE, "pkg", patched), "pkg", None)
    assert judged.check["status"] == "fail"
    assert "pkg/extra.py" in judged.check["detail"] and "mod.cpython-311.pyc" not in judged.check["detail"]


def test_a_link_in_place_of_a_listed_file_is_a_deviation_not_followed() -> None:
    tree = _site({**CLEAN, "pkg/mod.py": "/etc/passwd"}, record=CLEAN)
    judged = integrity.judge(integrity.scan(tree, SITE, "pkg"), "pkg", None)
    assert judged.check["status"] == "fail" and "pkg/mod.py" in judged.check["detail"]


def test_missing_compiled_files_the_base_lacked_too_are_the_bases_and_named() -> None:
    sources_only = {k: v for k, v in CLEAN.items() if not k.endswith(".so")}
    base = integrity.scan(_site(sources_only, record=CLEAN), SITE, "pkg").to_dict()
    image = integrity.scan(_site(sources_only, record=CLEAN), SITE, "pkg")
    judged = integrity.judge(image, "pkg", base)
    assert judged.check["status"] == "pass"
    assert judged.compiled_missing_base == ("pkg/_C.abi3.so",) and not judged.compiled_missing
    assert "the base's, not the hotfix's: 1 compiled file(s)" in judged.check["detail"]
    # Removed by the image itself (the base had it): the hotfix's own failure.
    clean_base = integrity.scan(_site(CLEAN), SITE, "pkg").to_dict()
    judged = integrity.judge(image, "pkg", clean_base)
    assert judged.check["status"] == "fail" and judged.compiled_missing == ("pkg/_C.abi3.so",)
    assert "new in this image" in judged.check["detail"]


def test_a_base_deviation_altered_again_is_new() -> None:
    record = CLEAN
    base = integrity.scan(_site({**CLEAN, "pkg/mod.py": b"y = 2\n"}, record=record), SITE, "pkg").to_dict()
    again = integrity.scan(_site({**CLEAN, "pkg/mod.py": b"y = 5\n"}, record=record), SITE, "pkg")
    assert integrity.judge(again, "pkg", base).check["status"] == "fail"


def _pyc(tmp_path: Path, source: bytes, mode: py_compile.PycInvalidationMode) -> bytes:
    src = tmp_path / "m.py"
    src.write_bytes(source)
    out = tmp_path / "m.pyc"
    py_compile.compile(str(src), cfile=str(out), invalidation_mode=mode)
    return out.read_bytes()


@pytest.mark.parametrize("mode, compiled_from, state", [
    (py_compile.PycInvalidationMode.CHECKED_HASH, b"x = 1\n", "checked"),
    (py_compile.PycInvalidationMode.CHECKED_HASH, b"x = 2\n", "stale (hash mismatch)"),
    (py_compile.PycInvalidationMode.UNCHECKED_HASH, b"x = 2\n", "stale (hash-based, unchecked"),
    (py_compile.PycInvalidationMode.TIMESTAMP, b"x = 1\n", "stale (timestamp"),
])
def test_landed_judges_patched_files_and_their_bytecode(tmp_path: Path, mode: py_compile.PycInvalidationMode,
                                                        compiled_from: bytes, state: str) -> None:
    source = b"x = 1\n"
    pyc = _pyc(tmp_path, compiled_from, mode)
    path = f"{SITE}/pkg/m.py"
    pyc_path = f"{SITE}/pkg/__pycache__/m.cpython-311.pyc"
    st = (tmp_path / "m.py").stat()
    entries = {path: FileFact(path, "file", len(source), hashlib.sha256(source).hexdigest(), mtime=int(st.st_mtime)),
               pyc_path: FileFact(pyc_path, "file", len(pyc), hashlib.sha256(pyc).hexdigest())}
    tree = Tree(entries, {pyc_path: pyc, path: source})
    got = integrity.landed(tree, SITE, {"pkg/m.py": hashlib.sha256(source).hexdigest()}, "", {"pkg/m.py": source})
    assert got.files["pkg/m.py"]["bytecode"]["m.cpython-311.pyc"].startswith(state)
    assert bool(got.problems) == (state != "checked")
    wrong = integrity.landed(tree, SITE, {"pkg/m.py": hashlib.sha256(b"x = 9\n").hexdigest()})
    assert any("altered after the build" in p for p in wrong.problems)
