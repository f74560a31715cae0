"""RECORD read on the host: typed rows, and every row of the wrong shape named (never a bare csv.reader)."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from vllm_hotfix import dist_record
from vllm_hotfix.engine import Tree
from vllm_hotfix.engine.files import scan_tar
from vllm_hotfix.judges import integrity
from vllm_hotfix.sitefacts.site import keep_metadata

EMPTY = "47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"  # sha256 of b"" as RECORD writes it


@pytest.mark.parametrize(("line", "row"), [
    (f"pkg/a.py,sha256={EMPTY},0", dist_record.RecordRow("pkg/a.py", "sha256", EMPTY, 0)),
    ("pkg-1.dist-info/RECORD,,", dist_record.RecordRow("pkg-1.dist-info/RECORD")),
    ("pkg/__pycache__/a.cpython-312.pyc,,", dist_record.RecordRow("pkg/__pycache__/a.cpython-312.pyc")),
    (f'"pkg/with, comma.py",sha256={EMPTY},0', dist_record.RecordRow("pkg/with, comma.py", "sha256", EMPTY, 0)),
    ("../../bin/tool,sha512=AAAA,12", dist_record.RecordRow("../../bin/tool", "sha512", "AAAA", 12)),
])
def test_a_row_of_the_right_shape_is_read_as_typed_fields(line: str, row: dist_record.RecordRow) -> None:
    record = dist_record.read(line + "\n")
    assert record.rows == (row,) and record.problems == ()


@pytest.mark.parametrize(("line", "why"), [
    ("pkg/a.py", "1 column(s), not 3"),
    ("pkg/a.py,", "2 column(s), not 3"),
    (f"pkg/a.py,sha256={EMPTY},0,extra", "4 column(s), not 3"),
    (f",sha256={EMPTY},0", "an empty path"),
    ("pkg/a.py,sha256,0", "is not ALGORITHM=DIGEST"),
    ("pkg/a.py,=abc,0", "is not ALGORITHM=DIGEST"),
    ("pkg/a.py,sha256=,0", "is not ALGORITHM=DIGEST"),
    ("pkg/a.py,sha256=@@@@,0", "is not urlsafe base64"),
    ("pkg/a.py,sha256=ab+/,0", "is not urlsafe base64"),
    (f"pkg/a.py,sha256={EMPTY}=,0", "is not urlsafe base64"),
    (f"pkg/a.py,sha256={EMPTY},-1", "is not a number of bytes"),
    (f"pkg/a.py,sha256={EMPTY},1.5", "is not a number of bytes"),
])
def test_a_row_of_the_wrong_shape_is_named_with_its_line_and_left_out(line: str, why: str) -> None:
    record = dist_record.read(f"pkg/ok.py,,\n\n{line}\n")
    assert record.rows == (dist_record.RecordRow("pkg/ok.py"),)
    assert len(record.problems) == 1 and record.problems[0].startswith("line 3: ") and why in record.problems[0]


def test_the_sha256_of_a_row_is_given_as_hex_and_the_path_placed_under_its_folder() -> None:
    [row] = dist_record.read(f"pkg/../pkg/a.py,sha256={EMPTY},0\n").rows
    assert row.sha256_hex() == hashlib.sha256(b"").hexdigest()
    assert row.under("/usr/lib/site") == "/usr/lib/site/pkg/a.py"


def test_an_installed_record_with_a_malformed_row_fails_integrity_naming_it() -> None:
    data = b"y = 1\n"
    digest = integrity.record_hash(hashlib.sha256(data).hexdigest())
    record = f"pkg/mod.py,sha256={digest},{len(data)}\npkg/evil.py\npkg-1.dist-info/RECORD,,\n".encode()
    members = {"pkg/__init__.py": b"", "pkg/mod.py": data, "pkg/evil.py": b"evil()\n",
               "pkg-1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n",
               "pkg-1.dist-info/RECORD": record}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    entries, kept = scan_tar(io.BytesIO(raw.getvalue()), "/site", keep_metadata)
    judged = integrity.judge(integrity.scan(Tree(entries, kept), "/site", "pkg"), "pkg", None)
    assert judged.check["status"] == "fail"
    assert "RECORD row(s) of the wrong shape" in judged.check["detail"]
    assert "pkg: RECORD line 2: 1 column(s), not 3" in judged.check["detail"]
