"""File facts kept per layer chain: a second image on a known base reads only its own layers, and what it gets
is what reading the whole site folder gives.

Real engine (overlay2, local), real stand-in base. The derived image's layers change a file, remove one (a
whiteout), replace a folder (an opaque folder) and add a link.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import derive
from vllm_hotfix.building.standin import SITE_DIR
from vllm_hotfix.engine import Engine, FileFact
from vllm_hotfix.sitefacts import layer_facts
from vllm_hotfix.sitefacts.site import keep_metadata, read_site

ENVS = f"{SITE_DIR}/vllm/envs.py"
GONE = f"{SITE_DIR}/vllm/version.py"
REPLACED = f"{SITE_DIR}/vllm/models/minimax_m3"


def _same(a: dict[str, FileFact], b: dict[str, FileFact]) -> None:
    """Equal facts, but for the kind the archive gives a second name of one file (a hard link)."""
    assert sorted(a) == sorted(b)
    for path, fact in a.items():
        other = b[path]
        if fact.kind == "dir":
            assert other.kind == "dir", path
            continue
        assert (fact.kind.replace("hardlink", "file"), fact.sha256, fact.target) == \
            (other.kind.replace("hardlink", "file"), other.sha256, other.target), path


def test_a_derived_image_reads_only_its_own_layers_and_gets_the_whole_reads_facts(
        engine: Engine, base_v0251: str, tmp_path: Path, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cache = tmp_path / "cache"
    base = engine.image(base_v0251)
    assert base is not None
    if layer_folders_missing(base):
        pytest.skip("the engine is not a local overlay2 engine")
    ref = f"hotfix-test/layers-{unique}:x"
    image_id = derive(engine, base_v0251, ref,
                      f"RUN echo 'X = 1' >> {ENVS} && rm {GONE} && rm -rf {REPLACED} && mkdir {REPLACED} "
                      f"&& echo new > {REPLACED}/only.py && ln -s envs.py {SITE_DIR}/vllm/envs_link.py")
    try:
        said: list[str] = []
        start = time.monotonic()
        read_site(engine, base_v0251, SITE_DIR, keep_metadata, cache, said.append)  # the base, read whole, kept
        whole_base = time.monotonic() - start
        start = time.monotonic()
        layered = read_site(engine, image_id, SITE_DIR, keep_metadata, cache, said.append)
        on_top = time.monotonic() - start
        # One line per image read, naming it (a smoke reads the image's and its base's).
        b12, i12 = base.id.removeprefix("sha256:")[:12], image_id.removeprefix("sha256:")[:12]
        assert said == [f"    site folder facts of {b12}: every layer read",
                        f"    site folder facts of {i12}: the facts of its first {len(base_layers(base))} layer(s) "
                        "kept from before, its top 1 layer(s) read"]
        whole = read_site(engine, image_id, SITE_DIR)  # no cache: the whole site folder through the archive
        _same(layered.entries, whole.entries)
        assert layered.kept == whole.kept
        assert GONE not in layered.entries and f"{REPLACED}/only.py" in layered.entries
        assert not any(p.startswith(REPLACED + "/") and not p.endswith("only.py") for p in layered.entries)
        assert layered.entries[f"{SITE_DIR}/vllm/envs_link.py"].target == "envs.py"
        assert layered.entries[ENVS].sha256 == whole.entries[ENVS].sha256
        # The same image again: its own chain is kept.
        said.clear()
        again = read_site(engine, image_id, SITE_DIR, keep_metadata, cache, said.append)
        assert said == [f"    site folder facts of {i12}: the facts kept from an earlier read of the same layers"]
        _same(again.entries, whole.entries)
        print(f"site folder of the stand-in: whole read {whole_base:.2f} s, top layer on kept facts {on_top:.2f} s")
    finally:
        engine.remove_image(ref)


def test_a_kept_tree_that_was_tampered_with_is_not_used(engine: Engine, base_v0251: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cache = tmp_path / "cache"
    read_site(engine, base_v0251, SITE_DIR, keep_metadata, cache)
    [index] = list((cache / "layers").rglob("index/*.json"))
    index.write_text(index.read_text().replace("envs.py", "envz.py"))
    said: list[str] = []
    tree = read_site(engine, base_v0251, SITE_DIR, keep_metadata, cache, said.append)
    base = engine.image(base_v0251)
    assert base is not None
    assert said == [f"    site folder facts of {base.id.removeprefix('sha256:')[:12]}: every layer read"]
    assert ENVS in tree.entries


def base_layers(info: object) -> list[str]:
    return list(((getattr(info, "attrs", None) or {}).get("RootFS") or {}).get("Layers") or [])


def layer_folders_missing(info: object) -> bool:
    return layer_facts.layer_folders(info) is None  # type: ignore[arg-type]
