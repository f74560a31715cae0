"""File facts read from a registry's blobs: what a Kubernetes Job's verdict is judged on.

Real engine, real registry. The image a cluster pulls is read layer by layer
from the registry, each blob checked against its digest, whiteouts applied.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

from conftest import RegistryPlace, cli, derive, docker_cli, site_key, unreachable_kubeconfig
from vllm_hotfix.checking.launchers import facts
from vllm_hotfix.engine import Engine
from vllm_hotfix.registry import blobs
from vllm_hotfix.registry import client as registry

SITE = "/usr/local/lib/python3.12/dist-packages"
INDEXER = "vllm/models/minimax_m3/common/indexer.py"


def pushed(project: Path, ref: str, reg: RegistryPlace) -> dict[str, str]:
    r = cli("push", ref, "--registry", f"{reg.place}/ops", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    data = json.loads(r.out)
    name = data["ref"].rpartition(":")[0]
    return {"name": name, "by_digest": f"{name}@{data['digest']}", "digest": data["digest"]}


def by_status(facts: facts.FileFacts) -> dict[str, str]:
    return {c["name"]: c["status"] for c in facts.checks}


def source(engine: Engine, ref: str) -> blobs.RegistryFiles:
    return blobs.for_reference(lambda host: registry.client_for(engine, host), ref)


def test_registry_blobs_give_the_facts_the_engine_gives(engine: Engine, built: tuple[Path, str, str],
                                                        registry: RegistryPlace) -> None:
    project, ref, image_id = built
    where = pushed(project, ref, registry)
    files = source(engine, where["by_digest"])
    info = files.image(where["digest"])
    assert info is not None and info.id == image_id  # the config digest is the image ID the engine gives
    from_registry = facts.file_facts(project, info, files, engine)
    local = engine.image(image_id)
    assert local is not None
    from_engine = facts.file_facts(project, local, engine, engine)
    assert by_status(from_registry) == by_status(from_engine) == {
        "patch-landed": "pass", "package-version": "pass", "integrity": "pass"}
    landed = {c["name"]: c for c in from_registry.checks}["patch-landed"]
    assert landed["data"]["files"] == {c["name"]: c for c in from_engine.checks}["patch-landed"]["data"]["files"]

    # The Job a cluster runs carries these checks: it cannot pass without them.
    job_yaml = project / "job.yaml"
    r = cli("smoke", where["by_digest"], "--launcher", "kubernetes", "--emit", str(job_yaml), root=project)
    assert r.rc == 0, r.err
    config_map = json.loads(job_yaml.read_text().split("---\n")[1])
    job = json.loads(config_map["data"]["job.json"])
    assert {c["name"]: c["status"] for c in job["checks"]}["patch-landed"] == "pass"
    assert job["image_id"] == image_id


def test_emit_asks_every_registry_the_image_was_pushed_to(engine: Engine, built: tuple[Path, str, str],
                                                          registry: RegistryPlace) -> None:
    """The name given is under a registry that does not answer; the journal says the image was pushed to another:
    that one is asked too, and the Job names the image there by digest (was: exit 64 at the first registry)."""
    import socket

    project, ref, image_id = built
    where = pushed(project, ref, registry)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = f"127.0.0.1:{port}/ops/vllm:x"
    engine.tag(image_id, down)
    try:
        info = engine.image(image_id)
        assert info is not None and not info.repo_digests, info.repo_digests  # only the journal knows the push
        job_yaml = project / "job-down.yaml"
        r = cli("smoke", down, "--launcher", "kubernetes", "--emit", str(job_yaml), root=project)
        assert r.rc == 0, r.err
        assert where["by_digest"] in job_yaml.read_text()
    finally:
        engine.untag(down)
    # An image no registry that answers holds: the registry's code (8) and its words, not a usage error (64).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = cli("smoke", f"127.0.0.1:{port}/ops/absent:x", "--launcher", "kubernetes", "--emit",
            str(project / "job-none.yaml"), root=project)
    assert r.rc == 8 and "cannot resolve it to a digest through a registry that holds it" in r.err, r.err


def test_no_job_is_written_that_could_not_pass(project: Path, tmp_path: Path) -> None:
    """The image's registry is down: its files cannot be read, and a Job judged without them cannot pass. --emit
    and --submit write and start nothing, and say so in one line with the registry's code (was: exit 0, a Job
    written, and one line mid-output)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = f"127.0.0.1:{port}/ops/vllm@sha256:{'a' * 64}"
    job_yaml = tmp_path / "job.yaml"
    # A cluster nobody runs: never asked, the registry is read first.
    kubeconfig = unreachable_kubeconfig(tmp_path / "config")
    for how in (("--emit", str(job_yaml)), ("--submit", "--kubeconfig", str(kubeconfig))):
        r = cli("smoke", down, "--launcher", "kubernetes", *how, root=project)
        assert r.rc == 8, r.err
        assert r.last_error.startswith(f"error: {down}: the image's files could not be read from its registry"), r.err
        assert "none was written or submitted" in r.last_error and "nothing accepts connections" in r.last_error
        assert not job_yaml.exists()
    assert not (project / "build/records/job").exists()  # no Job journalled that was never written


def test_a_job_of_a_readable_image_is_written_or_submitted_and_its_faults_are_one_line(
        built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path) -> None:
    """The CLI's Job for an image its registry holds: the node selector given, a file that cannot be written
    (exit 10, naming it), a cluster that does not answer (incomplete, 11: the host's shortcoming)."""
    import os

    import yaml

    project, ref, _image_id = built
    where = pushed(project, ref, registry)
    out = tmp_path / "job.yaml"
    r = cli("smoke", where["by_digest"], "--launcher", "kubernetes", "--node-selector",
            "nvidia.com/gpu.product=NVIDIA-H200", "--emit", str(out), root=project)
    assert r.rc == 0 and "--collect job/vllm-hotfix-smoke-" in r.out, r.err
    _config_map, job = list(yaml.safe_load_all(out.read_text()))
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert [v["name"] for v in pod["volumes"]] == ["runner"]

    if os.geteuid() == 0:  # root writes anywhere: the full device stands in for a full disk or a locked folder
        target = tmp_path / "full"
        os.mknod(target, 0o644 | 0o020000, os.makedev(1, 7))
    else:
        (tmp_path / "locked").mkdir(mode=0o500)
        target = tmp_path / "locked" / "job.yaml"
    r = cli("smoke", where["by_digest"], "--launcher", "kubernetes", "--emit", str(target), root=project)
    assert r.rc == 10 and str(target) in r.last_error, r.err

    kubeconfig = unreachable_kubeconfig(tmp_path / "config")
    key = tmp_path / "site.key"
    site_key(key)
    r = cli("smoke", where["by_digest"], "--launcher", "kubernetes", "--submit", "--kubeconfig", str(kubeconfig),
            "--sign-key", str(key), root=project, timeout=120)
    # The host could not run the Job: incomplete (11), not a check the image failed (7).
    assert r.rc == 11, r.err
    assert "cannot reach the Kubernetes API server" in r.last_error and "hint: check the cluster" in r.err


def test_a_job_for_a_private_registry_and_tainted_gpu_nodes_fits_the_api_schema(
        built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path) -> None:
    """Pull secrets, a service account, node labels, tolerations and resources, from a definition's
    [smoke.kubernetes] table and from flags over it: the Job emitted is the API's Job field for field.
    An image its registry holds: a Job is written only for an image whose files were read."""
    import yaml
    from k8s_schema import validate

    project, ref, _image_id = built
    where = pushed(project, ref, registry)
    definition = project / "images" / "v0.25.1.toml"
    definition.write_text(definition.read_text() + """
[smoke]
sign_key = "keys/absent.pem"

[smoke.kubernetes]
namespace = "gpu"
service_account = "vllm-hotfix"
pull_secrets = ["internal-registry"]
node_selector = { "nvidia.com/gpu.product" = "NVIDIA-H200" }
tolerations = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
resources = { requests = { cpu = "8", memory = "64Gi" } }
""")
    out = tmp_path / "job.yaml"
    r = cli("smoke", where["by_digest"], "--definition", "v0.25.1", "--launcher", "kubernetes", "--emit", str(out),
            "--pull-secret", "mirror-pull", "--pull-secret", "internal-registry", "--node-selector", "pool=gpu",
            "--node-selector", "zone=a", "--toleration", "dedicated=ml:NoExecute", "--toleration", ":",
            "--resource", "limits.memory=96Gi", "--gpus", "2", root=project)
    # The table's sign_key waits for --collect: an emitted Job holds no key, so it does not refuse the emit.
    assert r.rc == 0, r.err
    config_map_doc, job_doc = list(yaml.safe_load_all(out.read_text()))
    validate(config_map_doc, "V1ConfigMap")
    job = validate(job_doc, "V1Job")
    assert job.metadata.namespace == "gpu"  # the table's, no flag over it
    pod = job.spec.template.spec
    assert [s.name for s in pod.image_pull_secrets] == ["mirror-pull", "internal-registry"]
    assert pod.service_account_name == "vllm-hotfix"
    assert pod.node_selector == {"pool": "gpu", "zone": "a"}  # the flags' replace the table's
    assert [(t.key, t.operator, t.value, t.effect) for t in pod.tolerations] == \
        [("dedicated", "Equal", "ml", "NoExecute"), (None, "Exists", None, None)]
    [container] = pod.containers
    assert container.resources.limits == {"memory": "96Gi", "nvidia.com/gpu": "2"}
    assert container.resources.requests is None  # the flag replaced the table's resources whole
    # Nothing of a credential reaches the runner: the Secrets are the kubelet's, by name.
    assert [v.name for v in pod.volumes] == ["runner"] and not container.env_from


def test_a_file_removed_in_a_later_layer_is_gone_and_a_bad_blob_is_named(
    engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, unique: str
) -> None:
    project, ref, image_id = built
    # A later layer deletes the patched file (a whiteout entry in the layer tar).
    removed = f"hotfix-test/removed-{unique}:x"
    derive(engine, image_id, removed, f"RUN rm {SITE}/{INDEXER}")
    target = f"{registry.place}/ops/removed-{unique}:x"
    try:
        engine.tag(removed, target)
        docker_cli("push", target)
        digest = docker_cli("inspect", "--format", "{{index .RepoDigests 0}}", target).strip()
        files = source(engine, digest)
        info = files.image(digest.partition("@")[2])
        assert info is not None
        statuses = by_status(facts.file_facts(project, info, files, engine))
        assert statuses["patch-landed"] == "fail"

        # The registry's copy of the top layer altered on disk: the read stops and names the layer.
        top = json.loads(registry_manifest(registry, digest))["layers"][-1]["digest"]
        data = registry.storage / "docker/registry/v2/blobs/sha256" / top[7:9] / top[7:] / "data"
        body = bytearray(data.read_bytes())
        body[-1] ^= 0xFF  # the gzip trailer's last byte: the tar inside still reads, only the digest tells
        data.write_bytes(bytes(body))
        found = facts.file_facts(project, info, source(engine, digest), engine)
        assert by_status(found)["patch-landed"] == "incomplete"
        assert f"layer {top[:19]}" in found.checks[0]["detail"] and "hash" in found.checks[0]["detail"]
    finally:
        engine.remove_image(target)
        engine.remove_image(removed)


def registry_manifest(reg: RegistryPlace, by_digest: str) -> bytes:
    import requests

    name, _, digest = by_digest.partition("@")
    path = name.split("/", 1)[1]
    accept = ", ".join((registry.OCI_MANIFEST, registry.DOCKER_MANIFEST))
    return requests.get(f"http://{reg.addr}/v2/{path}/manifests/{digest}", headers={"Accept": accept},
                        timeout=10).content


def _tar(members: list[tuple[str, str, bytes | str]]) -> bytes:
    """A gzipped layer: (name, kind, data) with kind file, dir, link (data: target) or hard (data: target)."""
    import io
    import tarfile

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind in ("link", "hard"):
                info.type = tarfile.SYMTYPE if kind == "link" else tarfile.LNKTYPE
                info.linkname = str(data)
                tar.addfile(info)
            else:
                body = data if isinstance(data, bytes) else data.encode()
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return gzip.compress(raw.getvalue(), mtime=0)


def _push_layers(reg: RegistryPlace, repo: str, layers: list[bytes], sizes: list[int] | None = None,
                 diff_ids: list[str] | None = None) -> str:
    """Upload ``layers`` and a config naming their diff IDs (or ``diff_ids``) as blobs, put a manifest over them;
    its digest."""
    import requests

    base = f"http://{reg.addr}/v2/{repo}"

    def blob(body: bytes) -> str:
        digest = f"sha256:{hashlib.sha256(body).hexdigest()}"
        start = requests.post(f"{base}/blobs/uploads/", timeout=10)
        assert start.status_code == 202, start.text
        location = start.headers["Location"]
        if location.startswith("/"):
            location = f"http://{reg.addr}{location}"
        done = requests.put(location, params={"digest": digest}, data=body, timeout=10,
                            headers={"Content-Type": "application/octet-stream"})
        assert done.status_code == 201, done.text
        return digest

    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Labels": {"x": "y"}},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids if diff_ids is not None else [
                             f"sha256:{hashlib.sha256(gzip.decompress(b)).hexdigest()}" for b in layers]}}).encode()
    doc = {"schemaVersion": 2, "mediaType": registry.DOCKER_MANIFEST,
           "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": len(config),
                      "digest": blob(config)},
           "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                       "size": (sizes or [len(b) for b in layers])[i], "digest": blob(b)}
                      for i, b in enumerate(layers)]}
    body = json.dumps(doc).encode()
    res = requests.put(f"{base}/manifests/t", data=body, headers={"Content-Type": registry.DOCKER_MANIFEST},
                       timeout=10)
    assert res.status_code == 201, res.text
    return res.headers["Docker-Content-Digest"]


def test_layers_laid_over_each_other_as_an_engine_does(registry: RegistryPlace) -> None:
    from vllm_hotfix.errors import EngineError

    client = registry_module_client(registry)
    lower = _tar([("opt/", "dir", b""), ("opt/store/", "dir", b""), ("opt/store/a.py", "file", "shared\n"),
                  ("site/", "dir", b""), ("site/pkg/", "dir", b""), ("site/pkg/x.py", "file", "old\n"),
                  ("site/gone.py", "file", "g\n"), ("site/opaque/", "dir", b""), ("site/opaque/y.py", "file", "y\n")])
    # A link in place of a folder (its old files are gone), a whiteout, an opaque folder, and a hard link to a
    # file outside the folder read (its target sits earlier in the same tar, as in a real layer).
    upper = _tar([("opt/", "dir", b""), ("opt/store/", "dir", b""), ("opt/store/a.py", "file", "shared\n"),
                  ("site/pkg", "link", "/elsewhere"), ("site/.wh.gone.py", "file", b""),
                  ("site/opaque/.wh..wh..opq", "file", b""), ("site/opaque/z.py", "file", "z\n"),
                  ("site/twin.py", "hard", "opt/store/a.py")])
    digest = _push_layers(registry, f"{registry.ns}/ops/layers", [lower, upper])
    files = blobs.RegistryFiles(client, f"{registry.ns}/ops/layers", digest)
    info = files.image(digest)
    assert info is not None and info.labels == {"x": "y"}
    with files.files(info.id) as reader:
        tree = reader.read(["/site"])
        assert sorted(tree.entries) == ["/site", "/site/opaque", "/site/opaque/z.py", "/site/pkg", "/site/twin.py"]
        assert tree.entries["/site/pkg"].kind == "link"
        twin = tree.entries["/site/twin.py"]
        assert twin.kind == "hardlink" and twin.sha256 == hashlib.sha256(b"shared\n").hexdigest()
        assert reader.read(["/nowhere"]).missing == ("/nowhere",)

    # A layer whose uncompressed tar is not the diff ID its config names is refused before any of it is used.
    wrong = _push_layers(registry, f"{registry.ns}/ops/wrong", [lower, upper],
                         diff_ids=[f"sha256:{hashlib.sha256(gzip.decompress(lower)).hexdigest()}",
                                   f"sha256:{hashlib.sha256(gzip.decompress(lower)).hexdigest()}"])
    with blobs.RegistryFiles(client, f"{registry.ns}/ops/wrong", wrong).files(wrong) as reader:
        try:
            reader.read(["/site"])
            raise AssertionError("a layer other than its config's diff ID was read")
        except EngineError as exc:
            assert "diff ID" in str(exc)

    # A registry sending more than the manifest says of a blob is stopped.
    short = _push_layers(registry, f"{registry.ns}/ops/short", [lower], sizes=[len(lower) - 10])
    with blobs.RegistryFiles(client, f"{registry.ns}/ops/short", short).files(short) as reader:
        try:
            reader.read(["/site"])
            raise AssertionError("an oversized blob was read")
        except EngineError as exc:
            assert "more than the" in str(exc)


def registry_module_client(reg: RegistryPlace) -> registry.Client:
    return registry.Client(reg.addr, secure=False, credentials=None)
