"""Every platform of the base: x86_64 and aarch64 hotfix images under one index.

Integration tests run on a Docker engine that keeps local images' platforms
(26.1, API 1.45; Debian 12's 20.10 does not) with qemu registered for the
other architecture, against a real registry on a free loopback port holding a
two-platform stand-in index (Debian bookworm of each architecture plus the
real vLLM wheel of each). The engine is VLLM_HOTFIX_PLATFORM_ENGINE, else
CDI_DOCKER_HOST, else the socket `.ci/services start-cdi-engine` uses. Without
it (or without the emulator) these tests are skipped, unless
VLLM_HOTFIX_REQUIRE_PLATFORM_ENGINE is set (CI), where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from conftest import REPO, RUN_ID, RUN_TOKEN, STANDIN_REPO, Registry, cli, fails
from vllm_hotfix.building import platforms
from vllm_hotfix.building.platforms import Platform
from vllm_hotfix.engine import Engine
from vllm_hotfix.journal import records
from vllm_hotfix.registry import client as registry

AMD64, ARM64 = Platform("linux", "amd64"), Platform("linux", "arm64")
PLAT_HOST = (os.environ.get("VLLM_HOTFIX_PLATFORM_ENGINE") or os.environ.get("CDI_DOCKER_HOST")
             or "unix:///run/vllm-hotfix-cdi/docker.sock")
SITE = "/usr/local/lib/python3.12/dist-packages"
PATCHED = {"vllm/models/minimax_m3/common/indexer.py", "vllm/models/minimax_m3/common/sparse_attention.py"}


def test_an_api_141_engine_is_refused_for_another_platform(project: Path, unique: str, tmp_path: Path) -> None:
    """The distribution's 20.10 engine would record amd64 for an arm64 image: refuse before any work."""
    eng = Engine.connect()
    if eng.api_version >= platforms.MIN_API:
        pytest.skip(f"the default engine is {eng.version_text}; this test is about older ones")
    r = cli("render", "--definition", "v0.25.1", "--platform", "linux/arm64", "--pull", "never", root=project)
    fails(r, "linux/arm64", "mishandles")
    assert r.rc == 5


def _unavailable(why: str) -> None:
    if os.environ.get("VLLM_HOTFIX_REQUIRE_PLATFORM_ENGINE"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def plat_engine() -> Iterator[Engine]:
    try:
        eng = Engine.connect(timeout=300, base_url=PLAT_HOST)
    except Exception as exc:  # noqa: BLE001 - any failure to connect means "not here"
        _unavailable(f"no Docker engine on {PLAT_HOST} ({exc}); start one: .ci/services install-cdi-engine "
                     "start-cdi-engine (or set VLLM_HOTFIX_PLATFORM_ENGINE)")
    if eng.api_version < platforms.MIN_API:
        _unavailable(f"{PLAT_HOST} is {eng.version_text}; platform tests need API 1.45 or newer")
    other = ARM64 if eng.arch == "amd64" else AMD64
    if not platforms.emulator_registered(other):
        _unavailable(f"no emulator for {other.machine} registered in binfmt_misc: .ci/services install")
    yield eng
    leaks = eng.containers_with_role(RUN_ID)
    assert not leaks, f"containers left behind on {PLAT_HOST}: {leaks}"


# Every command of these tests talks to the platform-aware engine.
PENV = {"DOCKER_HOST": PLAT_HOST}


@pytest.fixture(scope="module")
def index_registry(plat_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """A registry holding a two-platform stand-in index of v0.25.1, published by the tool."""
    reg = Registry(tmp_path_factory.mktemp("platform-registry"))
    reg.start()
    try:
        r = cli("standin", "--version", "0.25.1", "--platform", "linux/amd64,linux/arm64",
                "--publish", f"{reg.addr}/{STANDIN_REPO}", env=PENV, timeout=1200)
        assert r.rc == 0, r.err
        children = {line.split()[1]: line.split()[2] for line in r.out.splitlines() if line.startswith("platform ")}
        yield {"registry": reg, "index": r.out.split()[-1], "children": children,
               "base_repo": f"{reg.addr}/{STANDIN_REPO}/vllm-openai"}
    finally:
        reg.stop()
        # Removing a last reference (not untagging) also prunes the build steps under it.
        for plat in (AMD64, ARM64):
            ref = f"{STANDIN_REPO}/vllm-openai:v0.25.1-{plat.suffix}"  # what --publish made locally
            info = plat_engine.image(ref)
            if info is not None and info.tags == (ref,):
                plat_engine.remove_image(ref, force=False)
            elif info is not None:
                plat_engine.untag(ref)  # the layer cache made it the same image as another name's


@pytest.fixture(scope="module")
def built_both(plat_engine: Engine, index_registry: dict[str, object], tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[Path, str, dict[str, object]]]:
    """`image --base v0.25.1` from the index, in a project copy of its own."""
    root = tmp_path_factory.mktemp("platform-project")
    for folder in ("images", "patches"):
        subprocess.run(["cp", "-r", str(REPO / folder), str(root / folder)], check=True)
    out = f"hotfix-test/platforms-{RUN_TOKEN}:v0.25.1-m3patch"
    r = cli("image", "--definition", "v0.25.1", "--base-repo", str(index_registry["base_repo"]), "--tag", out,
            "--json", root=root, env=PENV, timeout=1200)
    assert r.rc == 0, r.err
    result = json.loads(r.out)
    yield root, out, result
    for ref in (out, f"{out}-x86_64", f"{out}-aarch64"):
        plat_engine.remove_image(ref, force=False)
    for digest in (index_registry["children"] or {}).values():  # type: ignore[union-attr]
        plat_engine.remove_image(f"{index_registry['base_repo']}@{digest}", force=False)


# Lists every file of the vLLM package (path -> sha256) and, for each given
# source, what its cached bytecode says: flags, source hash, magic, and this
# interpreter's own magic and machine.
TREE = r"""
import hashlib, importlib.util, json, os, platform, sys
site, rels = sys.argv[1], sys.argv[2:]
files = {}
for d, _, names in os.walk(os.path.join(site, "vllm")):
    for n in names:
        p = os.path.join(d, n)
        files[os.path.relpath(p, site)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
pycs = {}
for rel in rels:
    src = open(os.path.join(site, rel), "rb").read()
    pyc = importlib.util.cache_from_source(os.path.join(site, rel))
    data = open(pyc, "rb").read()
    pycs[rel] = {"magic_ok": data[:4] == importlib.util.MAGIC_NUMBER,
                 "flags": int.from_bytes(data[4:8], "little"),
                 "hash_ok": data[8:16] == importlib.util.source_hash(src)}
print(json.dumps({"files": files, "pycs": pycs, "machine": platform.machine()}))
"""


def tree(engine: Engine, image: str, rels: list[str]) -> dict[str, object]:
    res = engine.run(image, ["python3", "-c", TREE, SITE, *rels], timeout=300)
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def test_image_builds_every_platform_of_the_index(plat_engine: Engine, index_registry: dict[str, object],
                                                  built_both: tuple[Path, str, dict[str, object]]) -> None:
    root, out, result = built_both
    kids = {c["platform"]: c for c in result["platforms"]}  # type: ignore[union-attr,index]
    assert set(kids) == {"linux/amd64", "linux/arm64"}
    children = index_registry["children"]
    for plat in (AMD64, ARM64):
        kid = kids[str(plat)]
        assert kid["ref"] == f"{out}-{plat.suffix}" and kid["smoke"] == "pass"
        info = plat_engine.image(kid["ref"])
        assert info is not None and info.id == kid["image_id"]
        # The base's platform, in the built image's config.
        assert (info.os, info.architecture) == (plat.os, plat.architecture)
        build = records.builds_of_image(root, info.id)[0].data
        base = build["base"]
        assert base["ref"] == f"{index_registry['base_repo']}@{children[str(plat)]}"  # type: ignore[index]
        assert base["platform"] == str(plat)
        # The base's own Python (aarch64 under emulation) located, patched and compiled.
        assert base["machine"] == plat.machine
        assert set(build["files"]) == PATCHED
        # Exactly the patched files (and their fresh bytecode) differ from the base.
        mine = tree(plat_engine, info.id, sorted(PATCHED))
        theirs = tree(plat_engine, base["id"], [])
        assert mine["machine"] == theirs["machine"] == plat.machine
        changed = {rel for rel in set(mine["files"]) | set(theirs["files"])  # type: ignore[arg-type]
                   if mine["files"].get(rel) != theirs["files"].get(rel)}  # type: ignore[union-attr]
        assert {rel for rel in changed if not rel.endswith(".pyc")} == PATCHED
        assert {os.path.dirname(os.path.dirname(rel)) for rel in changed if rel.endswith(".pyc")} == \
            {os.path.dirname(rel) for rel in PATCHED}
        for rel in PATCHED:
            assert mine["files"][rel] == build["files"][rel]["sha256"]  # type: ignore[index]
            assert mine["files"][rel] != build["files"][rel]["original_sha256"]  # type: ignore[index]
            pyc = mine["pycs"][rel]  # type: ignore[index]
            # That interpreter's magic, checked-hash bytecode of exactly the patched source.
            assert pyc["magic_ok"] and pyc["hash_ok"] and pyc["flags"] & 1
    # The plain tag names the engine's own platform's image.
    own = plat_engine.image(out)
    assert own is not None and own.id == kids[f"linux/{plat_engine.arch}"]["image_id"]


def test_push_puts_an_index_over_both_platforms(plat_engine: Engine, index_registry: dict[str, object],
                                                built_both: tuple[Path, str, dict[str, object]]) -> None:
    root, out, result = built_both
    reg = index_registry["registry"]
    assert isinstance(reg, Registry)
    r = cli("push", out, "--platform", "all", "--registry", f"{reg.addr}/ops", "--allow-gpu-unverified", "--json",
            root=root, env=PENV, timeout=1200)
    assert r.rc == 0, r.err
    note = json.loads(r.out)
    name = out.split("/", 1)[1].split(":")[0]
    tag = out.rsplit(":", 1)[1]
    assert note["ref"] == f"{reg.addr}/ops/{name}:{tag}"
    got = requests.get(f"http://{reg.addr}/v2/ops/{name}/manifests/{tag}", timeout=10,
                       headers={"Accept": registry.ACCEPT})
    assert got.status_code == 200
    assert registry.sha256(got.content) == note["digest"] == got.headers["Docker-Content-Digest"]
    index = got.json()
    assert index["mediaType"] == note["media_type"] == registry.DOCKER_LIST
    listed = {f"{m['platform']['os']}/{m['platform']['architecture']}": m["digest"] for m in index["manifests"]}
    reported = {c["platform"]: c["digest"] for c in note["children"]}
    assert listed == reported and set(listed) == {"linux/amd64", "linux/arm64"}
    for child in note["children"]:
        # Each child also stands under upstream's per-platform tag, with the digest the note gives.
        ctag = child["ref"].rsplit(":", 1)[1]
        assert ctag == f"{tag}-{Platform('linux', child['platform'].split('/')[1]).suffix}"
        head = requests.get(f"http://{reg.addr}/v2/ops/{name}/manifests/{ctag}", timeout=10,
                            headers={"Accept": registry.DOCKER_MANIFEST})
        assert head.headers["Docker-Content-Digest"] == child["digest"]
        config = requests.get(f"http://{reg.addr}/v2/ops/{name}/blobs/{head.json()['config']['digest']}",
                              timeout=10).json()
        assert f"{config['os']}/{config['architecture']}" == child["platform"]
    # The journal's push entry: each child digest and the index digest.
    entry = records.pushes(root, note["children"][1]["image_id"])[0].data
    assert entry["digest"] == note["digest"]
    assert {c["platform"]: c["digest"] for c in entry["children"]} == reported


def _arch_of_config(reg: Registry, name: str, tag: str) -> str:
    head = requests.get(f"http://{reg.addr}/v2/{name}/manifests/{tag}", timeout=10,
                        headers={"Accept": registry.DOCKER_MANIFEST})
    assert head.status_code == 200, head.text
    config = requests.get(f"http://{reg.addr}/v2/{name}/blobs/{head.json()['config']['digest']}", timeout=10).json()
    return f"{config['os']}/{config['architecture']}"


def test_a_plain_push_pushes_every_platform_built(plat_engine: Engine, index_registry: dict[str, object],
                                                  built_both: tuple[Path, str, dict[str, object]]) -> None:
    """No --platform: the two-platform build goes out whole, each child and an index under TAG."""
    root, out, _ = built_both
    reg = index_registry["registry"]
    assert isinstance(reg, Registry)
    r = cli("push", out, "--registry", f"{reg.addr}/plain", "--allow-gpu-unverified", root=root, env=PENV,
            timeout=1200)
    assert r.rc == 0, r.err
    name, tag = out.split("/", 1)[1].split(":")[0], out.rsplit(":", 1)[1]
    assert f"pushed index {reg.addr}/plain/{name}:{tag}" in r.out
    got = requests.get(f"http://{reg.addr}/v2/plain/{name}/manifests/{tag}", timeout=10,
                       headers={"Accept": registry.ACCEPT})
    index = got.json()
    assert index["mediaType"] == registry.DOCKER_LIST
    assert {f"{m['platform']['os']}/{m['platform']['architecture']}" for m in index["manifests"]} == \
        {"linux/amd64", "linux/arm64"}
    for plat in (AMD64, ARM64):
        assert _arch_of_config(reg, f"plain/{name}", f"{tag}-{plat.suffix}") == str(plat)


def test_rollback_after_a_two_platform_build_keeps_each_platform(
        plat_engine: Engine, built_both: tuple[Path, str, dict[str, object]]) -> None:
    """One two-platform build: no earlier build of either platform, so nothing moves (never amd64 under -aarch64)."""
    root, out, _ = built_both
    before = {ref: plat_engine.image(ref) for ref in (out, f"{out}-x86_64", f"{out}-aarch64")}
    r = cli("rollback", "--definition", "v0.25.1", root=root, env=PENV)
    fails(r, "no earlier build of v0.25.1")
    assert r.rc == 1
    r = cli("rollback", "--definition", "v0.25.1", "--tag", f"{out}-aarch64", root=root, env=PENV)
    fails(r, "linux/arm64")
    for ref, was in before.items():
        now = plat_engine.image(ref)
        assert now is not None and was is not None and now.id == was.id
    arm = plat_engine.image(f"{out}-aarch64")
    assert arm is not None and arm.architecture == "arm64"


def test_a_push_whose_architecture_contradicts_its_suffix_is_refused(
        plat_engine: Engine, index_registry: dict[str, object],
        built_both: tuple[Path, str, dict[str, object]]) -> None:
    root, out, _ = built_both
    reg = index_registry["registry"]
    assert isinstance(reg, Registry)
    amd = plat_engine.image(f"{out}-x86_64")
    assert amd is not None
    wrong = f"{out.rsplit(':', 1)[0]}:by-hand-aarch64"
    plat_engine.tag(amd.id, wrong)
    try:
        r = cli("push", wrong, "--registry", f"{reg.addr}/wrong", "--allow-gpu-unverified", root=root, env=PENV,
                timeout=600)
        fails(r, wrong, "linux/amd64", "suffix")
        assert r.rc == 13
    finally:
        plat_engine.untag(wrong)
    name = out.split("/", 1)[1].split(":")[0]
    assert requests.get(f"http://{reg.addr}/v2/wrong/{name}/tags/list", timeout=5).status_code == 404


def test_gate_refuses_the_index_when_one_platform_failed(plat_engine: Engine, index_registry: dict[str, object],
                                                          built_both: tuple[Path, str, dict[str, object]],
                                                          tmp_path: Path) -> None:
    root, out, result = built_both
    reg = index_registry["registry"]
    assert isinstance(reg, Registry)
    arm = f"{out}-aarch64"
    # A later smoke run of the arm64 image fails for real: the stand-in has no `vllm serve`.
    model = tmp_path / "model"
    model.mkdir()
    r = cli("smoke", arm, "--serve-model", str(model), "--concurrency", "1", "--requests", "1", root=root,
            env=PENV, timeout=1200)
    assert r.rc == 7, r.err
    r = cli("push", out, "--platform", "all", "--registry", f"{reg.addr}/refused", "--allow-gpu-unverified",
            root=root, env=PENV, timeout=1200)
    fails(r, "linux/arm64", "failed its newest smoke run")
    assert r.rc == 8
    # Nothing reached the registry: neither the amd64 child nor an index.
    name = out.split("/", 1)[1].split(":")[0]
    assert requests.get(f"http://{reg.addr}/v2/refused/{name}/tags/list", timeout=5).status_code == 404


def test_a_missing_emulator_is_one_error_line(index_registry: dict[str, object], project: Path,
                                              tmp_path: Path) -> None:
    empty = tmp_path / "binfmt"
    empty.mkdir()
    r = cli("image", "--definition", "v0.25.1", "--base-repo", str(index_registry["base_repo"]), "--platform",
            "linux/arm64", "--tag", f"hotfix-test/no-emulator-{RUN_TOKEN}:v1", root=project,
            env={**PENV, "VLLM_HOTFIX_BINFMT_DIR": str(empty)}, timeout=1200)
    fails(r, "linux/arm64", "no emulator for aarch64")
    assert r.rc == 4 and "qemu-user-static" in r.err
    assert not records.builds(project)


def test_an_index_of_one_platform_gets_the_plain_tag_too(plat_engine: Engine, project: Path, unique: str,
                                                         tmp_path: Path) -> None:
    """--platform all on an index holding the engine's own platform alone: OUTPUT-<machine> and OUTPUT, one image."""
    own = Platform("linux", plat_engine.arch)
    reg = Registry(tmp_path)
    reg.start()
    where = f"one-{unique}"
    out = f"hotfix-test/one-platform-{unique}:v0.25.1-m3patch"
    try:
        r = cli("standin", "--version", "0.25.1", "--platform", str(own), "--publish", f"{reg.addr}/{where}",
                env=PENV, timeout=1200)
        assert r.rc == 0, r.err
        r = cli("image", "--definition", "v0.25.1", "--base-repo", f"{reg.addr}/{where}/vllm-openai",
                "--platform", "all",
                "--tag", out, "--no-smoke", root=project, env=PENV, timeout=1200)
        assert r.rc == 0, r.err
        child, plain = plat_engine.image(f"{out}-{own.suffix}"), plat_engine.image(out)
        assert child is not None and plain is not None and plain.id == child.id
    finally:
        reg.stop()
        base = plat_engine.image(f"{where}/vllm-openai:v0.25.1-{own.suffix}")  # what --publish made locally
        for ref in (out, f"{out}-{own.suffix}", f"{where}/vllm-openai:v0.25.1-{own.suffix}",
                    *(base.repo_digests if base is not None else ())):
            plat_engine.remove_image(ref, force=False)


@pytest.mark.parametrize("again", ["patches", "rebuild", "assemble"])
def test_rollback_after_two_two_platform_builds_moves_every_platform_back(
        plat_engine: Engine, index_registry: dict[str, object], project: Path, unique: str, again: str) -> None:
    """Two builds of both platforms (the second of changed patches, or --rebuild, or by the other builder), then
    rollback: each TAG-<machine> and TAG go back to the first build's image of their platform."""
    out = f"hotfix-test/two-builds-{unique}:v0.25.1-m3patch"
    refs = {"x86_64": f"{out}-x86_64", "aarch64": f"{out}-aarch64", "plain": out}
    made: list[dict[str, str]] = []
    try:
        for n in range(2):
            more: tuple[str, ...] = ()
            if n and again == "patches":
                patch = next((project / "patches/v0.25.1").glob("*.patch"))
                patch.write_text("Rebuilt for the rollback test.\n" + patch.read_text())
            elif n:
                more = ("--rebuild",) if again == "rebuild" else ("--builder", "assemble")
            r = cli("image", "--definition", "v0.25.1", "--base-repo", str(index_registry["base_repo"]), "--tag", out,
                    "--platform", "all", "--no-smoke", "--json", *more, root=project, env=PENV, timeout=1200)
            assert r.rc == 0, r.err
            made.append({p["ref"]: p["image_id"] for p in json.loads(r.out)["platforms"]})
        first, second = made
        assert set(first.values()).isdisjoint(second.values())
        r = cli("rollback", "--definition", "v0.25.1", "--json", root=project, env=PENV)
        assert r.rc == 0, r.err
        now = {name: getattr(plat_engine.image(ref), "id", None) for name, ref in refs.items()}
        assert now["x86_64"] == first[refs["x86_64"]] and now["aarch64"] == first[refs["aarch64"]], r.out
        own = refs["x86_64"] if plat_engine.arch == "amd64" else refs["aarch64"]
        assert now["plain"] == first[own], r.out
    finally:
        for ref in refs.values():
            plat_engine.remove_image(ref, force=False)
        for build in made:
            for image_id in build.values():
                plat_engine.remove_untagged(image_id)


def test_platform_all_on_a_base_its_registry_lacks_is_refused(index_registry: dict[str, object], project: Path,
                                                              unique: str) -> None:
    """--platform all where the registry answers that it has no such manifest: the platforms are unknown, so
    the run fails (4) naming it; it never builds one platform quietly."""
    repo = f"{index_registry['base_repo']}-absent-{unique}"
    out = f"hotfix-test/absent-{unique}:x"
    r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--platform", "all", "--tag", out, root=project,
            env=PENV)
    assert r.rc == 4, r.err
    assert f"--platform all: the registry of {repo}:v0.25.1 has no such manifest" in r.err, r.err
    assert "==> building" not in r.err


def test_push_platform_all_needs_every_platform_image_built(plat_engine: Engine, index_registry: dict[str, object],
                                                            built_both: tuple[Path, str, dict[str, object]]) -> None:
    """--platform all pushes every platform `image` built under the name: one missing from the engine is named
    (4) and nothing is pushed, never an index over the ones that happen to be there."""
    root, out, _ = built_both
    reg = index_registry["registry"]
    assert isinstance(reg, Registry)
    arm = plat_engine.image(f"{out}-aarch64")
    assert arm is not None
    keeper = f"{out}-aarch64-kept"
    plat_engine.tag(arm.id, keeper)  # the image stays while its output tag is gone
    plat_engine.untag(f"{out}-aarch64")
    try:
        r = cli("push", out, "--platform", "all", "--registry", f"{reg.addr}/partial", "--allow-gpu-unverified",
                root=root, env=PENV, timeout=600)
        assert r.rc == 4, r.err
        assert f"no linux/arm64 image {out}-aarch64 in the engine (image built it under this name" in r.err, r.err
        name = out.split("/", 1)[1].split(":")[0]
        got = requests.get(f"http://{reg.addr}/v2/partial/{name}/tags/list", timeout=10)
        assert got.status_code == 404 or not got.json().get("tags"), got.text
    finally:
        plat_engine.tag(arm.id, f"{out}-aarch64")
        plat_engine.untag(keeper)
