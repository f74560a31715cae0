"""The emitted Job and ConfigMap, loaded into the official client's own models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli, site_key, unreachable_kubeconfig
from vllm_hotfix.checking.launchers import kubernetes as k8s
from vllm_hotfix.errors import UsageError
from vllm_hotfix.inimage.runner import MOUNT

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes extra is not installed")

IMAGE = "registry.example/ops/vllm-openai@sha256:" + "ef" * 32


def _load(doc: dict[str, object], kind: str) -> object:
    """As the client reads an API server's answer: strict about every field's name and type."""
    return kubernetes.client.ApiClient().deserialize(json.dumps(doc), kind, "application/json")


def test_emitted_job_is_accepted_by_the_client_models() -> None:
    spec = k8s.JobSpec("vllm-hotfix-smoke-abc", namespace="gpu", gpus=8,
                       node_selector=k8s.parse_selector("nvidia.com/gpu.product=NVIDIA-H200"), deadline_s=5400)
    text = k8s.to_yaml(k8s.manifests(IMAGE, spec, {"image": "x", "gpu": {"mode": "require"}},
                                     {"checks/gpu_topk_layout.py": b"print('{}')\n"}))
    yaml = pytest.importorskip("yaml")
    config_map_doc, job_doc = list(yaml.safe_load_all(text))
    config_map = _load(config_map_doc, "V1ConfigMap")
    job = _load(job_doc, "V1Job")
    assert isinstance(job, kubernetes.client.V1Job) and isinstance(config_map, kubernetes.client.V1ConfigMap)
    assert job.spec.backoff_limit == 0 and job.spec.active_deadline_seconds == 5400
    pod = job.spec.template.spec
    assert pod.restart_policy == "Never"
    assert pod.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    [container] = pod.containers
    assert container.image == IMAGE and container.resources.limits == {"nvidia.com/gpu": "8"}
    assert container.command == ["python3", "-I", "-S", f"{MOUNT}/run.py", f"{MOUNT}/job.json"]  # isolated
    mounts = {m.name: m for m in container.volume_mounts}
    assert mounts["runner"].read_only and mounts["runner"].mount_path == MOUNT
    volumes = {v.name: v for v in pod.volumes}
    # No key of any kind: no Secret, no other mount, no environment but the runner's own.
    assert set(volumes) == {"runner"} and set(mounts) == {"runner"}
    assert [e.name for e in container.env] == ["PYTHONDONTWRITEBYTECODE"] and not container.env_from
    assert "PRIVATE KEY" not in text and "secret" not in text.lower()
    paths = {item.path for item in volumes["runner"].config_map.items}
    assert {"run.py", "job.json", "vllm_hotfix/inimage/runner/main.py", "probes/gpu_check.py",
            "checks/gpu_topk_layout.py"} <= paths
    assert set(config_map.data) == {item.key for item in volumes["runner"].config_map.items}
    assert json.loads(config_map.data["job.json"])["gpu"]["mode"] == "require"


def test_a_cluster_needs_the_image_by_digest_and_a_selector_is_key_value() -> None:
    with pytest.raises(UsageError, match="by digest"):
        k8s.manifests("ops/vllm:fix", k8s.JobSpec("x"), {}, {})
    with pytest.raises(UsageError, match="expected KEY=VALUE"):
        k8s.parse_selector("nvidia.com/gpu.product")


def test_emit_without_an_engine_writes_no_job(tmp_path: Path) -> None:
    """Without an engine the registry's copy cannot be read (the engine knows how to reach it), and a Job judged
    without the image's files cannot pass: nothing is written (was: a Job that could not pass, exit 0). The
    Job's shape is tested above on the manifests and in tests/engine/test_registry_files.py through the CLI."""
    out = tmp_path / "job.yaml"
    r = cli("smoke", IMAGE, "--launcher", "kubernetes", "--node-selector", "nvidia.com/gpu.product=NVIDIA-H200",
            "--emit", str(out), root=tmp_path)
    assert r.rc == 5 and "nonexistent/docker.sock" in r.last_error, r.err
    assert not out.exists() and not (tmp_path / "build/records/job").exists()


def test_an_emitted_job_is_signed_when_its_report_is_collected_not_before(tmp_path: Path) -> None:
    key = tmp_path / "site.key"
    key.write_text("not used")
    key.chmod(0o600)
    out = tmp_path / "job.yaml"
    r = cli("smoke", IMAGE, "--launcher", "kubernetes", "--sign-key", str(key), "--emit", str(out), root=tmp_path)
    assert r.rc == 64 and "holds no key" in r.last_error and "--collect" in r.last_error, r.err
    assert not out.exists()
    r = cli("smoke", IMAGE, "--launcher", "kubernetes", "--sign-secret", "hotfix-sign-key", "--emit", str(out),
            root=tmp_path)
    assert r.rc != 0 and "--sign-secret" in r.err and not out.exists()


def test_collect_from_an_unreachable_cluster_is_one_line(tmp_path: Path) -> None:
    kubeconfig = unreachable_kubeconfig(tmp_path / "config")
    key = tmp_path / "site.key"
    site_key(key)
    # Collecting a Job needs no new one written (submitting one: tests/engine/test_registry_files.py).
    r = cli("smoke", IMAGE, "--launcher", "kubernetes", "--collect", "job/vllm-hotfix-smoke-gone", "--kubeconfig",
            str(kubeconfig), "--sign-key", str(key), root=tmp_path, timeout=120)
    assert r.rc == 11 and "cannot reach the Kubernetes API server" in r.last_error, r.err
    assert not list((tmp_path / "build").rglob("*.dsse.json"))  # nothing judged, nothing signed


def test_a_runner_too_big_for_a_config_map_is_refused_before_anything_is_written() -> None:
    huge = {"checks/big.py": b"#" * (k8s.CONFIGMAP_LIMIT + 1)}
    with pytest.raises(UsageError, match="over the 1048576 bytes a ConfigMap may hold"):
        k8s.manifests(IMAGE, k8s.JobSpec("x"), {}, huge)


def test_a_job_serves_no_model_of_this_host(tmp_path: Path) -> None:
    out = tmp_path / "job.yaml"
    r = cli("smoke", IMAGE, "--launcher", "kubernetes", "--serve-model", str(tmp_path), "--emit", str(out),
            root=tmp_path)
    assert r.rc == 64 and "the model folder is not on the cluster" in r.last_error, r.err
    assert not out.exists()


@pytest.mark.parametrize(("args", "needle"), [
    (("--launcher", "kubernetes", "--emit", "J", "--node-selector", "nvidia.com/gpu.product=NVIDIA-H200\nx=y"),
     "is not a label value"),
    (("--launcher", "kubernetes", "--emit", "J", "--node-selector", "-bad/key=v"), "is not a label key"),
    (("--launcher", "kubernetes", "--emit", "J", "--namespace", "gpu nodes"), "not a namespace"),
    (("--launcher", "kubernetes", "--emit", "J", "--namespace", "a.b"), "not a namespace"),
    (("--gpus", "2",), "--gpus: is an option of --launcher kubernetes, not docker"),
    (("--launcher", "podman", "--namespace", "gpu"), "--namespace: is an option of --launcher kubernetes"),
])
def test_job_options_kubernetes_would_refuse_are_refused_first(tmp_path: Path, args: tuple[str, ...],
                                                               needle: str) -> None:
    """Accepted without a word before: a selector with a newline, names the API server refuses, --gpus 2 with
    the docker launcher (which asks for GPUs its own way)."""
    argv = [str(tmp_path / "job.yaml") if a == "J" else a for a in args]
    r = cli("smoke", IMAGE, *argv, root=tmp_path)
    assert r.rc == 64, r.err
    assert needle in r.last_error and "\n" not in r.last_error.replace("\\n", "")
    assert not (tmp_path / "job.yaml").exists()


def test_submit_with_a_kubeconfig_that_is_not_yaml_is_one_line(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("clusters: [unclosed\n  - {: : }\n")
    r = cli("smoke", IMAGE, "--launcher", "kubernetes", "--submit", "--kubeconfig", str(kubeconfig), root=tmp_path)
    assert r.rc == 64, r.err
    assert f"kubeconfig {kubeconfig}: not a usable kubeconfig" in r.last_error


def test_an_api_server_that_never_answers_ends_the_run_incomplete(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that accepts the connection and never answers: each API call has a time limit, so the run ends
    incomplete (the host's shortcoming) instead of waiting for ever."""
    import socket
    import time

    from vllm_hotfix.checking.launchers import kubernetes as k8s
    from vllm_hotfix.errors import SmokeIncomplete

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections are accepted by the kernel; nothing reads or answers them
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{silent.getsockname()[1]}"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
        }))
        monkeypatch.setattr(k8s, "API_TIMEOUT", (0.25, 0.25))
        start = time.monotonic()
        with pytest.raises(SmokeIncomplete, match="cannot reach the Kubernetes API server"):
            k8s.KubernetesLauncher(k8s.JobSpec("vllm-hotfix-smoke-x"), str(kubeconfig)).collect()
        assert time.monotonic() - start < 30


def test_the_schema_check_finds_what_the_client_would_drop() -> None:
    """Without the walk, the client's models take a misspelt field silently (the pod would run without its
    pull credentials) and a number where the API wants a string."""
    from k8s_schema import SchemaError, validate

    job = k8s.manifests(IMAGE, k8s.JobSpec("x", pull_secrets=("reg",)), {}, {})[1]
    validate(job, "V1Job")
    pod = job["spec"]["template"]["spec"]
    pod["imagePullSecret"] = pod.pop("imagePullSecrets")
    with pytest.raises(SchemaError, match="V1PodSpec has no field 'imagePullSecret'"):
        validate(job, "V1Job")
    pod["imagePullSecrets"] = pod.pop("imagePullSecret")
    pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 1
    with pytest.raises(SchemaError, match="limits.nvidia.com/gpu: expected str"):
        validate(job, "V1Job")


@pytest.mark.parametrize(("args", "needle"), [
    (("--pull-secret", "Internal_Registry"), "--pull-secret 'Internal_Registry': not a Secret's name"),
    (("--service-account", "ml ops"), "--service-account 'ml ops': not a service account's name"),
    (("--toleration", "nvidia.com/gpu:Sometimes"), "effect 'Sometimes'"),
    (("--toleration", "gpu=yes:"), "an effect after the colon"),
    (("--resource", "cpu=8"), "expected requests.NAME=QUANTITY"),
    (("--resource", "requests.nvidia.com/gpu=2"), "the GPUs are the Job's gpus (--gpus)"),
])
def test_job_names_and_amounts_the_api_would_refuse_are_refused_first(tmp_path: Path, args: tuple[str, ...],
                                                                      needle: str) -> None:
    out = tmp_path / "job.yaml"
    r = cli("smoke", IMAGE, "--launcher", "kubernetes", "--emit", str(out), *args, root=tmp_path)
    assert r.rc == 64 and needle in r.last_error, r.err
    assert not out.exists()


def test_the_new_job_options_are_refused_for_another_launcher(tmp_path: Path) -> None:
    r = cli("smoke", IMAGE, "--pull-secret", "reg", "--service-account", "sa", root=tmp_path)
    assert r.rc == 64, r.err
    assert "--service-account, --pull-secret: are options of --launcher kubernetes, not docker" in r.last_error
