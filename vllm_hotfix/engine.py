"""The one seam to the container engine.

Nothing else in the package imports ``docker`` or talks to the engine. Every
container this module starts is removed before the call that started it
returns, whatever happens.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import re
import socket
import tarfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import docker
import docker.auth
import docker.errors
import docker.utils
import requests.exceptions
import urllib3.exceptions

from .errors import BaseImageError, BuildError, EngineError, EngineLost, PipelineError, PushError

log = logging.getLogger(__name__)

PULL_POLICIES = ("missing", "always", "never")
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class ImageInfo:
    """What the pipeline needs to know about an image in the engine."""

    id: str
    tags: tuple[str, ...]
    repo_digests: tuple[str, ...]
    entrypoint: tuple[str, ...] | None
    cmd: tuple[str, ...] | None
    env: tuple[str, ...]
    user: str
    labels: Mapping[str, str] = field(default_factory=dict)
    size: int = 0

    @property
    def digest(self) -> str | None:
        """The registry digest (``name@sha256:...``) if the image has one."""
        return self.repo_digests[0] if self.repo_digests else None


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str


def _tuple(value: Sequence[str] | None) -> tuple[str, ...] | None:
    return tuple(value) if value is not None else None


def _image_info(image: Any) -> ImageInfo:
    attrs = image.attrs
    config = attrs.get("Config") or {}
    return ImageInfo(
        id=attrs["Id"],
        tags=tuple(attrs.get("RepoTags") or ()),
        repo_digests=tuple(attrs.get("RepoDigests") or ()),
        entrypoint=_tuple(config.get("Entrypoint")),
        cmd=_tuple(config.get("Cmd")),
        env=tuple(config.get("Env") or ()),
        user=config.get("User") or "",
        labels=dict(config.get("Labels") or {}),
        size=int(attrs.get("Size") or 0),
    )


def split_reference(ref: str) -> tuple[str, str]:
    """Split ``repo[:tag]`` or ``repo@sha256:...`` into repository and tag or digest.

    docker-py's own parser, so the tool and the SDK never disagree; the tag
    defaults to ``latest`` as the engine's does.
    """
    repo, tag = docker.utils.parse_repository_tag(ref)
    return repo, tag or "latest"


def registry_of(ref: str) -> str:
    """The registry host a reference names (``docker.io`` for Docker Hub names)."""
    host, _ = docker.auth.resolve_repository_name(split_reference(ref)[0])
    return "docker.io" if host == docker.auth.INDEX_NAME else host


# Errors the SDK raises when the engine goes away under a call in flight.
_LOST = (requests.exceptions.ConnectionError, urllib3.exceptions.ProtocolError)
_AUTH_WORDS = ("no basic auth credentials", "unauthorized", "authentication required", "denied",
               "incorrect username or password")


def lost(what: str, exc: BaseException) -> EngineLost:
    return EngineLost(
        f"{what}: the Docker engine stopped answering ({_short(exc)})",
        hint="check the engine (docker version); containers and images this run left are removed "
             "by the next run once it answers",
    )


def auth_refused(message: str) -> bool:
    low = message.lower()
    return any(word in low for word in _AUTH_WORDS)


F = TypeVar("F", bound=Callable[..., Any])


def _guard(what: str) -> Callable[[F], F]:
    """Map every SDK or transport error of a call into the tool's error tree.

    ``what`` may name the call's first argument as ``{0}``.
    """

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except PipelineError:
                raise
            except _LOST as exc:
                raise lost(what.format(*args), exc) from exc
            except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
                raise EngineError(f"{what.format(*args)}: {_short(exc)}") from exc

        return wrapper  # type: ignore[return-value]

    return deco


class Box:
    """A running throw-away container to read from, write to and exec in."""

    def __init__(self, container: Any) -> None:
        self._container = container

    @_guard("running a probe in a container")
    def exec(
        self, cmd: Sequence[str], *, user: str = "0", timeout: int = 120
    ) -> ExecResult:
        # exec_run has no timeout of its own: wrap the command in one when
        # `timeout` exists in the image, which every Debian-based image has.
        full = ["timeout", str(timeout), *cmd]
        result = self._container.exec_run(full, user=user, demux=True)
        out, err = result.output
        stderr = (err or b"").decode("utf-8", "replace")
        if result.exit_code == 124:
            stderr += f"\ntimed out after {timeout} s"
        return ExecResult(result.exit_code, (out or b"").decode("utf-8", "replace"), stderr)

    @_guard("copying files into a container")
    def write(self, folder: str, files: Mapping[str, bytes]) -> None:
        """Put files (relative path -> bytes) under ``folder``."""
        self._container.put_archive(folder, tar_bytes(files))


def tar_bytes(
    files: Mapping[str, bytes], modes: Mapping[str, int] | None = None
) -> bytes:
    """A deterministic tar: sorted names, root-owned, fixed mtime."""
    modes = modes or {}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for name in sorted(files):
            parts = name.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type = tarfile.DIRTYPE
                    info.mode = 0o755
                    info.mtime = 0
                    tar.addfile(info)
            info = tarfile.TarInfo(name)
            info.size = len(files[name])
            info.mode = modes.get(name, 0o644)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(files[name]))
    return buf.getvalue()


class Engine:
    """A connection to one Docker engine."""

    def __init__(self, client: Any) -> None:
        self._client = client

    @classmethod
    def connect(cls, timeout: int = 120, base_url: str | None = None) -> Engine:
        """Connect through ``base_url``, else DOCKER_HOST (or the default socket), and ping."""
        try:
            if base_url is not None:
                client = docker.DockerClient(base_url=base_url, timeout=timeout)
            else:
                client = docker.from_env(timeout=timeout)
            client.ping()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            raise EngineError(
                f"no Docker engine answers ({_short(exc)})",
                hint="start one (make services), or point DOCKER_HOST at a running engine",
            ) from exc
        return cls(client)

    @property
    def address(self) -> str:
        return str(getattr(self._client.api, "base_url", ""))

    @property
    def is_local(self) -> bool:
        """Whether the engine runs on this machine, so its host-network builds reach our loopback."""
        url = self.address
        if url.startswith("http+docker://"):
            # The SDK's name for a local socket or pipe; "ssh" is a remote machine.
            return not url.endswith("://ssh")
        from urllib.parse import urlparse

        return urlparse(url).hostname in ("localhost", "127.0.0.1", "::1")

    # -- images ------------------------------------------------------------

    @_guard("inspecting image {0}")
    def image(self, ref: str) -> ImageInfo | None:
        try:
            return _image_info(self._client.images.get(ref))
        except docker.errors.ImageNotFound:
            return None
        except docker.errors.APIError as exc:
            raise EngineError(f"engine refused to inspect {ref}: {_short(exc)}") from exc

    def resolve(
        self,
        ref: str,
        policy: str = "missing",
        progress: Callable[[str], None] | None = None,
    ) -> ImageInfo:
        """Find ``ref`` in the engine, pulling only as ``policy`` says."""
        if policy not in PULL_POLICIES:
            raise BaseImageError(f"unknown pull policy {policy!r}")
        local = self.image(ref)
        if local is not None and policy != "always":
            return local
        if policy == "never":
            raise BaseImageError(
                f"base image {ref} is not in the engine and --pull never forbids pulling",
                hint=f"load it (docker pull/load {ref}) or use --pull missing",
            )
        self.pull(ref, progress)
        pulled = self.image(ref)
        if pulled is None:
            raise BaseImageError(f"pulled {ref} but the engine does not list it")
        return pulled

    def pull(self, ref: str, progress: Callable[[str], None] | None = None) -> None:
        repo, tag = split_reference(ref)
        shown: dict[str, str] = {}
        try:
            for chunk in self._client.api.pull(repo, tag=tag, stream=True, decode=True):
                if "error" in chunk:
                    raise BaseImageError(f"cannot pull base image {ref}: {chunk['error']}")
                status = chunk.get("status", "")
                layer = chunk.get("id", "")
                line = f"{layer}: {status} {chunk.get('progress', '')}".strip()
                # One line per layer state change keeps a pull readable in CI logs.
                if progress is not None and shown.get(layer) != status:
                    shown[layer] = status
                    progress(line)
        except docker.errors.APIError as exc:
            raise BaseImageError(
                f"cannot pull base image {ref}: {_short(exc)}",
                hint="check the registry is reachable, or load the image and use --pull never",
            ) from exc
        except _LOST as exc:
            raise lost(f"pulling {ref}", exc) from exc
        except requests.exceptions.RequestException as exc:
            raise BaseImageError(f"cannot pull base image {ref}: {_short(exc)}") from exc

    @_guard("tagging {0}")
    def tag(self, image_id: str, ref: str) -> None:
        repo, tag = split_reference(ref)
        self._client.api.tag(image_id, repo, tag=tag)

    @_guard("removing tag {0}")
    def untag(self, ref: str) -> None:
        try:
            self._client.api.remove_image(ref, noprune=True)
        except docker.errors.NotFound:
            pass

    @_guard("removing image {0}")
    def remove_image(self, ref: str, force: bool = True) -> None:
        try:
            self._client.api.remove_image(ref, force=force)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            log.warning("could not remove image %s: %s", ref, _short(exc))

    def remove_untagged(self, image_id: str, force: bool = True) -> None:
        info = self.image(image_id)
        if info is not None and not info.tags:
            self.remove_image(image_id, force=force)

    @_guard("importing {0}")
    def import_rootfs(self, tar_path: str, ref: str) -> ImageInfo:
        repo, tag = split_reference(ref)
        self._client.api.import_image_from_file(tar_path, repository=repo, tag=tag)
        info = self.image(ref)
        if info is None:
            raise EngineError(f"imported {tar_path} but {ref} is missing")
        return info

    # -- containers --------------------------------------------------------

    @contextmanager
    def box(self, image: str, python: str = "python3") -> Iterator[Box]:
        """A container of ``image`` kept alive by its own Python, removed after.

        The entrypoint is always overridden: a vLLM image's own entrypoint
        would start a server.
        """
        container = None
        try:
            container = self._client.containers.create(
                image,
                entrypoint=[python, "-c", "import time; time.sleep(3600)"],
                network_mode="none",
                labels=_labels("probe"),
            )
            container.start()
            time.sleep(0.05)
            container.reload()
            if container.status != "running":
                said = container.logs().decode("utf-8", "replace").strip().splitlines()
                raise BaseImageError(
                    f"{python} in {image} exited at once ({said[-1] if said else 'no output'}): "
                    "is it the image's Python interpreter?",
                    hint="set [package] python in the image definition to the image's Python",
                )
            yield Box(container)
        except docker.errors.APIError as exc:
            raise EngineError(f"cannot run a container of {image}: {_short(exc)}") from exc
        except _LOST as exc:
            raise lost(f"running a container of {image}", exc) from exc
        finally:
            if container is not None:
                _remove_container(container)

    def run(
        self,
        image: str,
        argv: Sequence[str],
        *,
        files: Mapping[str, bytes] | None = None,
        files_at: str = "/tmp",
        gpu: bool = False,
        network: str = "none",
        timeout: float = 300,
    ) -> ExecResult:
        """Run ``argv`` (entrypoint overridden) and return its output."""
        container = None
        try:
            container = self._client.containers.create(
                image,
                entrypoint=list(argv[:1]),
                command=list(argv[1:]),
                network_mode=network,
                labels=_labels("smoke"),
                **_gpu_request(gpu),
            )
            if files:
                container.put_archive(files_at, tar_bytes(files))
            container.start()
            try:
                status = container.wait(timeout=timeout)
                code = int(status.get("StatusCode", 1))
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectTimeout):
                code = 124
            out = container.logs(stdout=True, stderr=False).decode("utf-8", "replace")
            err = container.logs(stdout=False, stderr=True).decode("utf-8", "replace")
            if code == 124:
                err += f"\n(timed out after {timeout:.0f} s)"
            return ExecResult(code, out, err)
        except docker.errors.APIError as exc:
            raise EngineError(f"cannot run {argv[0]} in {image}: {_short(exc)}") from exc
        except _LOST as exc:
            raise lost(f"running {argv[0]} in {image}", exc) from exc
        finally:
            if container is not None:
                _remove_container(container)

    @contextmanager
    def service(
        self,
        image: str,
        command: Sequence[str],
        *,
        mounts: Sequence[tuple[str, str]] = (),
        gpu: bool = False,
    ) -> Iterator[Callable[[], tuple[bool, str]]]:
        """Start the image's own entrypoint with ``command`` on host network.

        Yields a function returning (still running, last log lines).
        """
        container = None
        try:
            kwargs = _gpu_request(gpu)
            container = self._client.containers.create(
                image,
                command=list(command),
                network_mode="host",
                volumes={src: {"bind": dst, "mode": "ro"} for src, dst in mounts},
                labels=_labels("serve"),
                **kwargs,
            )
            container.start()

            def state() -> tuple[bool, str]:
                container.reload()
                logs = container.logs(tail=LOG_TAIL_LINES).decode("utf-8", "replace")
                return container.status == "running", logs

            yield state
        except docker.errors.APIError as exc:
            raise EngineError(f"cannot start {image}: {_short(exc)}") from exc
        except _LOST as exc:
            raise lost(f"serving {image}", exc) from exc
        finally:
            if container is not None:
                _remove_container(container)

    def has_gpu_runtime(self) -> bool:
        """Whether the engine knows an NVIDIA runtime (``--gpus`` would work)."""
        try:
            info = self._client.info()
        except docker.errors.APIError:
            return False
        runtimes = info.get("Runtimes") or {}
        return "nvidia" in runtimes or "nvidia" in str(info.get("DefaultRuntime", ""))

    @_guard("listing containers")
    def containers_with_role(self, run_id: str | None = None) -> list[str]:
        """Containers this tool started (and, given run_id, that run)."""
        label = f"io.vllm-hotfix.run={run_id}" if run_id else "io.vllm-hotfix.role"
        found = self._client.containers.list(all=True, filters={"label": label})
        return [c.id for c in found]

    @_guard("listing images")
    def image_ids(self) -> set[str]:
        """Every image in the engine, intermediate ones included."""
        return {i["Id"] for i in self._client.api.images(all=True)}

    @_guard("listing containers")
    def containers_by_owner(self) -> dict[str, list[str]]:
        """Containers this tool started, grouped by the owner label (host:pid) of the process."""
        found = self._client.containers.list(all=True, filters={"label": "io.vllm-hotfix.owner"})
        out: dict[str, list[str]] = {}
        for c in found:
            out.setdefault(c.labels.get("io.vllm-hotfix.owner", ""), []).append(c.id)
        return out

    @_guard("removing container {0}")
    def remove_container(self, container_id: str) -> None:
        try:
            self._client.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass

    # -- build and push ----------------------------------------------------

    def build(
        self,
        context: bytes,
        progress: Callable[[str], None] | None = None,
        on_image: Callable[[str], None] | None = None,
        *,
        buildargs: Mapping[str, str] | None = None,
        network: str | None = None,
    ) -> str:
        """Build an untagged image from a tar context; return its ID.

        ``buildargs`` fill the Dockerfile's ARGs; ``network`` is the network
        mode of its RUN steps (``host`` lets them reach a server on loopback).

        ``on_image`` hears every image the build commits (each step's and the
        last), before the build goes on, so a run that dies can be cleaned up
        after. If the build fails or is interrupted, the images its steps made
        are removed here, unless other images depend on them.
        """
        tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        image_id: str | None = None
        made: list[str] = []
        try:
            image_id = self._build(context, tail, made, progress, on_image, dict(buildargs or {}), network)
        except BaseException as exc:
            self._discard(made)
            if isinstance(exc, _LOST):
                raise lost("building the image", exc) from exc
            raise
        return image_id

    def _discard(self, made: list[str]) -> None:
        for step in reversed(made):
            try:
                self.remove_untagged(step, force=False)
            except PipelineError as exc:
                log.debug("build step %s stays: %s", step[:19], exc)

    def _build(
        self,
        context: bytes,
        tail: deque[str],
        made: list[str],
        progress: Callable[[str], None] | None,
        on_image: Callable[[str], None] | None,
        buildargs: dict[str, str],
        network: str | None,
    ) -> str:
        image_id: str | None = None
        try:
            for chunk in self._client.api.build(
                fileobj=io.BytesIO(context),
                custom_context=True,
                rm=True,
                forcerm=True,
                decode=True,
                buildargs=buildargs or None,
                network_mode=network,
            ):
                if "error" in chunk:
                    tail.append(chunk["error"].rstrip())
                    raise BuildError("docker build failed: " + chunk["error"].strip(), log_tail=tail)
                if "aux" in chunk and "ID" in chunk["aux"]:
                    image_id = chunk["aux"]["ID"]
                text = chunk.get("stream", "")
                for line in text.splitlines():
                    step = _STEP_ID.match(line)
                    if step:
                        made.append(step.group(1))
                        if on_image is not None:
                            on_image(step.group(1))
                    if line.strip():
                        tail.append(line)
                        if progress is not None:
                            progress(line)
        except docker.errors.APIError as exc:
            raise BuildError(f"docker build failed: {_short(exc)}", log_tail=tail) from exc
        if image_id is None:
            for line in reversed(tail):
                if line.startswith("Successfully built "):
                    image_id = self._client.images.get(line.split()[-1]).id
                    break
        if image_id is None:
            raise BuildError("docker build reported no image ID", log_tail=tail)
        return image_id

    def push(
        self,
        ref: str,
        progress: Callable[[str], None] | None = None,
    ) -> str:
        """Push ``ref`` with the credentials `docker login` stored; return the manifest digest.

        The SDK reads them the docker way (DOCKER_CONFIG or ~/.docker/config.json,
        credential helpers included) and hands them to the engine.
        """
        repo, tag = split_reference(ref)
        host = registry_of(ref)
        digest: str | None = None
        shown: dict[str, str] = {}
        try:
            for chunk in self._client.api.push(repo, tag=tag, stream=True, decode=True):
                if "error" in chunk:
                    raise _push_error(ref, host, chunk["error"].strip())
                aux = chunk.get("aux") or {}
                if "Digest" in aux:
                    digest = aux["Digest"]
                status = chunk.get("status", "")
                layer = chunk.get("id", "")
                if progress is not None and shown.get(layer) != status:
                    shown[layer] = status
                    progress(f"{layer}: {status}".strip(": "))
        except docker.errors.APIError as exc:
            raise _push_error(ref, host, _short(exc)) from exc
        except _LOST as exc:
            raise lost(f"push of {ref}", exc) from exc
        except requests.exceptions.RequestException as exc:
            raise PushError(f"push of {ref} failed: {_short(exc)}") from exc
        if digest is None:
            raise PushError(f"push of {ref} reported no digest")
        return digest

    def registry_digest(self, ref: str) -> str:
        """The digest the registry holds for ``ref``, asked through the engine.

        The engine uses the same credentials and scheme (TLS or a trusted
        plain-HTTP registry) as for the push, so this works wherever the push did.
        """
        host = registry_of(ref)
        try:
            data = self._client.api.inspect_distribution(ref)
        except docker.errors.APIError as exc:
            raise _push_error(ref, host, _short(exc), asking=True) from exc
        except _LOST as exc:
            raise lost(f"asking {host} for {ref}", exc) from exc
        except requests.exceptions.RequestException as exc:
            raise PushError(f"cannot ask {host} for {ref}: {_short(exc)}") from exc
        digest = (data.get("Descriptor") or {}).get("digest")
        if not digest:
            raise PushError(f"{host} gave no digest for {ref}")
        return str(digest)

    def host_facts(self) -> dict[str, Any]:
        """What a verdict records about the engine that ran it."""
        import socket

        try:
            version = self._client.version()
        except docker.errors.APIError as exc:
            raise EngineError(f"engine refused its version: {_short(exc)}") from exc
        except _LOST as exc:
            raise lost("asking the engine its version", exc) from exc
        return {
            "hostname": socket.gethostname(),
            "engine_version": version.get("Version"),
            "api_version": version.get("ApiVersion"),
            "os": version.get("Os"),
            "arch": version.get("Arch"),
        }


def _push_error(ref: str, host: str, message: str, *, asking: bool = False) -> PushError:
    doing = f"asking {host} for {ref}" if asking else f"push of {ref}"
    if auth_refused(message):
        return PushError(
            f"{doing}: registry {host} refused the credentials (not logged in, or wrong login): {message}",
            hint=f"docker login {host}",
        )
    return PushError(f"{doing} failed: {message}")


def _gpu_request(gpu: bool) -> dict[str, Any]:
    """Create-time arguments that ask for every GPU (`docker run --gpus all`)."""
    if not gpu:
        return {}
    return {"device_requests": [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]}


_STEP_ID = re.compile(r"^ ---> ([0-9a-f]{12,64})$")


def owner() -> str:
    """This process, as container labels and leftover sweeps name it."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _labels(role: str) -> dict[str, str]:
    """Labels for every container we start, so leaks can be found by owner."""
    labels = {"io.vllm-hotfix.role": role, "io.vllm-hotfix.owner": owner()}
    run_id = os.environ.get("VLLM_HOTFIX_RUN_ID")
    if run_id:
        labels["io.vllm-hotfix.run"] = run_id
    return labels


def _remove_container(container: Any) -> None:
    for attempt in range(3):
        try:
            container.remove(force=True)
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            if attempt == 2:
                log.warning("could not remove container %s: %s", container.id[:12], _short(exc))
            time.sleep(0.5)


def _short(exc: BaseException) -> str:
    """One line from an SDK exception, whose str() can span many."""
    text = getattr(exc, "explanation", None) or str(exc)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        text = json.loads(text).get("message", text)
    except (ValueError, AttributeError):
        pass
    return " ".join(str(text).split())[:400]
