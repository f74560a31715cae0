"""wheels: the one pip-download wrapper, and its one error line naming the distribution (no engine, no network)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from vllm_hotfix.building import wheels
from vllm_hotfix.errors import PinError, UpstreamError


def test_a_download_that_finds_nothing_names_the_distribution(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # pip itself, with no index and an empty folder of links: no network, a real refusal.
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    target = wheels.Target("3.11", "cp", ("cp311", "none"), ("manylinux_2_28_x86_64", "any"))
    with pytest.raises(PinError) as err:
        wheels.download("quack-kernels", "0.6.4", tmp_path / "out", target, error=PinError,
                        context="pins.txt: line 1: quack-kernels==0.6.4: ", hint="pass --wheelhouse DIR")
    message = str(err.value)
    assert message.startswith("pins.txt: line 1: quack-kernels==0.6.4: cannot download quack-kernels==0.6.4 "
                              "for Python 3.11 (cp) on manylinux_2_28_x86_64, any from the package index: ")
    assert "No matching distribution found for quack-kernels==0.6.4" in message
    assert "\n" not in message and "ERROR:" not in message and err.value.hint == "pass --wheelhouse DIR"


def test_pip_that_succeeds_without_the_wheel_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def ran(cmd: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        (tmp_path / "other-1.0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wheels.subprocess, "run", ran)
    with pytest.raises(UpstreamError) as err:
        wheels.download("einops", "0.8.1", tmp_path)
    assert str(err.value) == f"pip download einops==0.8.1 gave no wheel of it in {tmp_path}"


def _tiny_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal valid pure wheel, for pip to find in a folder of links."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", "")
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def test_a_wheel_appears_in_the_folder_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip writes into a scratch folder; the wheel is moved in whole after it ends, the scratch folder goes."""
    links = tmp_path / "links"
    links.mkdir()
    made = _tiny_wheel(links, "tinypkg", "1.0")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    out = tmp_path / "out"
    seen_while_pip_ran: list[list[str]] = []
    real_run = subprocess.run

    def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        done = real_run(cmd, **kw)  # type: ignore[call-overload]
        seen_while_pip_ran.append(sorted(p.name for p in out.glob("*.whl")))
        return done  # type: ignore[no-any-return]

    monkeypatch.setattr(wheels.subprocess, "run", run)
    got = wheels.download("tinypkg", "1.0", out)
    assert seen_while_pip_ran == [[]]  # nothing under the wheel's own name until pip had finished
    assert got == [out / made.name] and got[0].read_bytes() == made.read_bytes()
    assert sorted(p.name for p in out.iterdir()) == [made.name]  # no scratch folder left


def test_a_wheel_that_cannot_be_moved_in_is_one_line_and_leaves_no_scratch(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    links = tmp_path / "links"
    links.mkdir()
    made = _tiny_wheel(links, "tinypkg", "1.0")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    out = tmp_path / "out"
    (out / made.name).mkdir(parents=True)  # a folder where the wheel must go: the move is refused
    with pytest.raises(PinError) as err:
        wheels.download("tinypkg", "1.0", out, error=PinError, context="pins.txt: line 1: ")
    assert str(err.value).startswith(f"pins.txt: line 1: cannot move {made.name} into {out}: ")
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in out.iterdir()) == [made.name]  # no scratch folder left


def test_for_machine_keeps_that_machine_and_pure_wheels() -> None:
    paths = [Path("a-1-cp311-cp311-manylinux_2_28_x86_64.whl"), Path("a-1-cp311-cp311-manylinux_2_28_aarch64.whl"),
             Path("a-1-py3-none-any.whl"), Path("README.txt")]
    assert wheels.for_machine(paths, "aarch64") == [paths[1], paths[2]]
