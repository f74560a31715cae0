"""Definitions and patch validation."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vllm_hotfix.building import definitions, patches
from vllm_hotfix.errors import BaseImageError, DefinitionError, PatchError

REPO = Path(__file__).resolve().parents[2]


def test_shipped_definition_loads() -> None:
    d = definitions.load(REPO, "v0.25.1")
    assert (d.base_repository, d.package, d.package_version, d.suffix) == (
        "vllm/vllm-openai", "vllm", "0.25.1", "m3patch"
    )
    assert d.output_ref() == "vllm/vllm-openai:v0.25.1-m3patch"
    assert d.output_ref("registry.local/vllm") == "registry.local/vllm:v0.25.1-m3patch"


@pytest.mark.parametrize(
    "text, message",
    [
        ('[base]\ntag = "v0.25.1"\n[package]\nname="vllm"\n[patches]\nset="v0.25.1"\n', "missing output.suffix"),
        ('[base]\ntag = "v0.25.2"\n[package]\nname="vllm"\n[patches]\nset="x"\n[output]\nsuffix="p"\n',
         "base.tag is 'v0.25.2'"),
        ('[base]\ntag = "v0.25.1"\ncolour = 1\n', "unknown key base.colour"),
        ('[base]\ntag = "v0.25.1"\n[package]\nname="vllm"\n[patches]\nset="../x"\n[output]\nsuffix="p"\n',
         "not a plain name"),
        ("[base\n", "not valid TOML"),
    ],
)
def test_bad_definitions_name_the_file(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "images").mkdir()
    path = tmp_path / "images" / "v0.25.1.toml"
    path.write_text(text)
    with pytest.raises(DefinitionError) as err:
        definitions.load(tmp_path, "v0.25.1")
    assert message in str(err.value)
    assert str(path) in str(err.value)


PINNED = ('[base]\ntag = "v0.25.1"\n[base.digests]\n{pins}\n[package]\nname="vllm"\n[patches]\nset="v0.25.1"\n'
          '[output]\nsuffix="p"\n')
IMAGE_ID = "sha256:" + "ab" * 32


def _pinned(tmp_path: Path, pins: str) -> definitions.ImageDefinition:
    (tmp_path / "images").mkdir(exist_ok=True)
    (tmp_path / "images" / "v0.25.1.toml").write_text(PINNED.format(pins=pins))
    return definitions.load(tmp_path, "v0.25.1")


def test_a_pinned_base_refuses_another_id_naming_both(tmp_path: Path) -> None:
    d = _pinned(tmp_path, f'"linux/amd64" = "{IMAGE_ID}"')
    assert d.base_digests == {"linux/amd64": IMAGE_ID}
    assert d.base_problem(IMAGE_ID, "linux/amd64", "vllm/vllm-openai:v0.25.1") is None
    other = "sha256:" + "cd" * 32
    with pytest.raises(BaseImageError) as err:
        d.check_base(other, "linux/amd64", "mirror/vllm-openai:v0.25.1")
    assert str(err.value) == (f"base mirror/vllm-openai:v0.25.1 is {other}; definition v0.25.1 pins {IMAGE_ID} for "
                              f"linux/amd64 ({tmp_path / 'images' / 'v0.25.1.toml'})")
    assert "pins the base for linux/amd64 only" in str(d.base_problem(IMAGE_ID, "linux/arm64/v8", "x:v0.25.1"))
    # Without the table nothing is pinned: the shipped definition (see the runbook on pinning the real base).
    assert definitions.load(REPO, "v0.25.1").base_digests == {}
    assert definitions.load(REPO, "v0.25.1").base_problem(other, "linux/amd64", "x") is None


@pytest.mark.parametrize("pins, message", [
    ('"linux/amd64" = "sha256:abc"', "must be an image ID"),
    (f'"amd64" = "{IMAGE_ID}"', "is not a platform"),
    ("", "must be a table of platform"),
])
def test_a_bad_pin_names_the_file(tmp_path: Path, pins: str, message: str) -> None:
    with pytest.raises(DefinitionError, match=message) as err:
        _pinned(tmp_path, pins)
    assert str(tmp_path / "images" / "v0.25.1.toml") in str(err.value)


def test_unknown_base_lists_known(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    with pytest.raises(DefinitionError, match="no image definition for base v9"):
        definitions.load(tmp_path, "v9")


def test_shipped_patch_set_validates() -> None:
    [p] = patches.load_series(REPO, "v0.25.1", "vllm")
    assert p.files == (
        "vllm/models/minimax_m3/common/indexer.py",
        "vllm/models/minimax_m3/common/sparse_attention.py",
    )
    assert len(p.hunks) == 4
    assert "https://github.com/vllm-project/vllm/pull/49149" in p.header
    assert "Shipped-in: vllm 0.27.0" in p.header


DIFF = """--- a/{src}
+++ b/{dst}
@@ -1,2 +1,2 @@
 x = 1
-y = 2
+y = 3
"""


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ("/etc/passwd", "/etc/passwd", "absolute path"),
        ("vllm/../../etc/x.py", "vllm/../../etc/x.py", "contains '..'"),
        ("torch/x.py", "torch/x.py", "outside the vllm package"),
        ("vllm/a.py", "vllm/b.py", "renames are not supported"),
    ],
)
def test_unsafe_paths_are_refused(src: str, dst: str, message: str) -> None:
    text = DIFF.format(src=src, dst=dst).replace("--- a//", "--- /").replace("+++ b//", "+++ /")
    with pytest.raises(PatchError) as err:
        patches.validate(text, "0001-x.patch", "vllm")
    assert message in str(err.value)
    assert "0001-x.patch" in str(err.value)


def test_malformed_diff_is_refused() -> None:
    text = "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,3 +1,3 @@\n x\n-y\n"
    with pytest.raises(PatchError, match="0002-bad.patch: malformed diff"):
        patches.validate(text, "0002-bad.patch", "vllm")


def test_text_without_diff_is_refused() -> None:
    with pytest.raises(PatchError, match="contains no diff"):
        patches.validate("just words\n", "0003.patch", "vllm")


def test_series_names_only_local_files(tmp_path: Path) -> None:
    folder = tmp_path / "patches" / "s"
    folder.mkdir(parents=True)
    (folder / "series").write_text("# comment\n../evil.patch\n")
    with pytest.raises(PatchError, match="is not a patch file name"):
        patches.load_series(tmp_path, "s", "vllm")
    (folder / "series").write_text("0001-missing.patch\n")
    with pytest.raises(PatchError, match="listed in series but missing"):
        patches.load_series(tmp_path, "s", "vllm")


def _tree(tmp_path: Path, body: str) -> Path:
    work = tmp_path / "w"
    (work / "vllm").mkdir(parents=True)
    (work / "vllm" / "m.py").write_text(body)
    return work


def _patch_file(tmp_path: Path, old: str, new: str) -> patches.Patch:
    a, b = tmp_path / "a" / "vllm", tmp_path / "b" / "vllm"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (a / "m.py").write_text(old)
    (b / "m.py").write_text(new)
    diff = subprocess.run(["diff", "-u", "a/vllm/m.py", "b/vllm/m.py"], cwd=tmp_path, capture_output=True, text=True)
    path = tmp_path / "0001-m.patch"
    path.write_text(diff.stdout)
    return patches.load_patch(path, "vllm")


OLD = "".join(f"line {i}\n" for i in range(1, 21))
NEW = OLD.replace("line 10\n", "line ten\n")


def test_classify_needed_included_conflicts(tmp_path: Path) -> None:
    p = _patch_file(tmp_path, OLD, NEW)
    assert patches.classify(p, _tree(tmp_path, OLD))[0] == patches.NEEDED
    (tmp_path / "w").rename(tmp_path / "w1")
    assert patches.classify(p, _tree(tmp_path, NEW))[0] == patches.INCLUDED
    (tmp_path / "w").rename(tmp_path / "w2")
    other = OLD.replace("line 9\n", "nine\n").replace("line 10\n", "ten!\n").replace("line 11\n", "eleven\n")
    assert patches.classify(p, _tree(tmp_path, other))[0] == patches.CONFLICTS


def test_reverse_batch_trap_is_avoided(tmp_path: Path) -> None:
    """`patch -R --dry-run --batch` says 0 on an unpatched tree; classify must not."""
    p = _patch_file(tmp_path, OLD, NEW)
    work = _tree(tmp_path, OLD)
    trap = subprocess.run(
        ["patch", "-p1", "-R", "--dry-run", "--batch", "-d", str(work), "-i", str(p.path)],
        capture_output=True, text=True,
    )
    assert trap.returncode == 0  # the trap is real in the installed GNU patch
    assert patches.classify(p, work)[0] == patches.NEEDED


def test_fuzz_is_reported_as_fuzz(tmp_path: Path) -> None:
    p = _patch_file(tmp_path, OLD, NEW)
    work = _tree(tmp_path, OLD.replace("line 7\n", "line seven\n"))
    with pytest.raises(patches.PatchNeedsFuzz) as err:
        patches.apply_series([p], work)
    assert "hunk #1 (@@ -7,7 +7,7 @@) of vllm/m.py applies only with fuzz" in str(err.value)
    assert (work / "vllm" / "m.py").read_text() == OLD.replace("line 7\n", "line seven\n")
    assert not list(work.rglob("*.rej")) and not list(work.rglob("*.orig"))


def test_a_base_carrying_one_file_of_the_patch_is_named_by_that_file(tmp_path: Path) -> None:
    """One of the two files already patched, the other as released: the error names the file the base already
    carries, not a hunk of the other file (which applies) as failing."""
    from vllm_hotfix.building import patches
    from vllm_hotfix.errors import PatchError

    new_a = "one\ntwo and a half\nthree\nfour\n"  # a.py as the patch leaves it
    old_b = "alpha\nbeta\ngamma\ndelta\n"  # b.py as released
    diff = (
        "--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -1,4 +1,4 @@\n one\n-two\n+two and a half\n three\n four\n"
        "--- a/vllm/b.py\n+++ b/vllm/b.py\n@@ -1,4 +1,4 @@\n alpha\n beta\n-gamma\n+gamma, fixed\n delta\n"
    )
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "0001-x.patch").write_text(diff)
    patch = patches.load_patch(tmp_path / "set" / "0001-x.patch", "vllm")
    tree = tmp_path / "tree" / "vllm"
    tree.mkdir(parents=True)
    (tree / "a.py").write_text(new_a)  # already carries its half
    (tree / "b.py").write_text(old_b)
    with pytest.raises(PatchError) as info:
        patches.apply_series([patch], tmp_path / "tree")
    said = str(info.value)
    assert "vllm/a.py already carries this patch's change in the base; vllm/b.py does not" in said, said
    assert "does not apply" not in said
    assert (tree / "a.py").read_text() == new_a and (tree / "b.py").read_text() == old_b  # nothing touched
    assert not list((tmp_path / "tree").rglob("*.rej")) and not list((tmp_path / "tree").rglob("*.orig"))


def test_a_full_tmpdir_is_named_not_only_the_scratch_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GNU patch writes its temporary files in TMPDIR: a full one is named, not only the scratch folder (which
    Python may have put in /tmp when TMPDIR took no file). A stand-in `patch` on PATH answers as GNU patch does
    on a full disk (a real full disk cannot be made here)."""
    from vllm_hotfix.building import patches
    from vllm_hotfix.errors import StorageError

    fake = tmp_path / "bin" / "patch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'patch: **** write error : No space left on device' >&2\nexit 2\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "full-tmp"))
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "0001-x.patch").write_text("--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -1 +1 @@\n-a\n+b\n")
    patch = patches.load_patch(tmp_path / "set" / "0001-x.patch", "vllm")
    (tmp_path / "tree" / "vllm").mkdir(parents=True)
    (tmp_path / "tree" / "vllm" / "a.py").write_text("a\n")
    with pytest.raises(StorageError) as info:
        patches.apply_series([patch], tmp_path / "tree")
    said = str(info.value)
    assert f"TMPDIR={tmp_path / 'full-tmp'}" in said and "No space left on device" in said, said
