"""``image --in-registry``: the hotfix image made through the registry API, against the real registry.

The engine here only makes the bases, pulls the results to look inside
them, and builds the same image the other ways to compare; the command
under test never talks to it. Faults the real registry does not make (a
registry that will not mount, one that refuses a blob, a tag held while the
client is killed) come from tests/registry_proxy.py in front of it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

import registry_proxy
from conftest import REPO, RUN_ID, Registry, RegistryPlace, cli, derive, docker_cli, fails, site_key
from vllm_hotfix.building import inregistry, sources
from vllm_hotfix.engine import Engine
from vllm_hotfix.journal import records
from vllm_hotfix.registry import layerscan
from vllm_hotfix.registry import remote as regbase
from vllm_hotfix.trust import attest, referrers

SITE = "/usr/local/lib/python3.12/dist-packages"
INDEXER = "vllm/models/minimax_m3/common/indexer.py"
FOLDER = "vllm/models/minimax_m3/common"
RELS = [INDEXER, "vllm/models/minimax_m3/common/sparse_attention.py"]
# What the image's own Python runs for a module, by the import system's own choice of bytecode or source,
# compared with the source compiled afresh; no module of vllm is imported (the stand-ins have no torch).
LOADS = """
import importlib.machinery, sys
path = sys.argv[1] + "/" + sys.argv[2]
name = sys.argv[2][:-3].replace("/", ".")
loaded = importlib.machinery.SourceFileLoader(name, path).get_code(name)
fresh = compile(open(path, "rb").read(), path, "exec", dont_inherit=True)
print("source" if loaded == fresh else "stale bytecode", "patched" if b"transpose(0, 1)" in open(path, "rb").read()
      else "unpatched")
"""


class Made:
    """Refs a test makes in the engine and removes at its end."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.refs: list[str] = []

    def add(self, ref: str) -> str:
        self.refs.append(ref)
        return ref

    def pull(self, ref: str) -> str:
        self.engine.pull(ref)
        return self.add(ref)

    def close(self) -> None:
        for ref in reversed(self.refs):
            if self.engine.image(ref) is not None:
                self.engine.remove_image(ref)


@pytest.fixture
def made(engine: Engine) -> Iterator[Made]:
    m = Made(engine)
    yield m
    m.close()


def publish(engine: Engine, made: Made, image_id: str, ref: str) -> str:
    """``image_id`` pushed as ``ref`` (the local tag kept, so the engine knows its registry digest)."""
    engine.tag(image_id, made.add(ref))
    return engine.push(ref)


def with_stale_bytecode(engine: Engine, made: Made, base_id: str, unique: str) -> str:
    """The stand-in plus a layer of unchecked-hash pycs for the patched folder: Python loads them whatever the
    source says, so a hotfix that leaves them serves the old code."""
    ref = made.add(f"hotfix-test/stale-pyc-{unique}:v0.25.1")
    return derive(engine, base_id, ref,
                  f"RUN python3 -m compileall -q --invalidation-mode unchecked-hash {SITE}/{FOLDER}")


NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}  # the registry build must not need one


def in_registry(project: Path, base_repo: str, tag: str, *extra: str, env: dict[str, str] | None = None
                ) -> dict:
    r = cli("image", "--definition", "v0.25.1", "--base-repo", base_repo, "--in-registry", "--tag", tag, "--json",
            *extra, root=project, env={**NO_ENGINE, **(env or {})})
    assert r.rc == 0, r.err
    return json.loads(r.out) | {"err": r.err}


def loads(engine: Engine, image: str) -> str:
    return docker_cli("run", "--rm", "--network", "none", "--label", f"io.vllm-hotfix.run={RUN_ID}",
                      "--entrypoint", "python3", image, "-c", LOADS, SITE, INDEXER).strip()


def tree(engine: Engine, image: str) -> dict[str, tuple[str, str, int]]:
    found = engine.read_files(image, [f"{SITE}/{FOLDER}"])
    return {p: (f.kind, f.sha256, f.mode) for p, f in found.entries.items() if f.kind != "dir"}


def test_the_registry_build_is_the_assemble_builders_image_and_the_dockerfile_builds_files(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made, unique: str) -> None:
    stale = with_stale_bytecode(engine, made, base_v0251, unique)
    repo = f"{registry.place}/vllm/vllm-openai"
    publish(engine, made, stale, f"{repo}:v0.25.1")
    out = f"{registry.place}/ops/vllm-openai:v0.25.1-m3patch"
    got = in_registry(project, repo, out)
    [image] = got["images"]
    assert image["bytecode"].startswith("fresh checked-hash pycs compiled by"), image["bytecode"]
    # Read: the top three layers (pycs, the .pth, vLLM's sources); never the root file system below them.
    manifest = requests.get(f"http://{registry.addr}/v2/{registry.ns}/vllm/vllm-openai/manifests/v0.25.1",
                            headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
                            timeout=10).json()
    sizes = [layer["size"] for layer in manifest["layers"]]
    assert image["read"]["layers"] == 3 and image["read"]["of_layers"] == 4
    assert image["read"]["bytes"] <= sizes[1] + (1 << 20), (image["read"], sizes)
    assert image["base_layers"] == {"mounted": 4}

    # The assemble builder, from the same base pulled into the engine: the same image, by ID.
    r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--builder", "assemble", "--no-smoke",
            "--tag", made.add(f"hotfix-test/asm-{unique}:x"), root=project)
    assert r.rc == 0, r.err
    assert r.out.split()[-1] == image["image_id"]

    # The Dockerfile build: the patched files and their bytecode are the same bytes and modes.
    r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--no-smoke",
            "--tag", made.add(f"hotfix-test/dockerfile-{unique}:x"), root=project)
    assert r.rc == 0, r.err
    pulled = made.pull(f"{registry.place}/ops/vllm-openai@{image['digest']}")
    assert engine.image(pulled).id == image["image_id"]  # type: ignore[union-attr]
    mine, theirs = tree(engine, pulled), tree(engine, r.out.split()[-1])
    assert mine == theirs
    assert f"{SITE}/{FOLDER}/__pycache__/indexer.cpython-311.pyc" in mine
    assert loads(engine, pulled) == "source patched"

    # Where vLLM lives, from the layers alone, is what the base's own Python says.
    found, _ = inregistry.bases(f"{repo}:v0.25.1", None, False, lambda _l: None)
    base = found[None]
    where = layerscan.locate(layerscan.layer_refs(base.layers), regbase.opener(base.repo), "vllm", RELS, repo)
    info = engine.image(stale)
    assert info is not None
    with sources.ImageReader(engine, info, stale, "vllm", "python3", None) as reader:
        facts, probed = reader.locate(RELS)
    assert (where.site_dir, where.package_dir, where.version) == (facts.site_dir, facts.package_dir, facts.version)
    assert [(f.path, f.mode, f.uid, f.gid, f.mtime) for f in where.folders] == \
        [(f.path, f.mode, f.uid, f.gid, f.mtime) for f in facts.folders]
    for rel in RELS:
        assert where.files[rel]["data"] == sources.content(probed[rel])
        assert where.files[rel]["mode"] == probed[rel]["mode"]


def test_the_images_python_runs_the_patched_source_whiteouts_and_no_bytecode(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made, unique: str) -> None:
    stale = with_stale_bytecode(engine, made, base_v0251, unique)
    repo = f"{registry.place}/vllm/stale"
    publish(engine, made, stale, f"{repo}:v0.25.1")
    r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--in-registry", "--bytecode", "whiteout",
            "--tag", f"{registry.place}/ops/w:v0.25.1-m3patch", "--json", root=project, env=NO_ENGINE)
    assert r.rc == 0, r.err
    [image] = json.loads(r.out)["images"]
    # Every name the image's Python could load for the two patched files (levels 0, 1, 2), not only those seen.
    assert image["bytecode"].startswith("whiteouts of every pyc name of the 2 patched file(s) (6, 2 of them seen "
                                        "in the layers read"), image["bytecode"]
    pulled = made.pull(f"{registry.place}/ops/w@{image['digest']}")
    files = tree(engine, pulled)
    assert not [p for p in files if "/__pycache__/indexer." in p]  # whited out
    assert loads(engine, pulled) == "source patched"
    # The check tells: the patched source over the stale bytecode, without the whiteouts, runs the old code.
    patched = engine.read_files(pulled, [f"{SITE}/{INDEXER}"], keep=lambda _p: True).kept[f"{SITE}/{INDEXER}"]
    control = derive(engine, stale, made.add(f"hotfix-test/no-whiteout-{unique}:x"),
                     f"COPY indexer.py {SITE}/{INDEXER}", {"indexer.py": patched})
    assert loads(engine, control) == "stale bytecode patched"

    # A base whose layers hold no pyc at all (the plain stand-in): nothing stale, none added.
    plain = f"{registry.place}/vllm/plain"
    publish(engine, made, base_v0251, f"{plain}:v0.25.1")
    got = in_registry(project, plain, f"{registry.place}/ops/p:v0.25.1-m3patch")
    [image] = got["images"]
    assert image["bytecode"].startswith("none: no pyc in the layers read"), image["bytecode"]
    pulled = made.pull(f"{registry.place}/ops/p@{image['digest']}")
    assert loads(engine, pulled) == "source patched"


def test_smoke_pulls_it_by_digest_and_push_lets_it_through_on_that_verdict(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made) -> None:
    repo = f"{registry.place}/vllm/vllm-openai"
    publish(engine, made, base_v0251, f"{repo}:v0.25.1")
    out = made.add(f"{registry.place}/staging/vllm-openai:v0.25.1-m3patch")
    got = in_registry(project, repo, out)
    [image] = got["images"]
    assert "==> not smoke-tested (nothing runs here)" in got["err"]
    made.add(f"{registry.place}/staging/vllm-openai@{image['digest']}")
    [build] = records.builds_of_image(project, image["image_id"])
    assert build.data["builder"] == "registry" and build.data["registry"]["digest"] == image["digest"]
    assert engine.image(out) is None  # nothing of it in the engine

    # The gate knows it as a build without a verdict.
    r = cli("push", out, "--registry", f"{registry.place}/final", "--allow-gpu-unverified", root=project)
    fails(r, "no passing smoke verdict")
    assert r.rc == 8 and f"pulling {registry.place}/staging/vllm-openai@{image['digest']}" in r.err

    engine.remove_image(out)
    r = cli("smoke", out, root=project)
    assert r.rc == 0, r.err
    assert f"pulling {registry.place}/staging/vllm-openai@{image['digest']} (the digest the journal's build" in r.err
    assert "pass patch-landed" in r.err and "pass import-location" in r.err
    [verdict] = records.verdicts(project, image["image_id"])
    assert verdict.verdict.passed
    # Made again, the same image is reused: it says it passed (it said "not smoke-tested" after a pass).
    again = in_registry(project, repo, out)
    assert again["images"][0]["reused"] and "not smoke-tested" not in again["err"], again["err"]
    assert f"==> smoke-tested: its newest verdict passed (GPU-unverified; {verdict.path.name})" in again["err"]

    r = cli("push", out, "--registry", f"{registry.place}/final", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    pushed = json.loads(r.out)
    assert pushed["image_id"] == image["image_id"] and pushed["ref"] == f"{registry.place}/final/vllm-openai:" \
                                                                         "v0.25.1-m3patch"
    r = cli("list", "--json", root=project)
    [row] = [b for d in json.loads(r.out) for b in d["builds"] if b["image_id"] == image["image_id"]]
    assert row["verdict"] == "pass" and [p["digest"] for p in row["pushes"]] == [pushed["digest"]]


def test_a_base_behind_a_login_on_another_registry_is_copied_with_the_stored_login(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made, tmp_path: Path) -> None:
    (tmp_path / "auth").mkdir()
    auth = Registry(tmp_path / "auth", user="ops", password="s3cret-reg")
    auth.start()
    try:
        login = tmp_path / "login"
        login.mkdir()
        subprocess.run(["docker", "login", auth.addr, "-u", "ops", "--password-stdin"], input="s3cret-reg",
                       text=True, capture_output=True, check=True, env=dict(os.environ, DOCKER_CONFIG=str(login)))
        base_ref = made.add(f"{auth.addr}/vllm/vllm-openai:v0.25.1")
        engine.tag(base_v0251, base_ref)
        subprocess.run(["docker", "push", base_ref], capture_output=True, check=True,
                       env=dict(os.environ, DOCKER_CONFIG=str(login)))
        out = f"{registry.place}/ops/copied:v0.25.1-m3patch"
        empty = tmp_path / "no-login"
        empty.mkdir()
        r = cli("image", "--definition", "v0.25.1", "--base-repo", f"{auth.addr}/vllm/vllm-openai", "--in-registry",
                "--tag", out, root=project, env={"DOCKER_CONFIG": str(empty)})
        fails(r, "cannot read base", auth.addr, "refused the credentials")
        assert r.rc == 4 and f"hint: docker login {auth.addr}" in r.err

        got = in_registry(project, f"{auth.addr}/vllm/vllm-openai", out, env={"DOCKER_CONFIG": str(login)})
        [image] = got["images"]
        assert image["base_layers"] == {"copied": 3}, image
        assert "copying layer" in got["err"] and "another registry" in got["err"]
        pulled = made.pull(f"{registry.place}/ops/copied@{image['digest']}")
        assert loads(engine, pulled) == "source patched"
        for path in (project / "build" / "records").rglob("*.json"):
            assert "s3cret-reg" not in path.read_text()
    finally:
        auth.stop()


def tags(registry: RegistryPlace, name: str) -> list[str]:
    res = requests.get(registry.api(f"{name}/tags/list"), timeout=10)
    return sorted(res.json().get("tags") or []) if res.ok else []


def test_a_registry_that_will_not_mount_or_refuses_a_blob_or_a_big_manifest(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made) -> None:
    publish(engine, made, base_v0251, f"{registry.place}/vllm/vllm-openai:v0.25.1")
    with registry_proxy.serve(registry.addr) as (proxy, switches):
        base_repo = f"{proxy}/{registry.ns}/vllm/vllm-openai"
        switches.no_mount = True
        got = in_registry(project, base_repo, f"{proxy}/{registry.ns}/ops/copied:v0.25.1-m3patch")
        assert got["images"][0]["base_layers"] == {"copied": 3}
        assert "the registry would not mount it" in got["err"]
        assert tags(registry, "ops/copied") == ["v0.25.1-m3patch"]

        switches.no_mount, switches.refuse_blobs = False, 400
        r = cli("image", "--definition", "v0.25.1", "--base-repo", base_repo, "--in-registry", "--tag",
                f"{proxy}/{registry.ns}/ops/refused:v0.25.1-m3patch", "--rebuild", root=project)
        fails(r, f"registry {proxy} refused", "blob refused by policy")
        assert r.rc == 8 and tags(registry, "ops/refused") == []

        # The registry's own answer to a manifest over its limit (the distribution registry's words, the limit
        # made small here): one line, nothing tagged.
        switches.refuse_blobs, switches.manifest_limit = None, 1000
        r = cli("image", "--definition", "v0.25.1", "--base-repo", base_repo, "--in-registry", "--tag",
                f"{proxy}/{registry.ns}/ops/big:v0.25.1-m3patch", "--rebuild", root=project)
        fails(r, f"registry {proxy} refused the manifest", "over its size limit", "request body too large")
        assert r.rc == 8 and tags(registry, "ops/big") == []


@pytest.mark.parametrize("cut", [100, 1 << 20])
def test_a_connection_cut_mid_blob_is_one_line_and_nothing_is_tagged(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made, cut: int) -> None:
    """The base's layer stops after ``cut`` bytes (the connection closed): one line naming the blob and how far it
    came, the base's code (4: it could not be read), no traceback, nothing tagged."""
    publish(engine, made, base_v0251, f"{registry.place}/vllm/vllm-openai:v0.25.1")
    with registry_proxy.serve(registry.addr) as (proxy, switches):
        switches.cut_blobs = cut
        r = cli("image", "--definition", "v0.25.1", "--base-repo", f"{proxy}/{registry.ns}/vllm/vllm-openai",
                "--in-registry", "--tag", f"{proxy}/{registry.ns}/ops/cut:v0.25.1-m3patch", "--rebuild",
                root=project)
    assert r.rc == 4 and "Traceback" not in r.err, r.err
    fails(r, "cannot read base")
    # Cut inside a layer's stream: how far it came; cut inside a smaller answer (the config): the kind, in words.
    assert "the registry's answer broke off after" in r.err or "connection cut short" in r.err, r.err
    assert tags(registry, "ops/cut") == []


def test_a_tag_the_registry_refused_is_not_in_the_journal(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made) -> None:
    """A 500 on the tag's PUT: the run fails in one line, and the journal names no tag the registry lacks."""
    from vllm_hotfix.journal import records

    publish(engine, made, base_v0251, f"{registry.place}/vllm/vllm-openai:v0.25.1")
    with registry_proxy.serve(registry.addr) as (proxy, switches):
        switches.refuse_tags = 500
        ref = f"{proxy}/{registry.ns}/ops/untagged:v0.25.1-m3patch"
        r = cli("image", "--definition", "v0.25.1", "--base-repo", f"{proxy}/{registry.ns}/vllm/vllm-openai",
                "--in-registry", "--tag", ref, "--rebuild", root=project)
    assert r.rc == 8 and "Traceback" not in r.err, r.err
    assert tags(registry, "ops/untagged") == []
    assert [e.data.get("ref") for e in records.load(project, "tag") if e.data.get("ref") == ref] == []


def test_a_base_whose_record_does_not_list_a_patched_file_is_refused(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made, unique: str) -> None:
    """The installed vLLM's RECORD must list the files the patch changes (as the runbook says): one it omits is
    refused (4) naming the file, before anything is written, not only noted."""
    ref = made.add(f"hotfix-test/unlisted-{unique}:v0.25.1")
    record = f"{SITE}/vllm-0.25.1.dist-info/RECORD"
    derive(engine, base_v0251, ref, f"RUN sed -i '\\#^{INDEXER},#d' {record}")
    repo = f"{registry.place}/vllm/unlisted"
    publish(engine, made, ref, f"{repo}:v0.25.1")
    r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--in-registry", "--tag",
            f"{registry.place}/ops/unlisted:v0.25.1-m3patch", root=project, env=NO_ENGINE)
    assert r.rc == 4, r.err
    fails(r, f"{INDEXER} is not listed in vllm-0.25.1.dist-info/RECORD")
    assert tags(registry, "ops/unlisted") == []


def test_a_manifest_over_the_limit_is_refused_before_anything_is_written(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made) -> None:
    publish(engine, made, base_v0251, f"{registry.place}/vllm/big:plain")
    url = registry.api("vllm/big/manifests/plain")
    doc = requests.get(url, headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
                       timeout=10).json()
    # The same image, its top layer's descriptor carrying an annotation that fills the manifest to just under
    # the registry's 4 MiB: the registry takes it, one more layer descriptor would not fit.
    doc["layers"][-1]["annotations"] = {"filler": ""}
    size = len(json.dumps(doc).encode())
    doc["layers"][-1]["annotations"]["filler"] = "x" * ((4 << 20) - size - 64)
    body = json.dumps(doc).encode()
    res = requests.put(registry.api("vllm/big/manifests/v0.25.1"), data=body,
                       headers={"Content-Type": doc["mediaType"]}, timeout=30)
    assert res.status_code == 201, res.text
    r = cli("image", "--definition", "v0.25.1", "--base-repo", f"{registry.place}/vllm/big", "--in-registry",
            "--tag", f"{registry.place}/ops/big:v0.25.1-m3patch", root=project)
    fails(r, "over the 4194304 bytes registries accept")
    assert r.rc == 8
    assert requests.get(registry.api("ops/big/tags/list"), timeout=10).status_code == 404  # nothing written


def test_a_run_killed_before_its_tag_leaves_no_tag_and_the_next_run_finishes_it(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made) -> None:
    publish(engine, made, base_v0251, f"{registry.place}/vllm/vllm-openai:v0.25.1")
    with registry_proxy.serve(registry.addr) as (proxy, switches):
        switches.hold_tags = threading.Event()
        target = f"{proxy}/{registry.ns}/ops/killed:v0.25.1-m3patch"
        argv = [sys.executable, str(REPO / "build.py"), "--root", str(project), "image", "--definition", "v0.25.1",
                "--base-repo", f"{proxy}/{registry.ns}/vllm/vllm-openai", "--in-registry", "--tag", target]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert switches.holding.wait(60), "the run never reached its tag"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        switches.hold_tags.set()
        time.sleep(0.2)
        # Every blob and the manifest by digest went in before the tag was asked for; no tag is there.
        puts = [path for method, path in switches.seen if method == "PUT"]
        assert puts[-1].endswith("/manifests/v0.25.1-m3patch")
        assert any("/manifests/sha256:" in p for p in puts[:-1])
        assert tags(registry, "ops/killed") == []
        switches.hold_tags = None
        r = cli("image", "--definition", "v0.25.1", "--base-repo", f"{proxy}/{registry.ns}/vllm/vllm-openai",
                "--in-registry", "--tag", target, root=project)
        assert r.rc == 0, r.err
        assert r.out.startswith("reused ") and tags(registry, "ops/killed") == ["v0.25.1-m3patch"]


def upload(registry: RegistryPlace, name: str, data: bytes) -> str:
    import hashlib

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    res = requests.post(registry.api(f"{name}/blobs/uploads/"), timeout=10)
    res = requests.put(res.headers["Location"], params={"digest": digest}, data=data, timeout=30)
    assert res.status_code == 201, res.text
    return digest


def test_an_index_base_gives_one_image_per_platform_and_an_index_tagged_last(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made) -> None:
    publish(engine, made, base_v0251, f"{registry.place}/vllm/multi:amd64")
    schema2 = "application/vnd.docker.distribution.manifest.v2+json"
    amd = requests.get(registry.api("vllm/multi/manifests/amd64"), headers={"Accept": schema2}, timeout=10)
    doc = amd.json()
    # An arm64 image of the same layers (never run here: only its config's platform matters to the registry build).
    config = requests.get(registry.api(f"vllm/multi/blobs/{doc['config']['digest']}"), timeout=10).json()
    config["architecture"], config["variant"] = "arm64", "v8"
    raw = json.dumps(config).encode()
    doc["config"] = {**doc["config"], "digest": upload(registry, "vllm/multi", raw), "size": len(raw)}
    arm = json.dumps(doc).encode()
    res = requests.put(registry.api("vllm/multi/manifests/arm64"), data=arm, headers={"Content-Type": schema2},
                       timeout=10)
    assert res.status_code == 201, res.text
    children = [(amd.headers["Docker-Content-Digest"], len(amd.content), "amd64", None),
                (res.headers["Docker-Content-Digest"], len(arm), "arm64", "v8")]
    index = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.list.v2+json",
             "manifests": [{"mediaType": schema2, "digest": d, "size": n,
                            "platform": {"os": "linux", "architecture": a, **({"variant": v} if v else {})}}
                           for d, n, a, v in children]}
    res = requests.put(registry.api("vllm/multi/manifests/v0.25.1"), data=json.dumps(index).encode(),
                       headers={"Content-Type": index["mediaType"]}, timeout=10)
    assert res.status_code == 201, res.text

    out = f"{registry.place}/ops/multi:v0.25.1-m3patch"
    got = in_registry(project, f"{registry.place}/vllm/multi", out)  # no --platform: every one of the index
    assert got["index"] and [i["platform"] for i in got["images"]] == ["linux/amd64", "linux/arm64"]
    assert tags(registry, "ops/multi") == ["v0.25.1-m3patch", "v0.25.1-m3patch-aarch64", "v0.25.1-m3patch-x86_64"]
    top = requests.get(registry.api("ops/multi/manifests/v0.25.1-m3patch"),
                       headers={"Accept": index["mediaType"]}, timeout=10)
    assert top.headers["Docker-Content-Digest"] == got["digest"]
    listed = {m["platform"]["architecture"]: m["digest"] for m in top.json()["manifests"]}
    assert listed == {"amd64": got["images"][0]["digest"], "arm64": got["images"][1]["digest"]}
    for image in got["images"]:
        child = requests.get(registry.api(f"ops/multi/manifests/{image['digest']}"), headers={"Accept": schema2},
                             timeout=10).json()
        conf = requests.get(registry.api(f"ops/multi/blobs/{child['config']['digest']}"), timeout=10).json()
        assert f"{conf['os']}/{conf['architecture']}" == image["platform"]
        assert conf["config"]["Labels"]["io.vllm-hotfix.definition"] == "v0.25.1"
        [build] = records.builds_of_image(project, image["image_id"])
        assert build.data["platform"] == image["platform"] and build.data["output_ref"] == image["ref"]
    # The tags came last: the index's after both children's.
    tag_entries = records.tags(project)
    assert tag_entries[0].data["ref"] == out and tag_entries[0].data["digest"] == got["digest"]

    one = in_registry(project, f"{registry.place}/vllm/multi", f"{registry.place}/ops/one:v0.25.1-m3patch",
                      "--platform", "linux/arm64")
    assert one["index"] and [i["platform"] for i in one["images"]] == ["linux/arm64"]
    assert one["images"][0]["image_id"] == got["images"][1]["image_id"]  # the same image, under another name


def test_an_image_made_in_the_registry_is_proven_on_another_host_by_its_base_in_the_registry(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made, tmp_path: Path) -> None:
    """Smoke where no build record of it exists: the base is the definition's reference in the registry
    (--base-repo), pulled by that name (its layers came with the image), and the image is its layers plus exactly
    the in-registry builder's one."""
    repo = f"{registry.place}/vllm/vllm-openai"
    publish(engine, made, base_v0251, f"{repo}:v0.25.1")
    got = in_registry(project, repo, made.add(f"{registry.place}/staging/vllm-openai:v0.25.1-m3patch"))
    [image] = got["images"]
    by_digest = made.add(f"{registry.place}/staging/vllm-openai@{image['digest']}")
    elsewhere = tmp_path / "elsewhere"
    for folder in ("images", "patches"):  # the same definitions, no journal
        shutil.copytree(project / folder, elsewhere / folder)
    engine.pull(by_digest)
    engine.untag(f"{repo}:v0.25.1")  # this host does not know the base by that name: found in its registry
    r = cli("smoke", by_digest, "--gpu", "off", "--base-repo", repo, root=elsewhere)
    assert r.rc == 0, r.err
    assert "pass layer-identity: its 1 layer(s) over base" in r.err, r.err
    assert f"definition v0.25.1: {repo}:v0.25.1 in the engine" in r.err
    # Judged against another repository, where the base is not: this host cannot find it, which says nothing of the
    # image. Incomplete (11), nothing signed, nothing attached; a verdict of the host's fault never outranks a pass.
    key = tmp_path / "site.key"
    site_key(key)
    envelope = tmp_path / "verdict.dsse.json"
    r = cli("smoke", by_digest, "--gpu", "off", "--base-repo", f"{registry.place}/nowhere", "--sign-key", str(key),
            "--attestation", str(envelope), root=elsewhere)
    assert r.rc == 11 and "cannot be pulled" in r.err and "incomplete" in r.last_error, r.err
    assert "signed verdict" not in r.err and not envelope.exists()
    assert not attest.kept(elsewhere, image["image_id"])
    assert not any(t.startswith(referrers.fallback_tag(image["digest"])) for t in tags(registry, "staging/vllm-openai"))
    assert sorted(v.verdict.status.value for v in records.verdicts(elsewhere, image["image_id"])) == \
        ["incomplete", "pass"]  # journalled as the host's record, never signed


def test_an_image_made_in_the_registry_is_proven_on_its_build_host_without_its_base_in_the_engine(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made, unique: str) -> None:
    """The host that made the image in the registry never had the base in its engine: its smoke pulls the base the
    build read (by the digest the build record names), as a second host does, and proves the image; it never signs
    "no longer in the engine" (it never was)."""
    repo = f"{registry.place}/vllm/only-there-{unique}"
    own = derive(engine, base_v0251, f"{repo}:v0.25.1", f"LABEL io.vllm-hotfix.test-base={unique}")
    engine.push(f"{repo}:v0.25.1")
    engine.remove_image(f"{repo}:v0.25.1")
    assert engine.image(own) is None  # the registry alone holds the base now
    out = made.add(f"{registry.place}/staging/only-there-{unique}:v0.25.1-m3patch")
    [image] = in_registry(project, repo, out)["images"]
    made.add(f"{registry.place}/staging/only-there-{unique}@{image['digest']}")
    [build] = records.builds_of_image(project, image["image_id"])
    assert build.data["base"]["id"] == own
    r = cli("smoke", out, "--gpu", "off", root=project)
    try:
        assert r.rc == 0, r.err
        assert "pass layer-identity" in r.err and "pulled from its registry" in r.err, r.err
        assert engine.image(own) is not None
        # The same with --base-repo naming the base's repository.
        engine.remove_image(own)
        r = cli("smoke", out, "--gpu", "off", "--base-repo", repo, root=project)
        assert r.rc == 0 and "pass layer-identity" in r.err, r.err
    finally:
        if engine.image(own) is not None:
            engine.remove_image(own)


def test_a_second_vllm_in_a_newer_layer_is_patched_there_and_smoke_refuses_the_image(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made) -> None:
    """The registry build reads the newest layers and finds the copy of vLLM under /opt/venv; the base's Python
    imports the one under /usr/local. Nothing in the registry can tell which one Python imports: the smoke, which
    asks the base's Python where it imports vLLM from, finds the image is not what the builder writes for that
    base (exit 14), so the image that patched the wrong copy never passes."""
    second = made.add(f"hotfix-test/second-vllm-{RUN_ID}:v0.25.1")
    derive(engine, base_v0251, second, f"RUN mkdir -p /opt/venv/lib/python3.11/site-packages && cp -a {SITE}/vllm "
                                       f"{SITE}/vllm-0.25.1.dist-info /opt/venv/lib/python3.11/site-packages/")
    repo = f"{registry.place}/vllm/second"
    publish(engine, made, second, f"{repo}:v0.25.1")
    got = in_registry(project, repo, made.add(f"{registry.place}/ops/second:v0.25.1-m3patch"))
    [image] = got["images"]
    assert "/opt/venv/lib/python3.11/site-packages" in got["err"]  # the copy the registry build found
    by_digest = made.add(f"{registry.place}/ops/second@{image['digest']}")
    r = cli("smoke", by_digest, "--gpu", "off", root=project)
    assert r.rc == 14, r.err
    assert "not the product of definition v0.25.1" in r.last_error and "patch layer: /opt is not" in r.last_error, r.err


def test_a_repeat_build_reads_no_byte_of_a_layer_it_has_read_before(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made, tmp_path: Path) -> None:
    """What a read learnt of a layer is kept by the layer's digest: the next revision of the patch set (the same
    files touched) reads nothing of the base's layers again, and makes the same image a first build would."""
    repo = f"{registry.place}/vllm/known"
    publish(engine, made, base_v0251, f"{repo}:v0.25.1")
    cache = {"VLLM_HOTFIX_CACHE": str(tmp_path / "cache")}
    first = in_registry(project, repo, made.add(f"{registry.place}/ops/known:v0.25.1-m3patch"), env=cache)
    [one] = first["images"]
    assert one["read"]["bytes"] > 0 and "known from an earlier read" not in first["err"]
    # Another revision of the patch set: one more comment line in the patch's header, the same files touched.
    patch = project / "patches" / "v0.25.1" / "0001-minimax-m3-topk-buffer-layout.patch"
    patch.write_text("Revision 2 of this backport: the same hunks.\n" + patch.read_text())
    again = in_registry(project, repo, made.add(f"{registry.place}/ops/known:rev2"), env=cache)
    [two] = again["images"]
    assert "known from an earlier read (0 of" in again["err"], again["err"]
    assert "read layer" not in again["err"].replace("known from an earlier read", "")
    base_manifest_and_config = two["read"]["bytes"]  # what is left: the base's manifest and config, never a layer
    assert base_manifest_and_config < 1 << 20, two["read"]
    assert two["image_id"] != one["image_id"]  # another patch set revision: other labels, the same files
    # A cache entry this host did not write is not taken: the layer is read again.
    for index in (tmp_path / "cache" / "registry-layers").glob("*/index/listing.json"):
        index.write_text(index.read_text().replace('"mac": "', '"mac": "0'))
    third = in_registry(project, repo, made.add(f"{registry.place}/ops/known:rev3"), "--rebuild", env=cache)
    assert "known from an earlier read" not in third["err"] and third["images"][0]["read"]["bytes"] > 0


def test_blob_reads_follow_a_redirect_to_storage_without_the_registrys_credentials(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made, tmp_path: Path) -> None:
    """A registry that sends blob reads to object storage on another host: the tool follows the redirect and
    the registry's login never reaches the storage."""
    (tmp_path / "auth").mkdir()
    auth = Registry(tmp_path / "auth", user="ops", password="s3cret-reg")
    auth.start()
    try:
        with registry_proxy.serve(auth.addr) as (proxy, switches):
            switches.redirect_blobs = True
            login = tmp_path / "login"
            login.mkdir()
            token = base64.b64encode(b"ops:s3cret-reg").decode()
            (login / "config.json").write_text(json.dumps({"auths": {proxy: {"auth": token},
                                                                     auth.addr: {"auth": token}}}))
            base_ref = made.add(f"{auth.addr}/vllm/vllm-openai:v0.25.1")
            engine.tag(base_v0251, base_ref)
            subprocess.run(["docker", "push", base_ref], capture_output=True, check=True,
                           env=dict(os.environ, DOCKER_CONFIG=str(login)))
            got = in_registry(project, f"{proxy}/vllm/vllm-openai", f"{registry.place}/ops/redirected:x",
                              env={"DOCKER_CONFIG": str(login)})
            [image] = got["images"]
            assert image["read"]["bytes"] > 0
            assert switches.storage_auth, "no blob read went to the storage"
            assert switches.storage_auth == [None] * len(switches.storage_auth), switches.storage_auth
            pulled = made.pull(f"{registry.place}/ops/redirected@{image['digest']}")
            assert loads(engine, pulled) == "source patched"
    finally:
        auth.stop()


def _zstd_copy(addr: str, src: str, dst: str, *, said: str = "application/vnd.oci.image.layer.v1.tar+zstd",
               only: int | None = None) -> None:
    """``src`` (NAME:TAG in the registry at ``addr``) copied to ``dst`` with every layer zstd-compressed (an OCI
    manifest, the same config: the same uncompressed layers), with plain HTTP and the zstandard library.

    ``said``: the media type the manifest gives those layers (another than zstd's misnames them); ``only``: the
    index of the one layer so packed, the others copied as they are."""
    import gzip

    import zstandard

    def put_blob(name: str, data: bytes) -> dict[str, object]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        start = requests.post(f"http://{addr}/v2/{name}/blobs/uploads/", timeout=30)
        location = start.headers["Location"]
        location = location if location.startswith("http") else f"http://{addr}{location}"
        done = requests.put(location + ("&" if "?" in location else "?") + f"digest={digest}", data=data,
                            headers={"Content-Type": "application/octet-stream"}, timeout=60)
        assert done.status_code == 201, done.text
        return {"digest": digest, "size": len(data)}

    name, tag = src.rsplit(":", 1)
    accept = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"
    manifest = requests.get(f"http://{addr}/v2/{name}/manifests/{tag}", headers={"Accept": accept},
                            timeout=30).json()
    out_name, out_tag = dst.rsplit(":", 1)
    layers = []
    for index, layer in enumerate(manifest["layers"]):
        gz = requests.get(f"http://{addr}/v2/{name}/blobs/{layer['digest']}", timeout=60).content
        if only is not None and index != only:
            layers.append({"mediaType": layer["mediaType"], **put_blob(out_name, gz)})
            continue
        packed = zstandard.ZstdCompressor().compress(gzip.decompress(gz))
        layers.append({"mediaType": said, **put_blob(out_name, packed)})
    config = requests.get(f"http://{addr}/v2/{name}/blobs/{manifest['config']['digest']}", timeout=30).content
    body = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **put_blob(out_name, config)},
            "layers": layers}
    res = requests.put(f"http://{addr}/v2/{out_name}/manifests/{out_tag}", data=json.dumps(body),
                       headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, timeout=30)
    assert res.status_code == 201, res.text


def test_a_base_of_zstd_layers_is_read_and_the_hotfix_layer_stays_gzip(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made) -> None:
    plain = f"{registry.place}/vllm/gz"
    publish(engine, made, base_v0251, f"{plain}:v0.25.1")
    zstd_repo = f"{registry.place}/vllm/zst"
    _zstd_copy(registry.addr, f"{plain.split('/', 1)[1]}:v0.25.1", f"{zstd_repo.split('/', 1)[1]}:v0.25.1")
    got = in_registry(project, zstd_repo, f"{registry.place}/ops/zst:v0.25.1-m3patch")
    [image] = got["images"]
    assert image["read"]["bytes"] > 0 and "is zstd-compressed" not in got["err"]
    accept = {"Accept": "application/vnd.oci.image.manifest.v1+json, "
                        "application/vnd.docker.distribution.manifest.v2+json"}
    manifest = requests.get(registry.api(f"ops/zst/manifests/{image['digest']}"), timeout=10, headers=accept).json()
    kinds = [layer["mediaType"] for layer in manifest["layers"]]
    # The base's layers as the base has them; the hotfix's own layer gzip, which every engine and tool reads.
    assert kinds[:-1] == ["application/vnd.oci.image.layer.v1.tar+zstd"] * (len(kinds) - 1), kinds
    assert kinds[-1].endswith("gzip"), kinds
    # The same hotfix layer as over the gzip base: its bytes do not depend on how the base's are compressed.
    again = in_registry(project, plain, f"{registry.place}/ops/gz:v0.25.1-m3patch")
    other = requests.get(registry.api(f"ops/gz/manifests/{again['images'][0]['digest']}"), timeout=10,
                         headers=accept).json()
    assert other["layers"][-1]["digest"] == manifest["layers"][-1]["digest"]


@pytest.mark.parametrize("only", [None, 0], ids=["every-layer", "a-layer-below-those-read"])
def test_zstd_bytes_under_a_gzip_media_type_are_refused_naming_the_layer(
        engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, made: Made, only: int | None
        ) -> None:
    """A manifest that calls a layer gzip while its bytes are zstd is malformed: refused in one line naming that
    layer, whether the build reads the layer's files or only carries it over by digest; nothing is tagged."""
    plain = f"{registry.place}/vllm/gz-misnamed"
    publish(engine, made, base_v0251, f"{plain}:v0.25.1")
    name = f"vllm/misnamed-{'all' if only is None else only}"
    liar = f"{registry.place}/{name}"
    _zstd_copy(registry.addr, f"{plain.split('/', 1)[1]}:v0.25.1", f"{liar.split('/', 1)[1]}:v0.25.1",
               said="application/vnd.oci.image.layer.v1.tar+gzip", only=only)
    accept = {"Accept": "application/vnd.oci.image.manifest.v1+json"}
    layers = requests.get(registry.api(f"{name}/manifests/v0.25.1"), timeout=10,
                          headers=accept).json()["layers"]
    out = f"{registry.place}/ops/misnamed:v0.25.1-m3patch"
    r = cli("image", "--definition", "v0.25.1", "--base-repo", liar, "--in-registry", "--tag", out, root=project,
            env=NO_ENGINE)
    assert r.rc == 4, r.err
    fails(r, layers[0 if only is None else only]["digest"][:19], "zstd", "gzip")
    assert sum(ln.startswith("error: ") for ln in r.err.splitlines()) == 1, r.err
    assert requests.get(registry.api("ops/misnamed/manifests/v0.25.1-m3patch"), timeout=10,
                        headers=accept).status_code == 404
