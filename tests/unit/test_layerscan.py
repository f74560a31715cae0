"""The registry build's other parts: bytecode for the image's Python, the manifest limit and TLS without an engine,
option refusals, the progress of a long read, and layer streams read by their media type. (How the layer scan
reads layers is pinned in test_layers.py, with the one layer reader's tables.)"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import sys
from pathlib import Path

import pytest
from layer_tars import REL, installed, layer

from conftest import cli, fails
from vllm_hotfix.building import bytecode as hostbytecode
from vllm_hotfix.engine.dockerconfig import registry_secure_without_engine
from vllm_hotfix.errors import BaseImageError, PushError, UsageError
from vllm_hotfix.registry import write as regwrite
from vllm_hotfix.registry.layerscan import LayerRef, locate


def test_bytecode_is_compiled_by_a_python_of_the_images_version_or_whited_out() -> None:
    tag, magic = sys.implementation.cache_tag, importlib.util.MAGIC_NUMBER
    mine = {REL: {f"vllm/models/m/__pycache__/indexer.{tag}.pyc": magic + b"\0" * 12}}
    got = hostbytecode.choose("auto", mine, None)
    assert got.mode == "compiled" and got.python and got.cache_tag == tag
    # Every name the image's Python could load for the patched file, not only the one the layers read showed.
    assert hostbytecode.choose("whiteout", mine, None).whiteouts == tuple(
        f"vllm/models/m/__pycache__/indexer.{tag}{level}.pyc" for level in (".opt-1", ".opt-2", ""))
    foreign = {REL: {"vllm/models/m/__pycache__/indexer.cpython-399.pyc": b"\x01\x02\r\n" + b"\0" * 12}}
    assert hostbytecode.choose("auto", foreign, None).mode == "whiteouts"
    # Not a docker build's code (6): no engine is involved, the option cannot be honoured here (64).
    with pytest.raises(UsageError, match="no Python of the image's version") as info:
        hostbytecode.choose("compile", foreign, None)
    assert info.value.exit_code == 64 and "--bytecode auto" in str(info.value.hint)
    with pytest.raises(UsageError, match="no pyc in the base's layers read tells its Python's version"):
        hostbytecode.choose("compile", {REL: {}}, None)
    assert hostbytecode.choose("auto", {REL: {}}, None).mode == "none"
    assert hostbytecode.choose("auto", {REL: {}}, (f"x.{tag}.pyc", magic + b"\0" * 12)).mode == "compiled"
    pycs = hostbytecode.compile_here(sys.executable, {REL: b"x = 1\n"}, {REL: [1]}, {REL: "p.patch"})
    names = sorted(pycs[REL])
    cache = "vllm/models/m/__pycache__"
    assert names == [f"{cache}/indexer.{tag}.opt-1.pyc", f"{cache}/indexer.{tag}.pyc"]
    pyc = pycs[REL][names[1]]
    assert pyc[:4] == magic and int.from_bytes(pyc[4:8], "little") == 0b11  # checked hash
    assert b"/tmp/vllm-hotfix/vllm/models/m/indexer.py" in pyc  # the name the image's own compile gives


def test_manifest_size_limit_and_tls_without_an_engine(tmp_path: Path) -> None:
    regwrite.check_size(b"x" * regwrite.MANIFEST_LIMIT, "ok")
    with pytest.raises(PushError, match="over the 4194304 bytes"):
        regwrite.check_size(b"x" * (regwrite.MANIFEST_LIMIT + 1), "big/repo@sha256:x")
    conf = tmp_path / "daemon.json"
    conf.write_text('{"insecure-registries": ["registry.lan:5000", "10.9.0.0/16"]}')
    assert not registry_secure_without_engine("127.0.0.1:5000", str(conf))
    assert not registry_secure_without_engine("registry.lan:5000", str(conf))
    assert not registry_secure_without_engine("10.9.1.2:443", str(conf))
    assert registry_secure_without_engine("10.8.1.2:443", str(conf))
    assert registry_secure_without_engine("10.8.1.2:443", str(tmp_path / "absent.json"))


@pytest.mark.parametrize("args, needle", [
    (("--in-registry",), "--in-registry writes the image into a registry: hotfix-test/"),
    (("--bytecode", "whiteout"), "--bytecode is for --in-registry"),
    (("--in-registry", "--builder", "assemble", "--tag", "127.0.0.1:9/x:y"), "--builder is for a build in the engine"),
    (("--in-registry", "--pull", "never", "--tag", "127.0.0.1:9/x:y"), "--pull is for a build in the engine"),
])
def test_in_registry_refusals_come_before_any_registry_or_engine(args: tuple[str, ...], needle: str,
                                                                 project: Path) -> None:
    r = cli("image", "--definition", "v0.25.1", *args, root=project)
    fails(r, needle)
    assert r.rc == 64


def test_a_long_read_says_how_far_it_got_every_few_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every TICK_S seconds of a layer's read, one line with the bytes read of the layer's size; none before."""
    import io

    from vllm_hotfix.registry import layerscan as ls

    clock = iter([0.0, 1.0, 6.0, 7.0, 12.5, 13.0, 14.0, 15.0])
    monkeypatch.setattr(ls.time, "monotonic", lambda: next(clock))
    lines: list[str] = []
    data = b"x" * (3 << 20)
    stream = ls.Counted(io.BytesIO(data), ls.LayerRef("sha256:" + "0" * 64, "gzip", len(data)), "layer 2/7",
                        lines.append)
    while stream.read(1 << 20):
        pass
    assert lines == [f"    layer 2/7: 2.0 of 3.0 MiB {ls.TICK_WORDS}", f"    layer 2/7: 3.0 of 3.0 MiB {ls.TICK_WORDS}"]


def test_a_python_without_zstandard_reads_every_other_layer_and_names_a_zstd_one(tmp_path: Path) -> None:
    """A GPU host's Python may lack zstandard: the tool still builds and smokes from gzip and plain layers, and a
    zstd layer is named in one line (the import failed at start, before 2026-12-06, for every layer)."""
    import subprocess

    code = """
import importlib.abc, io, sys, tarfile
class NoZstd(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "zstandard":
            raise ModuleNotFoundError("No module named 'zstandard'")
sys.meta_path.insert(0, NoZstd())
from vllm_hotfix.errors import BaseImageError
from vllm_hotfix.registry.compression import STREAM_ERRORS, tar_stream
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w:gz") as tar:
    info = tarfile.TarInfo("a"); info.size = 1; tar.addfile(info, io.BytesIO(b"x"))
buf.seek(0)
source, mode = tar_stream(buf, "application/vnd.oci.image.layer.v1.tar+gzip")
with tarfile.open(fileobj=source, mode=mode) as tar:
    print([m.name for m in tar])
try:
    tar_stream(io.BytesIO(b""), "application/vnd.oci.image.layer.v1.tar+zstd")
except BaseImageError as exc:
    print(exc)
print(len(STREAM_ERRORS))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    names, error, count = done.stdout.strip().splitlines()
    assert names == "['a']"
    assert "compressed with zstd" in error and "lacks the zstandard package" in error
    assert count == "5"  # tarfile's, EOF, OS, value and zlib errors: no zstandard one to catch


@pytest.mark.parametrize(("compress", "media_type", "said"), [
    ("zstd", "application/vnd.oci.image.layer.v1.tar+gzip", "its bytes are zstd-compressed, but its media type "
                                                            "application/vnd.oci.image.layer.v1.tar+gzip says gzip"),
    ("gzip", "application/vnd.oci.image.layer.v1.tar+zstd", "its bytes are gzip-compressed, but its media type "
                                                            "application/vnd.oci.image.layer.v1.tar+zstd says zstd"),
    ("none", "application/vnd.docker.image.rootfs.diff.tar.gzip", "its bytes are not compressed, but its media "
                                                                  "type application/vnd.docker.image.rootfs.diff."
                                                                  "tar.gzip says gzip"),
    ("zstd", "application/vnd.oci.image.layer.v1.tar", "its bytes are zstd-compressed, but its media type "
                                                       "application/vnd.oci.image.layer.v1.tar says uncompressed"),
])
def test_a_layer_whose_bytes_another_compression_than_its_media_type_names_is_refused(
        compress: str, media_type: str, said: str) -> None:
    """Read by the media type, checked against the bytes: a mislabelled layer is named in one line (zstd bytes
    under a gzip type were read and the image written, exit 0), whichever way it is mislabelled."""
    zstandard = pytest.importorskip("zstandard")
    plain = gzip.decompress(layer(installed()))
    blob = {"zstd": zstandard.ZstdCompressor().compress(plain), "gzip": gzip.compress(plain, mtime=0),
            "none": plain}[compress]
    ref = LayerRef("sha256:" + hashlib.sha256(blob).hexdigest(), media_type, len(blob))
    with pytest.raises(BaseImageError) as err:
        locate([ref], lambda _r: io.BytesIO(blob), "vllm", [REL], "test/base")
    assert said in str(err.value) and "\n" not in str(err.value)
    # Named rightly, each reads.
    right = {"zstd": "application/vnd.oci.image.layer.v1.tar+zstd", "gzip": "application/vnd.oci.image.layer."
             "v1.tar+gzip", "none": "application/vnd.oci.image.layer.v1.tar"}[compress]
    got = locate([LayerRef(ref.digest, right, ref.size)], lambda _r: io.BytesIO(blob), "vllm", [REL], "test/base")
    assert got.files[REL]["data"] == b"x = 1\n"
