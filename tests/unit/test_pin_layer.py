"""The pip layer of pinned wheels, predicted from the install scheme and judged against what real pip writes.

A small wheel with every kind of part (the root, ``.data/scripts`` with a
``#!python`` line, ``.data/data``, ``.data/headers``, a console script) is
installed by this machine's own pip under ``--root``, with this Python's
scheme: the folder it fills, read as a layer, is exactly what the judge
admits; a file pip never writes there is named.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import runpy
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest

from vllm_hotfix.building import pinfile
from vllm_hotfix.judges import layer_read, pin_layer
from vllm_hotfix.judges.difference import Difference
from vllm_hotfix.layers import Layer, LayerEntry
from vllm_hotfix.layers.read import from_folder

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pip") is None, reason="this Python has no pip")

WHEEL = "demo_pin-1.0-py3-none-any.whl"
MEMBERS = {
    "demo_pin/__init__.py": b"def main():\n    return 0\n",
    "demo_pin-1.0.data/scripts/demo-tool": b"#!python\nimport demo_pin\n",
    "demo_pin-1.0.data/data/share/demo/notes.txt": b"notes\n",
    "demo_pin-1.0.data/headers/demo.h": b"int demo;\n",
    "demo_pin-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo-pin\nVersion: 1.0\n",
    "demo_pin-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    "demo_pin-1.0.dist-info/entry_points.txt": b"[console_scripts]\ndemo-run = demo_pin:main\n",
}


def _wheel(folder: Path) -> Path:
    import base64

    rows = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
            f"{len(data)}" for name, data in MEMBERS.items()]
    rows.append("demo_pin-1.0.dist-info/RECORD,,")
    path = folder / WHEEL
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in MEMBERS.items():
            zf.writestr(name, data)
        zf.writestr("demo_pin-1.0.dist-info/RECORD", "\n".join(rows) + "\n")
    return path


def _scheme() -> dict[str, str]:
    probe = runpy.run_path(str(resources.files("vllm_hotfix.inimage.probes") / "locate.py"), run_name="probe")
    scheme: dict[str, str] = probe["install_scheme"]()
    return scheme


@pytest.fixture(scope="module")
def pip_wrote(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the folder real pip filled from it under --root): pip runs once for this file's tests."""
    top = tmp_path_factory.mktemp("pip")
    wheel = _wheel(top)
    layer_root = top / "layer"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--no-index",
                    "--disable-pip-version-check", "--root", str(layer_root), str(wheel)],
                   check=True, capture_output=True, env={**os.environ, "PIP_NO_WARN_SCRIPT_LOCATION": "1"})
    return wheel, layer_root


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              pip_wrote: tuple[Path, Path]) -> tuple[Path, pinfile.PinSet, Layer]:
    """(project root, its pin set, the layer real pip writes for it under --root)."""
    root = tmp_path / "project"
    cache = tmp_path / "cache"
    (cache / "pin-wheels").mkdir(parents=True)
    monkeypatch.setenv("VLLM_HOTFIX_CACHE", str(cache))
    built, layer_root = pip_wrote
    wheel = cache / "pin-wheels" / built.name
    wheel.write_bytes(built.read_bytes())  # the very wheel pip installed
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    pins_txt = tmp_path / "pins.txt"
    pins_txt.write_text(pinfile.line("demo-pin", "1.0", [digest]))
    pinset = pinfile.parse(pins_txt.read_text(), pins_txt)
    layer = from_folder(str(layer_root), keep=layer_read.small_script, keep_max=layer_read.SCRIPT_MAX)
    assert layer is not None
    return root, pinset, layer


def _judge(root: Path, pinset: pinfile.PinSet, layer: Layer) -> Difference | None:
    return pin_layer.difference(layer, root, pinset, _scheme(), [], None, None)  # type: ignore[arg-type]


def test_what_real_pip_writes_from_the_pinned_wheel_is_admitted(
        installed: tuple[Path, pinfile.PinSet, Layer]) -> None:
    root, pinset, layer = installed
    scheme = _scheme()
    written = set(layer.entries)
    # Every part where pip puts it: nothing found by a suffix rule.
    assert f"{scheme['scripts']}/demo-tool" in written and f"{scheme['scripts']}/demo-run" in written
    assert f"{scheme['data']}/share/demo/notes.txt" in written
    assert f"{scheme['include']}/demo-pin/demo.h" in written
    assert _judge(root, pinset, layer) is None


@pytest.mark.parametrize("stray", [
    "/opt/elsewhere/bin/demo-tool",  # the script's name and bytes in a bin folder pip does not write to
    "/opt/elsewhere/data/share/demo/notes.txt",  # a data file under a data folder, not under the scheme's prefix
])
def test_a_wheels_file_at_a_path_pip_never_writes_is_refused(installed: tuple[Path, pinfile.PinSet, Layer],
                                                             stray: str) -> None:
    root, pinset, layer = installed
    scheme = _scheme()
    source = f"{scheme['scripts']}/demo-tool" if "bin" in stray else f"{scheme['data']}/share/demo/notes.txt"
    entries = {**layer.entries, stray: LayerEntry(stray, "file", sha256=layer.entries[source].sha256, mode=0o755)}
    kept = {**layer.kept, **({stray: layer.kept[source]} if source in layer.kept else {})}
    why = _judge(root, pinset, Layer(entries, kept))
    assert why is not None and why.path == stray and why.field == "entry" and str(why).startswith(stray)
