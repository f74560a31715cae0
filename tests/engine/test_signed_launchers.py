"""Signatures that mean what they say, through every launcher: docker, podman and a Kubernetes Job.

Real engine, real registry, podman where installed. No cluster runs here: a
Job is started as a node would start it (its one container, with the
command, environment and volumes the emitted spec names and nothing else)
on the Docker engine, and its log is collected with `smoke --collect`.

- Only the host that started the runner signs: an image whose python3
  searches its whole filesystem and environment for a private key finds
  none, whichever launcher started it with `--sign-key`.
- Every launcher runs the same named checks for the same image, and each
  one's signed verdict verifies with `verify` and with securesystemslib.
- The host's own facts decide what it can judge: an unpatched base wearing
  the patched image's labels, and a python3 that claims GPU checks passed
  on a host with no GPU, fail smoke and get no passing signature.
- The newest signed verdict decides, in `verify` and in the push gate.
- A pushed tag resolves to its digest through the registry.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.server
import json
import shutil
import subprocess
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from securesystemslib.dsse import Envelope
from securesystemslib.signer import SSlibKey

from conftest import Product, RegistryPlace, cli, derive, docker_cli, key_pair
from vllm_hotfix.engine import Engine
from vllm_hotfix.trust import attest, signing
from vllm_hotfix.verdicts import Check, Status, judge

PODMAN = shutil.which("podman") is not None
needs_podman = pytest.mark.skipif(not PODMAN, reason="podman is not installed (`.ci/services install` installs it)")

# A hostile interpreter: reads every file it can and its whole environment for a private key, says what it
# found on its last line, and gives the runner no report. (The pattern is split so that it never finds itself.)
KEY_SEARCH = b"""#!/bin/sh
# As the runner is started (python3 -I -S run.py JOB): search; otherwise the base's own Python.
[ "$1" = "-I" ] || exec /usr/bin/python3 "$@"
pat='-----BEGIN [A-Z ]*PRIV''ATE KEY-----'
found=$(grep -RlsIE -D skip --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev -e "$pat" / | tr '\\n' ' ')
inenv=$(env | grep -cE -e "$pat")
echo "searched every file and $(env | wc -l) environment variables" >&2
if [ -n "$found" ] || [ "$inenv" != "0" ]; then
  echo "key-search: FOUND files: $found environment: $inenv" >&2
else
  echo "key-search: nothing found" >&2
fi
exit 3
"""

# A hostile interpreter that answers for the runner: a passing report that claims every check, and GPU
# checks passed on an H200. Every other call goes to the image's real Python.
LIAR = b'''import base64
import json
import os
import sys

args = sys.argv[1:]
if not any(a.endswith("/run.py") for a in args):
    os.execv("/usr/bin/python3", ["/usr/bin/python3", *args])
job = json.load(open(args[-1]))


def ok(name, **more):
    return {"name": name, "status": "pass", "detail": "fine", **more}


torch = ok("gpu-torch", ran_against="torch")
checks = [dict(c, status="pass", detail="fine") for c in job.get("checks") or []]
checks += [ok("import-location"), ok("env-report"), torch, ok("gpu-kernel", ran_against="torch"), ok("serve-sweep")]
report = {"image": job["image"], "image_id": job["image_id"], "status": "pass", "checks": checks,
          "gpu_verified": True, "gpu": {"mode": "auto", "verified": True, "devices": ["NVIDIA H200"],
                                        "raw_checks": [torch, ok("gpu-kernel", ran_against="torch")]}}
print("@@vllm-hotfix-runner:report@@", base64.b64encode(json.dumps(report).encode()).decode())
'''
LIAR_PY = b'#!/bin/sh\nexec /usr/bin/python3 /usr/local/lib/liar.py "$@"\n'


def _independent(envelope: bytes, key: ec.EllipticCurvePrivateKey) -> dict[str, object]:
    """securesystemslib's DSSE code, not the tool's, verifies the envelope; the statement it covers."""
    public = SSlibKey.from_crypto(key.public_key(), keyid=signing.key_id(key.public_key()),
                                  scheme="ecdsa-sha2-nistp256")
    env = Envelope.from_dict(json.loads(envelope))
    assert list(env.verify([public], 1)) == [public.keyid]
    return dict(json.loads(env.payload))


def _report(path: Path) -> dict[str, object]:
    return dict(json.loads(path.read_text()))


def _names(report: dict[str, object]) -> list[str]:
    return [str(c["name"]) for c in report["checks"]]  # type: ignore[attr-defined]


def _checks(report: dict[str, object]) -> dict[str, dict[str, object]]:
    return {str(c["name"]): c for c in report["checks"]}  # type: ignore[attr-defined]


def _pushed(engine: Engine, local: str, registry: RegistryPlace, name: str) -> str:
    """``local`` pushed with the engine's own client (no gate): its NAME@sha256:... in the registry."""
    target = f"{registry.place}/{name}:x"
    engine.tag(local, target)
    try:
        docker_cli("push", target)
        return docker_cli("inspect", "--format", "{{index .RepoDigests 0}}", target).strip()
    finally:
        engine.untag(target)


def run_as_a_node(engine: Engine, job_yaml: Path | list[dict[str, Any]], image_id: str, folder: Path,
                  secrets: dict[str, dict[str, bytes]]) -> str:
    """Start the emitted Job's container as a node would, and return its log (stdout and stderr).

    Only what the spec names reaches the container: its command, its
    environment, and its volumes (a ConfigMap's items as files; a Secret's
    keys, from ``secrets``, the Secrets the cluster holds, as files).
    """
    docs = job_yaml if isinstance(job_yaml, list) else \
        [json.loads(doc) for doc in job_yaml.read_text().split("---\n") if doc.strip()]
    config_map, job = docs
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert "@sha256:" in container["image"]  # a node pulls it by digest; here it is the engine's copy
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = []
    for mount in container["volumeMounts"]:
        volume, where = volumes[mount["name"]], folder / mount["name"]
        if "configMap" in volume:
            files = {item["path"]: config_map["data"][item["key"]].encode() for item in volume["configMap"]["items"]}
        elif "secret" in volume:
            files = dict(secrets.get(volume["secret"]["secretName"], {}))
        else:
            raise AssertionError(f"a volume no node here can give: {volume}")
        for rel, data in files.items():
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            (where / rel).write_bytes(data)
        mounts.append((str(where), mount["mountPath"]))
    env = {e["name"]: e["value"] for e in container.get("env") or []}
    assert not container.get("envFrom"), container
    done = engine.run(image_id, container["command"], mounts=mounts, env=env, timeout=600)
    return done.stdout + done.stderr


class FakeCluster:
    """The few Kubernetes API calls `--submit` and `--collect job/NAME` make, answered on loopback.

    A Job created through it runs at its first status read, as a node would
    run it (:func:`run_as_a_node`); ``logs`` holds the pod logs of Jobs that
    ran elsewhere (an emitted Job, applied and run).
    """

    def __init__(self, engine: Engine, image_id: str, folder: Path) -> None:
        self.engine, self.image_id, self.folder = engine, image_id, folder
        self.config_maps: dict[str, dict[str, Any]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.logs: dict[str, str] = {}
        self.pods: dict[str, dict[str, Any]] = {}  # pod specs of Jobs that ran elsewhere (their emitted template)
        cluster = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def answer(self, code: int, body: object, kind: str = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
                doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                store = cluster.config_maps if self.path.endswith("/configmaps") else cluster.jobs
                store[doc["metadata"]["name"]] = doc
                self.answer(201, doc)

            def do_GET(self) -> None:  # noqa: N802
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[-1] == "status":  # /apis/batch/v1/namespaces/NS/jobs/NAME/status
                    name = parts[-2]
                    if name in cluster.jobs and name not in cluster.logs:
                        cluster.logs[name] = run_as_a_node(cluster.engine, [cluster.config_maps[name],
                                                                            cluster.jobs[name]],
                                                           cluster.image_id, cluster.folder / name, {})
                    if name not in cluster.logs:
                        return self.answer(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    return self.answer(200, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
                                             "status": {"succeeded": 1}})
                if parts[-1] == "pods":  # /api/v1/namespaces/NS/pods?labelSelector=job-name=NAME
                    name = urllib.parse.parse_qs(self.path.partition("?")[2])["labelSelector"][0].split("=")[1]
                    spec = (cluster.jobs.get(name) or {}).get("spec", {}).get("template", {}).get("spec") or \
                        cluster.pods.get(name)
                    return self.answer(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {},
                                             "items": [{"metadata": {"name": f"{name}-pod"}, "spec": spec}]})
                if parts[-1] == "log":  # /api/v1/namespaces/NS/pods/POD/log
                    return self.answer(200, cluster.logs[parts[-2].removesuffix("-pod")], "text/plain")
                self.answer(404, {"kind": "Status", "code": 404})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeCluster:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path) -> Path:
        server = f"http://127.0.0.1:{self.server.server_address[1]}"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": server}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "users": [{"name": "u", "user": {"token": "t"}}]}))
        return path


@pytest.fixture
def in_podman(engine: Engine) -> Iterator[list[str]]:
    """Images copied into podman's store for a test (removed from it after)."""
    loaded: list[str] = []
    yield loaded
    for image_id in loaded:
        subprocess.run(["podman", "rmi", "--force", image_id], capture_output=True, check=False)


def _to_podman(ref: str, loaded: list[str], image_id: str) -> None:
    save = subprocess.Popen(["docker", "save", ref], stdout=subprocess.PIPE)
    done = subprocess.run(["podman", "load"], stdin=save.stdout, capture_output=True, text=True, timeout=600)
    assert save.wait() == 0 and done.returncode == 0, done.stderr
    loaded.append(image_id)


# -- 1. the key never reaches the image under test --------------------------------------------------------


@pytest.mark.parametrize("launcher", ["docker", pytest.param("podman", marks=needs_podman), "kubernetes"])
def test_an_image_that_searches_for_the_key_finds_none(engine: Engine, base_v0251: str, project: Path,
                                                       registry: RegistryPlace, in_podman: list[str],
                                                       unique: str, tmp_path: Path, launcher: str) -> None:
    # Its base's python3 searches every path as the runner starts: the patch set built over it by the tool, so
    # the image is its definition's product and the runner does start in it.
    product = Product(engine, base_v0251, project, f"hotfix-test/keysearch-{unique}",
                      "COPY python3 /usr/local/bin/python3", {"python3": KEY_SEARCH}, {"python3": 0o755})
    ref, hostile = product.ref, product.image_id
    key, pub, private = key_pair(tmp_path)
    pem = key.read_bytes()
    env_key = {"HOTFIX_SITE_KEY": pem.decode()}
    out, envelope = tmp_path / "report.json", tmp_path / "verdict.dsse.json"
    try:
        if launcher == "kubernetes":
            by_digest = _pushed(engine, ref, registry, f"keysearch-{unique}")
            job = tmp_path / "job.yaml"
            r = cli("smoke", by_digest, "--launcher", "kubernetes", "--gpu", "off", "--emit", str(job), root=project)
            assert r.rc == 0, r.err
            # The cluster holds the site's key in a Secret of the name the runbook once gave it, as key.pem.
            log = run_as_a_node(engine, job, hostile, tmp_path / "node", {"hotfix-sign-key": {"key.pem": pem}})
            assert "key-search: nothing found" in log, log
            (tmp_path / "pod.log").write_text(log)
            r = cli("smoke", by_digest, "--launcher", "kubernetes", "--gpu", "off", "--collect",
                    str(tmp_path / "pod.log"), "--sign-key", "env:HOTFIX_SITE_KEY", "--attestation", str(envelope),
                    "--report", str(out), root=project, env=env_key)
        else:
            if launcher == "podman":
                _to_podman(ref, in_podman, hostile)
            r = cli("smoke", ref, "--launcher", launcher, "--gpu", "off", "--sign-key", "env:HOTFIX_SITE_KEY",
                    "--attestation", str(envelope), "--report", str(out), root=project, env=env_key)
        assert "key-search: nothing found" in r.err and "key-search: FOUND" not in r.err, r.err
        if launcher == "kubernetes":
            # A saved log where no runner started says nothing that ties it to the Job (no report, no run nonce):
            # nothing is judged about the image, so nothing is signed.
            assert r.rc == 11 and "no run nonce" in r.last_error, r.err
            assert not envelope.exists()
            return
        # The image said nothing the host could judge: a failure, recorded and signed as one, here.
        assert r.rc == 7, r.err
        runner = _checks(_report(out))["runner"]
        assert runner["status"] == "fail" and "key-search: nothing found" in str(runner["detail"]), runner
        assert _independent(envelope.read_bytes(), private)["predicate"]["status"] == "fail"  # type: ignore[index]
        assert cli("verify", "--definition", "v0.25.1",
                   hostile, "--attestation", str(envelope), "--key", str(pub), root=project).rc == 24
    finally:
        product.drop()


# -- 2. the same checks, and a signed verdict that verifies, from every launcher ----------------------------


def test_every_launcher_runs_the_same_checks_and_signs_a_verdict_that_verifies(
        engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, in_podman: list[str],
        tmp_path: Path) -> None:
    project, ref, image_id = built
    key, pub, private = key_pair(tmp_path)
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    pushed = json.loads(r.out)
    reports: dict[str, dict[str, object]] = {}
    envelopes: dict[str, bytes] = {}
    launchers = ["docker", "podman", "kubernetes"] if PODMAN else ["docker", "kubernetes"]
    for launcher in launchers:
        out, envelope = tmp_path / f"{launcher}.json", tmp_path / f"{launcher}.dsse.json"
        signed = ["--sign-key", str(key), "--attestation", str(envelope), "--report", str(out)]
        if launcher == "kubernetes":
            job = tmp_path / "job.yaml"
            r = cli("smoke", pushed["ref"], "--launcher", "kubernetes", "--gpu", "off", "--emit", str(job),
                    root=project)
            assert r.rc == 0, r.err
            (tmp_path / "pod.log").write_text(run_as_a_node(engine, job, image_id, tmp_path / "node", {}))
            r = cli("smoke", pushed["ref"], "--launcher", "kubernetes", "--gpu", "off", "--collect",
                    str(tmp_path / "pod.log"), *signed, root=project)
        else:
            if launcher == "podman":
                _to_podman(ref, in_podman, image_id)
            r = cli("smoke", ref, "--launcher", launcher, "--gpu", "off", *signed, root=project)
        assert r.rc == 0, f"{launcher}: {r.err}"
        reports[launcher], envelopes[launcher] = _report(out), envelope.read_bytes()
    names = {launcher: _names(report) for launcher, report in reports.items()}
    assert "import-location" in names["docker"], names
    for launcher in launchers:
        assert names[launcher] == names["docker"], (launcher, names)
        checks = _checks(reports[launcher])
        assert checks["import-location"]["status"] == "pass", (launcher, checks["import-location"])
        assert checks["patch-landed"]["data"]["answered_by"] == "filesystem"  # type: ignore[index]
        # Signed here: `verify` and an independent DSSE implementation both accept it.
        doc = _independent(envelopes[launcher], private)
        assert doc["predicate"]["status"] == "pass" and doc["predicate"]["signed_at"]  # type: ignore[index]
        assert image_id.removeprefix("sha256:") in [s["digest"]["sha256"] for s in doc["subject"]]  # type: ignore
        r = cli("verify", "--definition", "v0.25.1",
                image_id, "--attestation", str(tmp_path / f"{launcher}.dsse.json"), "--key", str(pub),
                "--allow-gpu-unverified", root=project)
        assert r.rc == 0 and f"signed pass by key {pub}" in r.out, (launcher, r.err)
    # The Job's verdict was attached beside the image by the host that collected it, and reads back.
    r = cli("verify", "--definition", "v0.25.1",
            pushed["ref"], "--key", str(pub), "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0 and json.loads(r.out)["key"] == str(pub), r.err


def test_a_job_submitted_or_collected_through_the_clusters_api_is_judged_and_signed_here(
        engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path) -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes extra is not installed")
    project, ref, image_id = built
    key, pub, private = key_pair(tmp_path)
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    target = json.loads(r.out)["ref"]
    with FakeCluster(engine, image_id, tmp_path / "nodes") as cluster:
        config = cluster.kubeconfig(tmp_path / "kubeconfig")
        out, envelope = tmp_path / "submitted.json", tmp_path / "submitted.dsse.json"
        r = cli("smoke", target, "--launcher", "kubernetes", "--gpu", "off", "--submit", "--kubeconfig", str(config),
                "--sign-key", str(key), "--attestation", str(envelope), "--report", str(out), root=project)
        assert r.rc == 0, r.err
        [name] = cluster.jobs
        pod = cluster.jobs[name]["spec"]["template"]["spec"]
        assert [v["name"] for v in pod["volumes"]] == ["runner"]  # what was submitted holds no key either
        assert _checks(_report(out))["import-location"]["status"] == "pass"
        assert _independent(envelope.read_bytes(), private)["predicate"]["status"] == "pass"  # type: ignore[index]
        # An emitted Job, applied and run elsewhere: its report read through the API once it has ended.
        job = tmp_path / "job.yaml"
        r = cli("smoke", target, "--launcher", "kubernetes", "--gpu", "off", "--emit", str(job), root=project)
        assert r.rc == 0, r.err
        emitted = json.loads(job.read_text().split("---\n")[2])["metadata"]["name"]
        assert f"--collect job/{emitted}" in r.out
        cluster.logs[emitted] = run_as_a_node(engine, job, image_id, tmp_path / "elsewhere", {})
        cluster.pods[emitted] = json.loads(job.read_text().split("---\n")[2])["spec"]["template"]["spec"]
        envelope = tmp_path / "collected.dsse.json"
        r = cli("smoke", target, "--launcher", "kubernetes", "--gpu", "off", "--collect", f"job/{emitted}",
                "--kubeconfig", str(config), "--sign-key", str(key), "--attestation", str(envelope), root=project)
        assert r.rc == 0, r.err
        assert _independent(envelope.read_bytes(), private)["predicate"]["status"] == "pass"  # type: ignore[index]
    # Both signed verdicts were attached beside the image by this host, and `verify` reads them back.
    r = cli("verify", "--definition", "v0.25.1", target, "--key", str(pub), "--allow-gpu-unverified", root=project)
    assert r.rc == 0 and f"signed pass by key {pub}" in r.out, r.err


# -- 3. the host's own facts decide -----------------------------------------------------------------------


def test_an_unpatched_base_wearing_the_patched_labels_fails_and_gets_no_passing_signature(
        engine: Engine, built: tuple[Path, str, str], base_v0251: str, unique: str, tmp_path: Path) -> None:
    project, _ref, image_id = built
    info = engine.image(image_id)
    assert info is not None
    ref = f"hotfix-test/wearing-labels-{unique}:x"
    labels = " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(info.labels.items()))
    derive(engine, base_v0251, ref, f"COPY liar.py /usr/local/lib/liar.py\nCOPY python3 /usr/local/bin/python3\n"
                                    f"LABEL {labels}", {"liar.py": LIAR, "python3": LIAR_PY}, {"python3": 0o755})
    key, pub, private = key_pair(tmp_path)
    out, envelope = tmp_path / "report.json", tmp_path / "verdict.dsse.json"
    try:
        r = cli("smoke", ref, "--sign-key", str(key), "--attestation", str(envelope), "--report", str(out),
                root=project)
        # The base's layers and two of its own under the patched image's labels: refused before its Python ran.
        assert r.rc == 14, r.err
        report = _report(out)
        checks = _checks(report)
        assert report["status"] == "fail" and list(checks) == ["layer-identity"], checks
        assert checks["layer-identity"]["data"]["answered_by"] == "filesystem"  # type: ignore[index]
        assert report["gpu_verified"] is False
        doc = _independent(envelope.read_bytes(), private)
        assert doc["predicate"]["status"] == "fail"  # type: ignore[index]
        hostile = str(report["image_id"])
        r = cli("verify", "--definition", "v0.25.1",
                hostile, "--attestation", str(envelope), "--key", str(pub), "--allow-gpu-unverified",
                root=project)
        assert r.rc == 24 and "'fail', not a pass: layer-identity" in r.last_error, r.err
        # What the image could sign itself, it signs with a key of its own: refused.
        _k, _p, own = key_pair(tmp_path, "image-own")
        forged = tmp_path / "forged.dsse.json"
        forged.write_bytes(signing.sign(signing.statement({ref: hostile}, signing.predicate(
            {**doc["predicate"], "status": "pass", "gpu_verified": True}, {}, signing.now())), own))  # type: ignore
        r = cli("verify", "--definition", "v0.25.1",
                hostile, "--attestation", str(forged), "--key", str(pub), root=project)
        assert r.rc == 22 and "signed with another key" in r.err
    finally:
        engine.remove_image(ref)


def test_a_python_that_claims_gpu_checks_on_a_host_without_a_gpu_is_refused(
        engine: Engine, base_v0251: str, project: Path, unique: str, tmp_path: Path) -> None:
    from vllm_hotfix.journal import records

    # The lying Python is its base's: the image is its definition's product, so the runner starts in it.
    product = Product(engine, base_v0251, project, f"hotfix-test/claims-gpu-{unique}",
                      "COPY liar.py /usr/local/lib/liar.py\nCOPY python3 /usr/local/bin/python3",
                      {"liar.py": LIAR, "python3": LIAR_PY}, {"python3": 0o755})
    ref, hostile = product.ref, product.image_id
    key, pub, private = key_pair(tmp_path)
    out, envelope = tmp_path / "report.json", tmp_path / "verdict.dsse.json"
    try:
        r = cli("smoke", ref, "--sign-key", str(key), "--attestation", str(envelope), "--report", str(out),
                root=project)
        assert r.rc == 7 and "gpu-claim" in r.last_error, r.err
        report = _report(out)
        claim = _checks(report)["gpu-claim"]
        assert claim["status"] == "fail" and "NVIDIA H200" in str(claim["detail"]) and "gave no GPU" in str(
            claim["detail"])
        [entry] = records.verdicts(project, hostile)
        assert entry.verdict.gpu_verified is False and entry.verdict.gpu.get("devices") == []
        assert _independent(envelope.read_bytes(), private)["predicate"]["status"] == "fail"  # type: ignore[index]
        r = cli("verify", "--definition", "v0.25.1",
                hostile, "--attestation", str(envelope), "--key", str(pub), "--allow-gpu-unverified",
                root=project)
        assert r.rc == 24, r.err
    finally:
        product.drop()


# -- 4. the newest signed verdict decides ---------------------------------------------------------------


def test_an_older_signed_pass_and_a_newer_signed_fail_are_refused_everywhere(
        engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path) -> None:
    project, ref, image_id = built
    key, pub, private = key_pair(tmp_path)
    older = tmp_path / "older.dsse.json"
    r = cli("smoke", ref, "--gpu", "off", "--sign-key", str(key), "--attestation", str(older), root=project)
    assert r.rc == 0, r.err
    # A later run on the same image failed (say, its GPU checks on a GPU host), signed there with the same key.
    failed = judge(ref, image_id, [Check("gpu-torch", Status.FAIL, "CUDA error")], gpu_verified=False)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    envelope = signing.sign(signing.statement({ref: image_id}, {**failed.to_dict(), "signed_at": now}), private)
    kept = attest.folder(project, image_id) / f"{hashlib.sha256(envelope).hexdigest()}.dsse.json"
    kept.write_bytes(envelope)  # kept in the journal folder, as smoke keeps what it signs
    r = cli("push", "--definition", "v0.25.1",
            ref, "--registry", f"{registry.place}/ops", "--require-attestation", str(pub),
            "--attestation", str(older), "--allow-gpu-unverified", root=project)
    assert r.rc == 24, r.err
    assert kept.name in r.last_error and str(older) in r.last_error and "does not count" in r.last_error
    # Pushed on the journal's word, both travel beside the image; `verify` judges them by the same rule.
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    pushed = json.loads(r.out)
    assert len(pushed["attestations"]) == 2
    r = cli("verify", "--definition", "v0.25.1",
            pushed["ref"], "--key", str(pub), "--allow-gpu-unverified", root=project)
    assert r.rc == 24 and "'fail', not a pass" in r.last_error and "older signed pass" in r.last_error, r.err


# -- 5. a pushed tag resolves through the registry ---------------------------------------------------------


def test_a_pushed_tag_the_engine_has_no_digest_for_resolves_through_the_registry(
        engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path) -> None:
    project, ref, image_id = built
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    pushed = json.loads(r.out)
    for name in (pushed["ref"], ref):
        job = tmp_path / f"{hashlib.sha256(name.encode()).hexdigest()[:8]}.yaml"
        r = cli("smoke", name, "--launcher", "kubernetes", "--emit", str(job), root=project)
        assert r.rc == 0, r.err
        spec = json.loads(job.read_text().split("---\n")[2])
        started = spec["spec"]["template"]["spec"]["containers"][0]["image"]
        if name == pushed["ref"]:
            assert started == f"{pushed['ref'].rpartition(':')[0]}@{pushed['digest']}", (name, started)
        assert "@sha256:" in started, started
        config_map = json.loads(job.read_text().split("---\n")[1])
        assert json.loads(config_map["data"]["job.json"])["image_id"] == image_id


def test_a_log_that_is_not_the_jobs_is_incomplete_and_nothing_is_signed_or_attached(
        engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path) -> None:
    """--collect of a file holding no report and no run nonce (kubectl's own error saved by mistake) says nothing
    about the image: incomplete, nothing signed, nothing beside the image; the Job's own log cut short after its
    runner started (it said the nonce, then no report) is the image's failure, signed as one."""
    project, ref, image_id = built
    key, pub, _private = key_pair(tmp_path)
    by_digest = _pushed(engine, ref, registry, "wronglog")
    job = tmp_path / "job.yaml"
    r = cli("smoke", by_digest, "--launcher", "kubernetes", "--gpu", "off", "--emit", str(job), root=project)
    assert r.rc == 0, r.err
    wrong = tmp_path / "kubectl-error.log"
    wrong.write_text("error: You must be logged in to the server (Unauthorized)\n")
    envelope = tmp_path / "wrong.dsse.json"
    r = cli("smoke", by_digest, "--launcher", "kubernetes", "--gpu", "off", "--collect", str(wrong),
            "--sign-key", str(key), "--attestation", str(envelope), root=project)
    assert r.rc == 11, r.err
    assert f"--collect {wrong}: no runner report and no run nonce" in r.last_error, r.err
    assert "signed verdict" not in r.err and not envelope.exists()
    r = cli("verify", "--definition", "v0.25.1", by_digest, "--key", str(pub), "--allow-gpu-unverified", root=project)
    assert r.rc == 21, r.err  # nothing was attached beside the image
    # The Job's own log, its runner stopped after it started: no report, but the Job's nonce.
    log = run_as_a_node(engine, job, image_id, tmp_path / "node", {})
    said = [ln for ln in log.splitlines() if ln.startswith("@@vllm-hotfix-runner:run_nonce@@ ")]
    assert len(said) == 1, log
    cut = tmp_path / "cut.log"
    cut.write_text("\n".join(ln for ln in log.splitlines() if not ln.startswith("@@vllm-hotfix-runner:report@@")))
    r = cli("smoke", by_digest, "--launcher", "kubernetes", "--gpu", "off", "--collect", str(cut),
            "--sign-key", str(key), "--attestation", str(envelope), root=project)
    assert r.rc == 7 and "the runner gave no report" in r.err, r.err
    assert envelope.exists()


# -- 5. every verdict beside the image in its registry ----------------------------------------------------


def test_a_signed_fail_after_a_pushed_pass_reaches_the_registry_and_verify_elsewhere_says_fail(
        engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path) -> None:
    """smoke attaches its signed verdict, pass or fail, beside every registry copy of the image this host knows:
    a later fail, signed on this host, is what `verify REF` on a host with another journal reads as the newest."""
    project, ref, image_id = built
    key, pub, _private = key_pair(tmp_path)
    r = cli("smoke", ref, "--gpu", "off", "--sign-key", str(key), root=project)
    assert r.rc == 0, r.err
    r = cli("push", "--definition", "v0.25.1",
            ref, "--registry", f"{registry.place}/ops", "--require-attestation", str(pub),
            "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    pushed = json.loads(r.out)
    elsewhere = tmp_path / "elsewhere"
    for folder in ("images", "patches"):  # the same definitions, another journal (none)
        shutil.copytree(project / folder, elsewhere / folder)
    r = cli("verify", "--definition", "v0.25.1",
            pushed["ref"], "--key", str(pub), "--allow-gpu-unverified", root=elsewhere)
    assert r.rc == 0, r.err
    # Later, the same image judged again and failing (here: against the SM100 variant, whose pins it lacks).
    r = cli("smoke", ref, "--gpu", "off", "--definition", "v0.25.1-sm100", "--sign-key", str(key), root=project)
    assert r.rc == 14, r.err
    assert f"signed verdict attached to {pushed['ref'].rsplit(':', 1)[0]}@{pushed['digest']}" in r.err, r.err
    # Elsewhere, verify reads that fail as the newest of what it was judged against (the SM100 definition); a fail
    # judged against another definition says nothing of the v0.25.1 image's own pass.
    r = cli("verify", "--definition", "v0.25.1-sm100",
            pushed["ref"], "--key", str(pub), "--allow-gpu-unverified", root=elsewhere)
    assert r.rc == 24 and "v0.25.1-sm100" in r.last_error, r.err
    r = cli("verify", "--definition", "v0.25.1",
            pushed["ref"], "--key", str(pub), "--allow-gpu-unverified", root=elsewhere)
    assert r.rc == 0, r.err


def test_a_jobs_log_is_judged_only_as_the_run_this_host_made_and_at_that_runs_time(
        engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path) -> None:
    """--emit and --submit give the Job a nonce of its own and journal it; --collect refuses a log without it or
    with another (a foreign host's Job, another image's), and a pod that ran another image; a log collected late
    is as new as its run, never newer than a fail signed after that run."""
    project, ref, image_id = built
    key, pub, _private = key_pair(tmp_path)
    by_digest = _pushed(engine, ref, registry, "noncejob")
    job = tmp_path / "job.yaml"
    r = cli("smoke", by_digest, "--launcher", "kubernetes", "--gpu", "off", "--emit", str(job), root=project)
    assert r.rc == 0, r.err
    log = run_as_a_node(engine, job, image_id, tmp_path / "node", {})
    (tmp_path / "pod.log").write_text(log)
    # Another host's journal never emitted it: refused, nothing signed.
    elsewhere = tmp_path / "elsewhere"
    for folder in ("images", "patches"):
        shutil.copytree(project / folder, elsewhere / folder)
    r = cli("smoke", by_digest, "--launcher", "kubernetes", "--gpu", "off", "--collect", str(tmp_path / "pod.log"),
            "--sign-key", str(key), root=elsewhere)
    assert r.rc == 13 and "which no Job this host made for" in r.last_error, r.err
    # A log without a nonce (a runner started by hand, an older tool's Job): refused.
    bare = "\n".join(ln for ln in log.splitlines() if "run_nonce" not in ln)
    marked = [ln for ln in log.splitlines() if ln.startswith("@@vllm-hotfix-runner:report@@")]
    report = json.loads(base64.b64decode(marked[-1].split()[1]))
    report["environment"].pop("run_nonce")
    forged = "@@vllm-hotfix-runner:report@@ " + base64.b64encode(json.dumps(report).encode()).decode()
    (tmp_path / "bare.log").write_text(bare.replace(marked[-1], forged))
    r = cli("smoke", by_digest, "--launcher", "kubernetes", "--gpu", "off", "--collect", str(tmp_path / "bare.log"),
            root=project)
    assert r.rc == 13 and "carries no run nonce" in r.last_error, r.err
    # After the run, a newer fail is signed (beside the pushed copy); collecting the earlier run's passing log now
    # does not outrank it.
    r = cli("smoke", by_digest, "--gpu", "off", "--definition", "v0.25.1-sm100", "--sign-key", str(key),
            root=project)
    assert r.rc == 14 and f"signed verdict attached to {by_digest}" in r.err, r.err
    envelope = tmp_path / "late.dsse.json"
    r = cli("smoke", by_digest, "--launcher", "kubernetes", "--gpu", "off", "--collect", str(tmp_path / "pod.log"),
            "--sign-key", str(key), "--attestation", str(envelope), root=project)
    assert r.rc == 0, r.err
    predicate = json.loads(base64.b64decode(json.loads(envelope.read_text())["payload"]))["predicate"]
    assert predicate["run_at"] < predicate["signed_at"]
    r = cli("verify", "--definition", "v0.25.1-sm100",
            by_digest.rsplit("@", 1)[0] + ":x", "--key", str(pub), "--allow-gpu-unverified", root=project)
    assert r.rc == 24 and "v0.25.1-sm100" in r.last_error, r.err
