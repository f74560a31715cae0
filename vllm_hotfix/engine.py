"""The one seam to the container engine.

Nothing else in the package imports ``docker`` or talks to the engine, but
this module's own transport, :mod:`engine_http`. Every container this module
starts is removed before the call that started it returns, whatever happens.

The Docker SDK (and ``requests`` under it) costs more to import than a reused
build takes in all, so it is imported on first use. The few calls an
unchanged rebuild or an assembled build makes (ping, inspect, history, tag,
load, info) are plain HTTP requests: over the engine's unix socket
(:mod:`engine_http`) when the engine is local, else through the SDK's session.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import re
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .engine_http import UnixHttp, local_socket, lost
from .errors import BaseImageError, BuildError, EngineError, PipelineError, PushError

log = logging.getLogger(__name__)


class _Lazy:
    """A module imported on first attribute access (``docker.errors.X`` still reads as usual)."""

    def __init__(self, *names: str) -> None:
        self._names = names

    def __getattr__(self, attr: str) -> Any:
        import importlib

        for name in self._names:
            importlib.import_module(name)
        module = importlib.import_module(self._names[0])
        try:
            return getattr(module, attr)
        except AttributeError:
            # A first import cut short (Ctrl-C while the SDK loads) can leave the
            # package without a submodule attribute; an ``except docker.errors.X``
            # evaluated while that interrupt propagates must still find it.
            return importlib.import_module(f"{self._names[0]}.{attr}")


docker: Any = _Lazy("docker", "docker.auth", "docker.errors", "docker.types", "docker.utils")
requests: Any = _Lazy("requests", "requests.exceptions")
urllib3: Any = _Lazy("urllib3", "urllib3.exceptions")

PULL_POLICIES = ("missing", "always", "never")
LOG_TAIL_LINES = 50
# A server's log as its watcher reads it: enough to reach past a flood of request
# lines to the error that killed it (the caller condenses it, sweep.condense).
SERVICE_LOG_LINES = 2000


@dataclass(frozen=True, slots=True)
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
    # The engine's whole answer, for what the fields above leave out.
    attrs: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    os: str = "linux"
    architecture: str = ""
    variant: str = ""

    @property
    def digest(self) -> str | None:
        """The registry digest (``name@sha256:...``) if the image has one."""
        return self.repo_digests[0] if self.repo_digests else None


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """How a container asks the engine for GPUs; chosen elsewhere, passed through here.

    ``cdi``: a CDI device (``device``, e.g. ``nvidia.com/gpu=all``; engine API >= 1.44 with
    the ``cdi`` feature). ``gpus``: the capability request of ``docker run --gpus all``.
    ``runtime``: a registered OCI runtime (``runtime``, e.g. ``nvidia``) with every GPU visible.
    """

    way: str
    device: str = ""
    runtime: str = ""

    def __str__(self) -> str:
        if self.way == "cdi":
            return f"cdi:{self.device}"
        if self.way == "runtime":
            return f"runtime:{self.runtime}"
        return self.way


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine says about itself that bears on GPU access."""

    server_version: str
    api_version: str
    cdi_spec_dirs: tuple[str, ...]
    runtimes: tuple[str, ...]
    default_runtime: str
    local: bool


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str


def _tuple(value: Sequence[str] | None) -> tuple[str, ...] | None:
    return tuple(value) if value is not None else None


def _image_info(attrs: Mapping[str, Any]) -> ImageInfo:
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
        attrs=attrs,
        os=str(attrs.get("Os") or "linux"),
        architecture=str(attrs.get("Architecture") or ""),
        variant=str(attrs.get("Variant") or ""),
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


def _lost_errors() -> tuple[type[BaseException], ...]:
    """Errors the SDK raises when the engine goes away under a call in flight.

    A function, not a constant: naming them imports the SDK, which only a
    call that used the SDK may pay for (an ``except`` clause evaluates it
    only when an exception reaches it).
    """
    return (requests.exceptions.ConnectionError, urllib3.exceptions.ProtocolError)
_AUTH_WORDS = ("no basic auth credentials", "unauthorized", "authentication required", "denied",
               "incorrect username or password")


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
            except _lost_errors() as exc:
                raise lost(what.format(*args), exc) from exc
            except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
                raise EngineError(f"{what.format(*args)}: {_short(exc)}") from exc

        return wrapper  # type: ignore[return-value]

    return deco


class Served:
    """A container started by :meth:`Engine.service`: whether it runs, and its log when asked."""

    def __init__(self, container: Any) -> None:
        self._container = container

    def running(self) -> bool:
        self._container.reload()
        return bool(self._container.status == "running")

    def logs(self) -> str:
        """Its last SERVICE_LOG_LINES lines."""
        return str(self._container.logs(tail=SERVICE_LOG_LINES).decode("utf-8", "replace"))


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
        from .tarball import tar_bytes

        self._container.put_archive(folder, tar_bytes(files))


class Engine:
    """A connection to one Docker engine."""

    def __init__(self, client: Any = None, *, http: UnixHttp | None = None, timeout: int = 120,
                 base_url: str | None = None) -> None:
        self._sdk_client = client
        self._http = http
        self._timeout = timeout
        self._base_url = base_url
        # Told +1 before each container this engine starts for us and -1 once it is
        # removed, so that a run that dies can leave a note for the next (leftovers.py).
        self.on_container: Callable[[int], None] | None = None

    def close(self) -> None:
        """Let go of the engine."""
        if self._http is not None:
            self._http.close()

    def _containers(self, change: int) -> None:
        if self.on_container is not None:
            self.on_container(change)

    @classmethod
    def connect(cls, timeout: int = 120, base_url: str | None = None, *, transport: str = "auto",
                ping: bool = True) -> Engine:
        """Connect through ``base_url``, else DOCKER_HOST (or the default socket), and ping.

        ``transport``: ``auto`` speaks plain HTTP to a local unix socket and
        uses the SDK for anything else; ``sdk`` always uses the SDK.
        ``ping=False`` skips the ping on a local socket: the first real call
        then fails with the same error if no engine answers there.
        """
        path = local_socket(base_url) if transport == "auto" else None
        if path is not None:
            engine = cls(http=UnixHttp(path, timeout), timeout=timeout, base_url=f"unix://{path}")
            if not ping:
                return engine
            status, _data = engine._call("GET", "/_ping")
            if status != 200:
                raise EngineError(f"no Docker engine answers (unix socket unix://{path}: HTTP {status} to a ping)",
                                  hint="start one (make services), or point DOCKER_HOST at a running engine")
            return engine
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
        return cls(client, timeout=timeout)

    @property
    def _client(self) -> Any:
        """The SDK client, made on first use (for the same engine as the plain HTTP calls)."""
        if self._sdk_client is None:
            try:
                if self._base_url is not None:
                    self._sdk_client = docker.DockerClient(base_url=self._base_url, timeout=self._timeout)
                else:
                    self._sdk_client = docker.from_env(timeout=self._timeout)
            except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
                if self._http is not None and self._http.answered:
                    # It answered the plain HTTP calls of this run: it went away since.
                    raise lost("reaching the Docker engine", exc) from exc
                raise EngineError(f"cannot reach the Docker engine: {_short(exc)}") from exc
        return self._sdk_client

    @_client.setter
    def _client(self, client: Any) -> None:
        self._sdk_client = client

    def _call(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None = None,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """One request to the engine's API (unversioned path: the engine's own version)."""
        url = path + ("?" + urlencode(params) if params else "")
        if self._http is not None:
            return self._http.request(method, url, body, headers)
        api = self._client.api
        try:
            resp = api.request(method, api.base_url + url, data=body, headers=dict(headers or {}),
                               timeout=self._timeout)
        except requests.exceptions.RequestException as exc:
            raise EngineError(f"the engine did not answer {method} {path}: {_short(exc)}") from exc
        return resp.status_code, resp.content

    def _json(self, method: str, path: str, what: str, **kwargs: Any) -> Any:
        """The JSON answer of one call, None for 404, EngineError for any other failure."""
        status, data = self._call(method, path, **kwargs)
        if status == 404:
            return None
        if status >= 300:
            raise EngineError(f"engine refused to {what}: {_short(Exception(data.decode('utf-8', 'replace')))}")
        return json.loads(data) if data.strip() else {}

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

    def inspect(self, ref: str) -> dict[str, Any] | None:
        """The engine's description of image ``ref`` (``docker image inspect``), or None."""
        return self._json("GET", f"/images/{_q(ref)}/json", f"inspect {ref}")  # type: ignore[no-any-return]

    @_guard("inspecting image {0}")
    def image(self, ref: str) -> ImageInfo | None:
        attrs = self.inspect(ref)
        return _image_info(attrs) if attrs is not None else None

    def history(self, image_id: str) -> list[dict[str, Any]]:
        """The image's history as the engine reports it, oldest first."""
        found = self._json("GET", f"/images/{_q(image_id)}/history", f"read the history of {image_id}")
        if found is None:
            raise EngineError(f"{image_id}: no such image")
        return list(reversed(found))

    def info(self) -> dict[str, Any]:
        return self._json("GET", "/info", "describe itself") or {}  # type: ignore[no-any-return]

    def load(self, archive: bytes) -> list[str]:
        """``docker load`` of a save-format archive; layers the engine has need not be in it.

        Returns what the engine says it loaded (image IDs or names).
        """
        status, data = self._call("POST", "/images/load", params={"quiet": "1"}, body=archive,
                                  headers={"Content-Type": "application/x-tar"})
        messages = []
        for line in data.decode("utf-8", "replace").splitlines():
            try:
                messages.append(json.loads(line))
            except ValueError:
                messages.append({"error": line} if status >= 300 else {"stream": line})
        errors = [str(m.get("error") or m.get("message")) for m in messages if m.get("error") or m.get("message")]
        if status >= 300 or errors:
            raise BuildError("the engine refused to load the image: " + ("; ".join(errors) or f"HTTP {status}"),
                             log_tail=[str(m.get("stream", "")).strip() for m in messages if m.get("stream")])
        loaded = []
        for m in messages:
            text = str(m.get("stream", "")).strip()
            for prefix in ("Loaded image ID: ", "Loaded image: "):
                if text.startswith(prefix):
                    loaded.append(text.removeprefix(prefix))
        return loaded

    def resolve(
        self,
        ref: str,
        policy: str = "missing",
        progress: Callable[[str], None] | None = None,
        platform: str | None = None,
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
        self.pull(ref, progress, platform)
        pulled = self.image(ref)
        if pulled is None:
            raise BaseImageError(f"pulled {ref} but the engine does not list it")
        return pulled

    def pull(self, ref: str, progress: Callable[[str], None] | None = None, platform: str | None = None) -> None:
        """Pull ``ref`` (of one ``platform`` when given; only engines from API 1.32 take it)."""
        repo, tag = split_reference(ref)
        shown: dict[str, str] = {}
        extra = {"platform": platform} if platform else {}
        try:
            for chunk in self._client.api.pull(repo, tag=tag, stream=True, decode=True, **extra):
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
        except _lost_errors() as exc:
            raise lost(f"pulling {ref}", exc) from exc
        except requests.exceptions.RequestException as exc:
            raise BaseImageError(f"cannot pull base image {ref}: {_short(exc)}") from exc

    @_guard("tagging {0}")
    def tag(self, image_id: str, ref: str) -> None:
        # The whole reference as `repo`, no `tag`: the engine parses it with
        # its own reference grammar (a missing tag is `latest`), and a reused
        # build needs no SDK import to split it.
        status, data = self._call("POST", f"/images/{_q(image_id)}/tag", params={"repo": ref})
        if status >= 300:
            raise EngineError(f"engine refused to tag {image_id} as {ref}: "
                              f"{_short(Exception(data.decode('utf-8', 'replace')))}")

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
    def import_rootfs(self, tar_path: str, ref: str, platform: str | None = None) -> ImageInfo:
        """Import a root file system tar as ``ref``; ``platform`` says which one it is.

        The SDK's import call has no platform parameter; the engine's API has
        had one since 1.32 (Docker 20.10 accepts it but records its own).
        """
        repo, tag = split_reference(ref)
        if platform is None:
            self._client.api.import_image_from_file(tar_path, repository=repo, tag=tag)
        else:
            api = self._client.api
            with open(tar_path, "rb") as fh:
                res = api._post(api._url("/images/create"), data=fh,
                                params={"fromSrc": "-", "repo": repo, "tag": tag, "platform": platform},
                                headers={"Content-Type": "application/tar"}, timeout=None)
                api._raise_for_status(res)
        info = self.image(ref)
        if info is None:
            raise EngineError(f"imported {tar_path} but {ref} is missing")
        return info

    def import_stream(self, chunks: Iterable[bytes], ref: str, changes: Sequence[str] = ()) -> ImageInfo:
        """``docker import`` of a tar stream (e.g. a host's own filesystem), with Dockerfile ``changes``."""
        repo, tag = split_reference(ref)
        try:
            self._client.api.import_image(src=iter(chunks), repository=repo, tag=tag, changes=list(changes),
                                          stream_src=True)
        except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
            raise EngineError(f"cannot import a filesystem as {ref}: {_short(exc)}") from exc
        info = self.image(ref)
        if info is None:
            raise EngineError(f"imported a filesystem but {ref} is missing")
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
            self._containers(+1)
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
                if said and "exec format error" in said[-1]:
                    raise BaseImageError(
                        f"{image} is for another CPU architecture and the engine's host cannot run it "
                        f"({said[-1]})",
                        hint=_EMULATOR_HINT,
                    )
                raise BaseImageError(
                    f"{python} in {image} exited at once ({said[-1] if said else 'no output'}): "
                    "is it the image's Python interpreter?",
                    hint="set [package] python in the image definition to the image's Python",
                )
            yield Box(container)
        except docker.errors.APIError as exc:
            if "exec format error" in _short(exc):
                raise BaseImageError(
                    f"{image} is for another CPU architecture and the engine's host cannot run it ({_short(exc)})",
                    hint=_EMULATOR_HINT,
                ) from exc
            raise EngineError(f"cannot run a container of {image}: {_short(exc)}") from exc
        except _lost_errors() as exc:
            raise lost(f"running a container of {image}", exc) from exc
        finally:
            if container is not None and _remove_container(container):
                self._containers(-1)

    def run(
        self,
        image: str,
        argv: Sequence[str],
        *,
        files: Mapping[str, bytes] | None = None,
        files_at: str = "/tmp",
        gpu: GpuRequest | None = None,
        network: str = "none",
        timeout: float = 300,
    ) -> ExecResult:
        """Run ``argv`` (entrypoint overridden) and return its output."""
        container = None
        try:
            self._containers(+1)
            container = self._client.containers.create(
                image,
                entrypoint=list(argv[:1]),
                command=list(argv[1:]),
                network_mode=network,
                labels=_labels("smoke"),
                **_gpu_request(gpu),
            )
            if files:
                from .tarball import tar_bytes

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
        except _lost_errors() as exc:
            raise lost(f"running {argv[0]} in {image}", exc) from exc
        finally:
            if container is not None and _remove_container(container):
                self._containers(-1)

    @contextmanager
    def service(
        self,
        image: str,
        command: Sequence[str],
        *,
        mounts: Sequence[tuple[str, str]] = (),
        gpu: GpuRequest | None = None,
    ) -> Iterator[Served]:
        """Start the image's own entrypoint with ``command`` on host network; yield it as :class:`Served`."""
        container = None
        try:
            kwargs = _gpu_request(gpu)
            self._containers(+1)
            container = self._client.containers.create(
                image,
                command=list(command),
                network_mode="host",
                volumes={src: {"bind": dst, "mode": "ro"} for src, dst in mounts},
                labels=_labels("serve"),
                **kwargs,
            )
            container.start()
            yield Served(container)
        except docker.errors.APIError as exc:
            raise EngineError(f"cannot start {image}: {_short(exc)}") from exc
        except _lost_errors() as exc:
            raise lost(f"serving {image}", exc) from exc
        finally:
            if container is not None and _remove_container(container):
                self._containers(-1)

    def facts(self) -> EngineFacts:
        """Version, CDI spec folders (API >= 1.44 lists them) and registered runtimes."""
        try:
            info = self._client.info()
            version = self._client.version()
        except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
            raise EngineError(f"engine refused `docker info`: {_short(exc)}") from exc
        return EngineFacts(
            server_version=str(version.get("Version", "")),
            api_version=str(version.get("ApiVersion", "")),
            cdi_spec_dirs=tuple(info.get("CDISpecDirs") or ()),
            runtimes=tuple(sorted(info.get("Runtimes") or {})),
            default_runtime=str(info.get("DefaultRuntime") or ""),
            # Spec files can be read only where the engine's files are ours to read.
            local=self.local,
        )

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
        # Plain HTTP: every run asks this first, and most find nothing to do.
        found = self._json("GET", "/containers/json", "list containers", params={
            "all": "1", "filters": json.dumps({"label": ["io.vllm-hotfix.owner"]})}) or []
        out: dict[str, list[str]] = {}
        for c in found:
            out.setdefault((c.get("Labels") or {}).get("io.vllm-hotfix.owner", ""), []).append(c["Id"])
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
            if isinstance(exc, _lost_errors()):
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
        except _lost_errors() as exc:
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
        except _lost_errors() as exc:
            raise lost(f"asking {host} for {ref}", exc) from exc
        except requests.exceptions.RequestException as exc:
            raise PushError(f"cannot ask {host} for {ref}: {_short(exc)}") from exc
        digest = (data.get("Descriptor") or {}).get("digest")
        if not digest:
            raise PushError(f"{host} gave no digest for {ref}")
        return str(digest)

    @functools.cached_property
    def _version(self) -> dict[str, Any]:
        try:
            return dict(self._client.version())
        except docker.errors.APIError as exc:
            raise EngineError(f"engine refused its version: {_short(exc)}") from exc
        except _lost_errors() as exc:
            raise lost("asking the engine its version", exc) from exc

    @property
    def arch(self) -> str:
        """The engine host's own architecture (amd64, arm64)."""
        return str(self._version.get("Arch") or "")

    @property
    def api_version(self) -> tuple[int, int]:
        major, _, minor = str(self._version.get("ApiVersion") or "0.0").partition(".")
        return int(major or 0), int(minor or 0)

    @property
    def version_text(self) -> str:
        return f"Docker {self._version.get('Version', '?')}, API {self._version.get('ApiVersion', '?')}"

    @property
    def local(self) -> bool:
        """Whether the engine runs on this machine (reached through a unix socket)."""
        # docker-py names a unix socket (and a Windows named pipe) so; ssh:// and tcp:// are other hosts.
        return str(self._client.api.base_url) in ("http+docker://localhost", "http+docker://localnpipe")

    @_guard("asking the engine for {0}")
    def registry_secure(self, host: str) -> bool:
        """Whether the engine talks TLS to ``host`` (False: a registry it trusts over plain HTTP).

        The engine's own answer: its insecure-registries list and CIDRs, which
        hold 127.0.0.0/8 by default.
        """
        import ipaddress  # here: only a push asks

        config = (self._client.info() or {}).get("RegistryConfig") or {}
        index = (config.get("IndexConfigs") or {}).get(host)
        if index is not None:
            return bool(index.get("Secure", True))
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        name = name.strip("[]")
        try:
            addresses = {ipaddress.ip_address(name)}
        except ValueError:
            try:
                addresses = {ipaddress.ip_address(a[4][0]) for a in socket.getaddrinfo(name, None)}
            except OSError:
                return True
        for cidr in config.get("InsecureRegistryCIDRs") or []:
            net = ipaddress.ip_network(cidr, strict=False)
            if addresses and all(a in net for a in addresses):
                return False
        return True

    def host_facts(self) -> dict[str, Any]:
        """What a verdict records about the engine that ran it."""
        import socket

        try:
            version = self._client.version()
        except docker.errors.APIError as exc:
            raise EngineError(f"engine refused its version: {_short(exc)}") from exc
        except _lost_errors() as exc:
            raise lost("asking the engine its version", exc) from exc
        return {
            "hostname": socket.gethostname(),
            "engine_version": version.get("Version"),
            "api_version": version.get("ApiVersion"),
            "os": version.get("Os"),
            "arch": version.get("Arch"),
        }


def registry_credentials(host: str) -> tuple[str, str] | None:
    """The login `docker login HOST` stored, as (username, password-or-token), or None.

    Read the docker way: DOCKER_CONFIG or ~/.docker/config.json, credential
    stores and helpers included. An identity token is returned with the
    username ``<token>``, as the credential helpers spell it.
    """
    try:
        found = docker.auth.load_config().resolve_authconfig(host)
    except docker.errors.DockerException as exc:
        raise PushError(f"cannot read the stored login for {host}: {_short(exc)}",
                        hint=f"docker login {host}") from exc
    if not found:
        return None
    data = {str(k).lower(): v for k, v in dict(found).items()}
    if data.get("identitytoken"):
        return "<token>", str(data["identitytoken"])
    if data.get("username") is None and data.get("password") is None:
        return None
    return str(data.get("username") or ""), str(data.get("password") or "")


def _push_error(ref: str, host: str, message: str, *, asking: bool = False) -> PushError:
    doing = f"asking {host} for {ref}" if asking else f"push of {ref}"
    if auth_refused(message):
        return PushError(
            f"{doing}: registry {host} refused the credentials (not logged in, or wrong login): {message}",
            hint=f"docker login {host}",
        )
    return PushError(f"{doing} failed: {message}")


def _gpu_request(gpu: GpuRequest | None) -> dict[str, Any]:
    """Create-time arguments for ``gpu``: a plain translation, the choice is made by the caller."""
    if gpu is None:
        return {}
    if gpu.way == "cdi":
        return {"device_requests": [docker.types.DeviceRequest(driver="cdi", device_ids=gpu.device.split(","))]}
    if gpu.way == "gpus":
        return {"device_requests": [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]}
    if gpu.way == "runtime":
        # The NVIDIA runtime exposes GPUs by this variable; CUDA images set it, others may not.
        return {"runtime": gpu.runtime, "environment": {"NVIDIA_VISIBLE_DEVICES": "all"}}
    raise EngineError(f"unknown GPU request way {gpu.way!r}")


_EMULATOR_HINT = ("register qemu on the engine's host: mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc; "
                  "apt-get install qemu-user-static binfmt-support")

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


def _remove_container(container: Any) -> bool:
    """Remove it; False if it may still be there (the next run's sweep then finds it)."""
    for attempt in range(3):
        try:
            container.remove(force=True)
            return True
        except docker.errors.NotFound:
            return True
        except docker.errors.APIError as exc:
            if attempt == 2:
                log.warning("could not remove container %s: %s", container.id[:12], _short(exc))
            time.sleep(0.5)
    return False


def _q(text: str, safe: str = "/:") -> str:
    """Percent-encode for a URL (as the SDK does for path parameters: "/" and ":" stay).

    Written out rather than taken from urllib.parse, whose import costs a
    noticeable part of an unchanged rebuild.
    """
    keep = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~" + safe)
    return "".join(c if c in keep else "".join(f"%{b:02X}" for b in c.encode()) for c in text)


def urlencode(params: Mapping[str, str]) -> str:
    return "&".join(f"{_q(k, '')}={_q(v, '')}" for k, v in params.items())


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
