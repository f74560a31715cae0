"""The assemble builder against the Dockerfile builder, on a real engine.

Both builders must give the same image in every way a user can see: the
files the patch layer adds over the base (with mode, owner and time), the
labels and runtime config, the base's layers and history. The assembled
image must also have the same ID on every run, with or without the facts
cache, from the command line or in-process.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from conftest import cli
from vllm_hotfix.building import pipeline
from vllm_hotfix.engine import Engine

SITE = "/usr/local/lib/python3.12/dist-packages"
PATCH = "0001-minimax-m3-topk-buffer-layout.patch"
RUNTIME = ("Entrypoint", "Cmd", "Env", "User", "WorkingDir", "Labels", "ExposedPorts", "Volumes", "StopSignal",
           "Healthcheck", "Shell", "OnBuild")


def _build(root: Path, out: str, builder: str, cache: Path, *, verbose: bool = False) -> tuple[str, str]:
    r = cli(*(["-v"] if verbose else []), "image", "--definition", "v0.25.1", "--tag", out, "--pull", "never",
            "--no-smoke", "--rebuild", "--builder", builder, root=root, env={"VLLM_HOTFIX_CACHE": str(cache)})
    assert r.rc == 0, r.err
    last = r.out.strip().splitlines()[-1]
    assert last.startswith(f"built {out} sha256:"), r.out
    return last.split()[-1], r.err


def _saved(ref: str, where: Path) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]], list[str]]:
    """(config, top layer's entries by path, layer paths) of ``docker save REF``."""
    path = where / (hashlib.sha256(ref.encode()).hexdigest()[:12] + ".tar")
    subprocess.run(["docker", "save", "-o", str(path), ref], check=True, capture_output=True)
    with tarfile.open(path) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())[0]  # type: ignore[union-attr]
        config = json.loads(tar.extractfile(manifest["Config"]).read())  # type: ignore[union-attr]
        entries: dict[str, tuple[Any, ...]] = {}
        with tarfile.open(fileobj=tar.extractfile(manifest["Layers"][-1])) as layer:
            for m in layer:
                data = layer.extractfile(m).read() if m.isfile() else b""  # type: ignore[union-attr]
                # Compared: what unpacking the layer sets. Mode without the
                # type bits (Go writes them, Python does not), owners by number
                # (the engine ignores names), content by hash.
                entries[m.name.rstrip("/")] = (m.type, m.mode & 0o7777, m.uid, m.gid, m.size, int(m.mtime),
                                               m.linkname, hashlib.sha256(data).hexdigest())
    path.unlink()
    return config, entries, manifest["Layers"]


def test_both_builders_give_the_same_image(
    engine: Engine, base_v0251: str, project: Path, unique: str, tmp_path: Path
) -> None:
    df_ref, as_ref = f"hotfix-test/df-{unique}:t", f"hotfix-test/as-{unique}:t"
    try:
        df_id, _ = _build(project, df_ref, "dockerfile", tmp_path / "cache")
        as_id, err = _build(project, as_ref, "assemble", tmp_path / "cache")
        assert "assembling" in err and df_id != as_id
        df_cfg, df_files, df_layers = _saved(df_ref, tmp_path)
        as_cfg, as_files, as_layers = _saved(as_ref, tmp_path)

        # The same file tree over the base. One exception: the Dockerfile
        # build stamps the site dir itself with the time of the build (its
        # COPY writes into it); the assembled layer keeps the base's time.
        site = SITE.strip("/")
        assert set(df_files) == set(as_files)
        for name in df_files:
            if name == site:
                assert df_files[name][:5] == as_files[name][:5], name
            else:
                assert df_files[name] == as_files[name], name
        assert f"{site}/vllm/models/minimax_m3/common/__pycache__/indexer.cpython-311.pyc" in as_files

        # The same base layers below, one layer on top.
        base = engine.inspect(base_v0251)
        assert base is not None
        base_layers = base["RootFS"]["Layers"]
        assert df_cfg["rootfs"]["diff_ids"][:-1] == as_cfg["rootfs"]["diff_ids"][:-1] == base_layers
        assert len(df_layers) == len(as_layers) == len(base_layers) + 1

        # The same runtime config and labels, as the engine reports them.
        df_info, as_info = engine.inspect(df_id), engine.inspect(as_id)
        assert df_info is not None and as_info is not None
        for key in RUNTIME:
            assert df_info["Config"].get(key) == as_info["Config"].get(key), key
        for key in ("Architecture", "Os", "Variant"):
            assert df_info.get(key) == as_info.get(key), key
        labels = as_info["Config"]["Labels"]
        assert labels["io.vllm-hotfix.base.id"] == base_v0251
        assert json.loads(labels["io.vllm-hotfix.patches"]).keys() == {PATCH}

        # The base's history kept, as `docker history` shows it; then the
        # patch layer, the same size either way.
        base_hist = engine.history(base_v0251)
        keep = ("Created", "CreatedBy", "Comment", "Size")
        df_hist, as_hist = engine.history(df_id), engine.history(as_id)
        for hist in (df_hist, as_hist):
            assert [{k: h[k] for k in keep} for h in hist[: len(base_hist)]] == \
                [{k: h[k] for k in keep} for h in base_hist]
        assert len(as_hist) == len(base_hist) + 1
        copy = [h for h in df_hist[len(base_hist):] if h["Size"]]
        assert len(copy) == 1 and copy[0]["Size"] == as_hist[-1]["Size"] > 0

        # What the image's Python imports is the patched file, with fresh bytecode.
        files = json.loads(labels["io.vllm-hotfix.files"])
        check = engine.run(as_id, ["python3", "-c", (
            "import hashlib, importlib.util as u, json, sys\n"
            "p = sys.argv[1]\n"
            "data = open(p, 'rb').read()\n"
            "hdr = open(u.cache_from_source(p), 'rb').read(16)\n"
            "print(json.dumps([hashlib.sha256(data).hexdigest(), hdr[8:16].hex(), u.source_hash(data).hex()]))\n"
        ), f"{SITE}/vllm/models/minimax_m3/common/indexer.py"])
        assert check.exit_code == 0, check.stderr
        sha, pyc_hash, src_hash = json.loads(check.stdout)
        assert sha == files["vllm/models/minimax_m3/common/indexer.py"] and pyc_hash == src_hash
    finally:
        engine.remove_image(df_ref)
        engine.remove_image(as_ref)


def test_assembled_image_id_is_the_same_on_every_run(
    engine: Engine, base_v0251: str, project: Path, unique: str, tmp_path: Path
) -> None:
    out = f"hotfix-test/as-{unique}:t"
    try:
        # Cold cache (probe container), warm cache (none), and in-process.
        first, err1 = _build(project, out, "assemble", tmp_path / "cache", verbose=True)
        second, err2 = _build(project, out, "assemble", tmp_path / "cache", verbose=True)
        assert "probe containers started: 1" in err1, err1
        assert "probe containers started: 0" in err2, err2
        plan = pipeline.plan(project, "v0.25.1", output_ref=out)
        built = pipeline.build_image(engine, plan,
                                     pipeline.BuildOptions(pull="never", rebuild=True, builder="assemble"))
        assert isinstance(built, pipeline.BuildResult)
        third = built.image_id
        assert first == second == third

        # The ID is the hash of the config, and the config holds nothing of
        # the host or the engine: no clock, no host name, no engine version.
        config, _files, _layers = _saved(out, tmp_path)
        raw = json.dumps(config)
        info = engine.info()
        base = engine.inspect(base_v0251)
        assert base is not None
        assert config["created"] == base["Created"]
        assert {h["created"] for h in config["history"][-1:]} == {base["Created"]}
        for word in (info.get("Name"), info.get("ServerVersion"), info.get("ID")):
            assert word and word not in raw
        assert not {"container", "container_config", "docker_version"} & config.keys()
    finally:
        engine.remove_image(out)


def test_facts_cache_is_checked_and_a_changed_patch_set_only_compiles(
    engine: Engine, base_v0251: str, project: Path, unique: str, tmp_path: Path
) -> None:
    out = f"hotfix-test/as-{unique}:t"
    cache = tmp_path / "cache"
    first = ""
    try:
        first, _ = _build(project, out, "assemble", cache)
        # A changed patch set on the same base: one container, to compile only.
        path = project / "patches/v0.25.1" / PATCH
        text = path.read_text()
        assert "+        buf_htk = (\n" in text
        path.write_text(text.replace("+        buf_htk = (\n", "+        buf_htk = (  # head-major view\n", 1))
        changed, err = _build(project, out, "assemble", cache, verbose=True)
        assert changed != first
        assert "probe: locate" not in err and "probe: compile 1 file(s)" in err, err
        # A cache index edited to name another image is not believed: the base is probed again.
        facts = next((cache / "bases").glob("*/index/facts-*.json"))
        outer = json.loads(facts.read_text())
        outer["body"] = json.dumps({**json.loads(outer["body"]), "image_id": "sha256:" + "0" * 64})
        facts.write_text(json.dumps(outer))
        again, err = _build(project, out, "assemble", cache, verbose=True)
        assert again == changed and "probe: locate 2 file(s)" in err, err
        assert f"{facts} was not written by this host" in err
    finally:
        engine.remove_image(out)
        if first:
            engine.remove_untagged(first)  # the tag moved off it: nothing else holds it


def test_assembled_build_and_reuse_import_no_template_engine(
    engine: Engine, base_v0251: str, project: Path, unique: str, tmp_path: Path
) -> None:
    out = f"hotfix-test/as-{unique}:t"
    _build(project, out, "assemble", tmp_path / "cache")  # fills the facts cache
    try:
        for extra in (["--rebuild"], []):
            r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", "--builder",
                    "assemble", *extra, root=project,
                    env={"VLLM_HOTFIX_CACHE": str(tmp_path / "cache"), "PYTHONPROFILEIMPORTTIME": "1"})
            assert r.rc == 0, r.err
            assert r.out.strip().splitlines()[-1].startswith("reused " if not extra else "built "), r.out
            imported = {line.rsplit("|", 1)[-1].strip() for line in r.err.splitlines()
                        if line.startswith("import time:")}
            assert "vllm_hotfix.building.assemble" in imported or not extra
            assert "jinja2" not in imported, sorted(imported)
            # A set without pins, a run without smoke: no HTTP server, no pins, no expectations; no registry's
            # layers read; no other command's module.
            assert not {"http.server", "vllm_hotfix.building.pins", "vllm_hotfix.building.expected",
                        "vllm_hotfix.registry.layerscan", "vllm_hotfix.cli.smoke_commands",
                        "vllm_hotfix.cli.push_commands", "vllm_hotfix.cli.history_commands"} & imported, \
                sorted(imported)
            # A run that ends normally leaves no note of leftovers for the next one.
            assert not list((project / "build" / "runs").glob("*.json"))
    finally:
        engine.remove_image(out)
