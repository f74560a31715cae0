"""What an image's distributions require, read with packaging: names, extras and markers in the image's environment."""

from __future__ import annotations

import pytest

from vllm_hotfix.engine import Tree
from vllm_hotfix.judges import integrity
from vllm_hotfix.judges.installed import Environment, closure, environment
from vllm_hotfix.sitefacts.dists import copies, distributions

SITE = "/usr/local/lib/python3.12/dist-packages"


def _tree(requires: dict[str, list[str]], site: str = SITE) -> Tree:
    """A site folder with one dist-info per name, each requiring what ``requires`` says (no files)."""
    kept = {}
    for name, reqs in requires.items():
        lines = "".join(f"Requires-Dist: {r}\n" for r in reqs)
        kept[f"{site}/{name}-1.0.dist-info/METADATA"] = (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{lines}").encode()
        kept[f"{site}/{name}-1.0.dist-info/RECORD"] = b""
    return Tree({}, kept)


def _needed(requires: dict[str, list[str]], env: Environment | None = None, site: str = SITE) -> set[str]:
    """The distributions ``pkg`` needs, as the integrity scan follows them."""
    return set(integrity.scan(_tree(requires, site), site, "pkg", env=env).distributions)


def test_an_extra_named_in_an_or_is_followed() -> None:
    needed = _needed({"pkg": ["Lib[CUDA]>=1"], "lib": ["cuda-dep; extra == 'gpu' or extra == 'cuda'",
                                                         "gpu-only; extra == 'gpu'", "always"],
                      "cuda_dep": [], "gpu-only": [], "always": []})
    assert needed == {"pkg", "lib", "cuda-dep", "always"}


def test_extras_not_asked_for_are_not_followed() -> None:
    needed = _needed({"pkg": ["lib"], "lib": ["cuda-dep; extra == 'gpu' or extra == 'cuda'"], "cuda-dep": []})
    assert needed == {"pkg", "lib"}


def test_python_version_markers_are_the_images_not_the_hosts() -> None:
    requires = {"pkg": ['backport; python_version < "3.11"', 'new-api; python_version >= "3.12"',
                        'exact; python_full_version == "3.12.*"'], "backport": [], "new-api": [], "exact": []}
    assert _needed(requires) == {"pkg", "new-api", "exact"}
    old = "/usr/lib/python3.10/site-packages"
    assert _needed(requires, site=old) == {"pkg", "backport"}


def test_sys_platform_and_machine_markers() -> None:
    requires = {"pkg": ['pywin32; sys_platform == "win32"', 'uvloop; sys_platform != "win32"',
                        'triton; platform_machine == "x86_64"', 'arm-kernels; platform_machine == "aarch64"'],
                "pywin32": [], "uvloop": [], "triton": [], "arm-kernels": []}
    assert _needed(requires, environment(SITE, "cpython-312", "amd64")) == {"pkg", "uvloop", "triton"}
    assert _needed(requires, environment(SITE, "cpython-312", "arm64")) == {"pkg", "uvloop", "arm-kernels"}
    # The image does not say its machine: a requirement that could apply is followed.
    assert _needed(requires, environment(SITE)) == {"pkg", "uvloop", "triton", "arm-kernels"}


@pytest.mark.parametrize(("site", "tag", "arch", "want"), [
    (SITE, "cpython-312", "amd64", Environment("3.12", "x86_64")),
    ("/opt/venv/lib/python3.11/site-packages", "", "arm64", Environment("3.11", "aarch64")),
    ("/opt/site", "", "", Environment("", "")),
])
def test_the_environment_comes_from_the_images_files_and_config(site: str, tag: str, arch: str,
                                                                want: Environment) -> None:
    assert environment(site, tag, arch) == want


def test_an_invalid_requirement_is_not_followed_and_breaks_nothing() -> None:
    tree = _tree({"pkg": ["lib (>=1", "other"], "lib": [], "other": []})
    found, _parents = closure(distributions(tree, SITE), ["pkg"], environment(SITE))
    assert set(found) == {"pkg", "other"}


def test_every_copy_of_a_distribution_is_counted_where_the_push_gate_reads_pins() -> None:
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n"
    tree = Tree({}, {
        f"{SITE}/quack_kernels-0.6.4.dist-info/METADATA": meta.format("quack_kernels", "0.6.4").encode(),
        f"{SITE}/quack_kernels-0.6.5.dist-info/METADATA": meta.format("Quack-Kernels", "0.6.5").encode(),
        f"{SITE}/quack_kernels-0.6.5.dist-info/RECORD": b"",
        f"{SITE}/nested/other-1.0.dist-info/METADATA": meta.format("other", "1.0").encode(),
        f"{SITE}/notes.egg-info/METADATA": meta.format("notes", "1.0").encode(),
    })
    # One per name where a distribution's requirements are followed; both where the pins are counted.
    assert sorted(distributions(tree, SITE)) == ["notes", "quack-kernels"]
    assert copies(tree, SITE) == [("notes", "1.0"), ("quack-kernels", "0.6.4"), ("quack-kernels", "0.6.5")]
    assert copies(tree, "/elsewhere") == []
