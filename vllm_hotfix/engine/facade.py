"""The engine as the pipeline sees it: typed operations, no policy.

One :class:`Engine` per run, every call through the Docker SDK: its
high-level client for containers, its low-level ``APIClient`` for the rest,
and plain requests over the SDK's own session for the one call the SDK
lacks (importing a root file system for a given platform). The SDK is
imported on the first call. Every call runs under
:func:`.mapping.translating`, so whatever goes wrong leaves as one
PipelineError naming the operation. Which image to pull when, which
registry speaks TLS, and which labels a container gets are decided
elsewhere (:mod:`vllm_hotfix.registry.pulling`,
:mod:`.dockerconfig`, :mod:`.labels`).
Containers, file reads, streamed work (build, pull, push), the error mapper
and the docker config are modules of their own.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

from ..errors import BuildError, EngineError, EngineLost, PipelineError, PushError
from . import containers, dockerconfig, labels, registry_errors, streams, volumes
from . import files as layers
from .mapping import Refused, short, status, translating
from .model import EngineFacts, ExecResult, GpuRequest, ImageInfo
from .pending_load import PendingLoad

log = logging.getLogger(__name__)

DEFAULT_HOST = "unix:///var/run/docker.sock"
# Once the engine stopped answering, each later call (removing what the run
# started) waits this long at most: the run ends with one line soon after.
LOST_DEADLINE = 3.0


class Engine:
    """A connection to one Docker engine."""

    def __init__(self, *, base_url: str | None = None, timeout: float = 120, client: Any = None) -> None:
        self._base_url = base_url
        self.address = base_url or os.environ.get("DOCKER_HOST") or DEFAULT_HOST
        self.timeout = timeout
        self._client = client
        self._answered = client is not None  # after that, a failure is an engine lost, not a missing one
        # Told +1 before each container this engine starts for us and -1 once it is
        # removed, so that a run that dies can leave a note for the next (leftovers.py).
        self.on_container: Callable[[int], None] | None = None
        self._deadline: float | None = None  # seconds per socket operation, when shorter than ``timeout``
        self._lost = False
        self._pending_load: PendingLoad | None = None

    @classmethod
    def connect(cls, timeout: float = 120, base_url: str | None = None, *, ping: bool = True) -> Engine:
        """Connect through ``base_url``, else DOCKER_HOST (or the default socket), and ping.

        ``ping=False`` skips the ping: the first real call then fails with the
        same error if no engine answers.
        """
        engine = cls(base_url=base_url, timeout=timeout)
        if ping:
            engine.ping()
        return engine

    def close(self) -> None:
        """Let go of the engine's connections (a later call opens new ones); a load opened by
        :meth:`expect_load` and not used loads nothing."""
        if self._pending_load is not None:
            self._pending_load.cancel(LOST_DEADLINE)
            self._pending_load = None
        if self._client is not None:
            self._client.close()

    # -- plumbing ------------------------------------------------------------

    @contextmanager
    def translating(self, operation: str, refused: Refused | None = None) -> Iterator[None]:
        """:func:`.mapping.translating` for this engine (a failure before it ever answered: none answers).

        An engine found lost gets only :data:`LOST_DEADLINE` per call from then on, until it answers again.
        """
        try:
            with translating(operation, refused=refused, address=None if self._answered else self.address):
                yield
        except EngineLost:
            self._lost = True
            self._apply_deadline()
            raise
        self._answered = True
        if self._lost:  # it answers again
            self._lost = False
            self._apply_deadline()

    @property
    def call_timeout(self) -> float:
        """The deadline of the next call: per socket operation, so a stream may run longer in all."""
        limits = [self.timeout] + ([self._deadline] if self._deadline is not None else [])
        if self._lost:
            limits.append(LOST_DEADLINE)
        return min(limits)

    @contextmanager
    def deadline(self, seconds: float | None) -> Iterator[None]:
        """Within the block, every call waits at most ``seconds`` for the engine (None: no change).

        For work that must end in a known time, e.g. probing a base: an engine
        frozen there ends the run within about that time, not the default's.
        """
        if seconds is None:
            yield
            return
        before = self._deadline
        self._deadline = seconds
        self._apply_deadline()
        try:
            yield
        finally:
            self._deadline = before
            self._apply_deadline()

    def _apply_deadline(self) -> None:
        """SDK calls read the client's own timeout: keep it at the current deadline."""
        api = getattr(self._client, "api", None)  # a client made by a caller may not be the SDK's
        if api is not None:
            api.timeout = self.call_timeout

    @property
    def sdk(self) -> Any:
        """The Docker SDK client for this engine, made (and the SDK imported) on first use.

        Making it asks the engine its API version, so the SDK speaks the
        engine's own (an older engine refuses a newer client's).
        """
        if self._client is None:
            import docker

            with self.translating("reaching the Docker engine"):
                if self._base_url is not None:
                    self._client = docker.DockerClient(base_url=self._base_url, timeout=self.call_timeout)
                else:
                    # The environment's way, TLS settings (DOCKER_TLS_VERIFY, DOCKER_CERT_PATH) included.
                    self._client = docker.from_env(timeout=self.call_timeout)
            self._apply_deadline()
        return self._client

    @property
    def api(self) -> Any:
        """The SDK's low-level client (``docker.APIClient``) for this engine."""
        return self.sdk.api

    def ping(self) -> None:
        with self.translating("pinging the engine"):
            self.api.ping()

    @property
    def local(self) -> bool:
        """Whether the engine runs on this machine: its files are ours to read, our loopback is its loopback."""
        url = urlparse(self.address)
        if url.scheme in ("unix", "npipe", "http+unix"):
            return True
        return url.scheme in ("tcp", "http", "https") and url.hostname in ("localhost", "127.0.0.1", "::1")

    def notify(self, change: int) -> None:
        """Tell :attr:`on_container` a container was started (+1) or removed (-1)."""
        if self.on_container is not None:
            self.on_container(change)

    # -- images ------------------------------------------------------------

    @contextmanager
    def _absent_ok(self, operation: str, refused: Refused | None = None) -> Iterator[list[bool]]:
        """:meth:`translating`, with the engine's 404 (no such image or container) no error: the list says it."""
        absent: list[bool] = []
        with self.translating(operation, refused):
            try:
                yield absent
            except Exception as exc:
                if status(exc) != 404:
                    raise
                absent.append(True)

    def inspect(self, ref: str) -> dict[str, Any] | None:
        """The engine's description of image ``ref`` (``docker image inspect``), or None."""
        found: dict[str, Any] | None = None
        with self._absent_ok(f"inspecting image {ref}"):
            found = self.api.inspect_image(ref)
        return found

    def image(self, ref: str) -> ImageInfo | None:
        attrs = self.inspect(ref)
        return ImageInfo.from_inspect(attrs) if attrs is not None else None

    def history(self, image_id: str) -> list[dict[str, Any]]:
        """The image's history as the engine reports it, oldest first."""
        with self._absent_ok(f"reading the history of {image_id}") as absent:
            found = self.api.history(image_id)
        if absent:
            raise EngineError(f"{image_id}: no such image")
        return list(reversed(found))

    def info(self) -> dict[str, Any]:
        with self.translating("asking the engine to describe itself"):
            return dict(self.api.info() or {})

    def images_listed(self, *, label: str | None = None, repository: str | None = None,
                      dangling: bool | None = None) -> list[dict[str, Any]]:
        """Top-level images as the engine lists them (``Id``, ``RepoTags``, ``Size``, ``Labels``): those
        carrying ``label`` (``KEY`` or ``KEY=VALUE``), of ``repository``, untagged (``dangling``) or tagged."""
        filters: dict[str, Any] = {}
        if label is not None:
            filters["label"] = [label]
        if dangling is not None:
            filters["dangling"] = dangling
        with self.translating("listing images"):
            return list(self.api.images(name=repository, filters=filters) or [])

    def image_ids(self) -> set[str]:
        """Every image in the engine, intermediate ones included."""
        with self.translating("listing images"):
            return set(self.api.images(all=True, quiet=True))

    def expect_load(self) -> None:
        """Open the next :meth:`load` now (:mod:`.pending_load`): the engine starts unpacking while the
        caller makes the archive. An engine that cannot be reached now is no error here: the run's
        own calls say so."""
        if self._pending_load is not None:
            return
        try:
            api = self.api
        except PipelineError:
            return
        self._pending_load = PendingLoad(api)

    def load(self, archive: bytes) -> list[str]:
        """``docker load`` of a save-format archive; layers the engine has need not be in it.

        Returns what the engine says it loaded (image IDs or names).
        """
        def refused(message: str) -> PipelineError:
            return BuildError(f"the engine refused to load the image: {message}")

        pending, self._pending_load = self._pending_load, None
        with self.translating("loading an image", refused):
            answer = pending.finish(archive) if pending is not None else self.api.load_image(archive, quiet=True)
            messages = [m if isinstance(m, dict) else {"stream": str(m)} for m in answer]
        errors = [str(m.get("error") or m.get("message")) for m in messages if m.get("error") or m.get("message")]
        if errors:
            raise BuildError("the engine refused to load the image: " + "; ".join(errors),
                             log_tail=[str(m.get("stream", "")).strip() for m in messages if m.get("stream")])
        loaded = []
        for m in messages:
            text = str(m.get("stream", "")).strip()
            for prefix in ("Loaded image ID: ", "Loaded image: "):
                if text.startswith(prefix):
                    loaded.append(text.removeprefix(prefix))
        return loaded

    def pull(self, ref: str, progress: Callable[[str], None] | None = None, platform: str | None = None) -> None:
        """Pull ``ref`` (of one ``platform`` when given; only engines from API 1.32 take it)."""
        streams.pull(self, ref, progress, platform)

    def tag(self, image_id: str, ref: str) -> None:
        # The whole reference as `repo`, no `tag`: the engine parses it with
        # its own reference grammar (a missing tag is `latest`).
        with self.translating(f"tagging {image_id} as {ref}"):
            self.api.tag(image_id, ref)

    def untag(self, ref: str) -> None:
        """Remove the tag ``ref`` (the image stays); no such tag is no error."""
        with self._absent_ok(f"removing tag {ref}"):
            self.api.remove_image(ref, noprune=True)

    def remove_image(self, ref: str, force: bool = True) -> None:
        """Remove ``ref``; an image that is gone already, or that others still use (409), is no error.

        Any other refusal is (an engine shutting down answers 500): the caller
        then keeps the image in its note for the next run to remove.
        """
        with self._absent_ok(f"removing image {ref}"):
            try:
                self.api.remove_image(ref, force=force)
            except Exception as exc:
                if status(exc) != 409:
                    raise
                log.warning("could not remove image %s: %s", ref, short(exc))

    def remove_untagged(self, image_id: str, force: bool = True) -> None:
        info = self.image(image_id)
        if info is not None and not info.tags:
            self.remove_image(image_id, force=force)

    def import_rootfs(self, tar_path: str, ref: str, platform: str | None = None) -> ImageInfo:
        """Import a root file system tar as ``ref``; ``platform`` says which one it is.

        The engine's API has taken the platform since 1.32 (Docker 20.10
        accepts it but records its own); the SDK's ``import_image`` does not
        pass it, so this one call is a request of its own over the SDK's session.
        """
        import docker.errors
        import requests.exceptions

        repo, tag = dockerconfig.split_reference(ref)
        operation = f"importing {tar_path} as {ref}"
        params = {"fromSrc": "-", "repo": repo, "tag": tag, **({"platform": platform} if platform else {})}
        with self.translating(operation), open(tar_path, "rb") as fh:
            api = self.api
            res = api.post(f"{api.base_url}/v{api.api_version}/images/create", params=params, data=fh,
                           headers={"Content-Type": "application/tar"}, timeout=self.call_timeout)
            try:
                res.raise_for_status()
            except requests.exceptions.HTTPError as exc:
                docker.errors.create_api_error_from_http_exception(exc)
            said = [json.loads(line) for line in res.content.splitlines() if line.strip().startswith(b"{")]
        errors = [str(m["error"]) for m in said if m.get("error")]
        if errors:
            raise EngineError(f"{operation}: {short('; '.join(errors))}")
        info = self.image(ref)
        if info is None:
            raise EngineError(f"imported {tar_path} but {ref} is missing")
        return info

    def import_stream(self, chunks: Iterable[bytes], ref: str, changes: Sequence[str] = ()) -> ImageInfo:
        """``docker import`` of a tar stream (e.g. a host's own filesystem), with Dockerfile ``changes``."""
        repo, tag = dockerconfig.split_reference(ref)
        with self.translating(f"importing a filesystem as {ref}"):
            self.api.import_image(src=iter(chunks), repository=repo, tag=tag, changes=list(changes), stream_src=True)
        info = self.image(ref)
        if info is None:
            raise EngineError(f"imported a filesystem but {ref} is missing")
        return info

    # -- build and push ----------------------------------------------------

    def build(
        self,
        context: bytes,
        progress: Callable[[str], None] | None = None,
        on_image: Callable[[str], None] | None = None,
        *,
        buildargs: Mapping[str, str] | None = None,
        network: str | None = None,
        nocache: bool = False,
    ) -> str:
        """Build an untagged image from a tar context; return its ID.

        ``buildargs`` fill the Dockerfile's ARGs; ``network`` is the network
        mode of its RUN steps (``host`` lets them reach a server on loopback).

        ``on_image`` hears every image the build commits (each step's and the
        last), before the build goes on, so a run that dies can be cleaned up
        after. If the build fails or is interrupted, the images its steps made
        are removed here, unless other images depend on them.
        """
        return streams.build(self, context, progress, on_image, buildargs or {}, network, nocache)

    def push(self, ref: str, progress: Callable[[str], None] | None = None) -> str:
        """Push ``ref`` with the credentials `docker login` stored; return the manifest digest."""
        return streams.push(self, ref, progress)

    def registry_digest(self, ref: str) -> str:
        """The digest the registry holds for ``ref``, asked through the engine.

        The engine uses the same credentials and scheme (TLS or a trusted
        plain-HTTP registry) as for the push, so this works wherever the push did.
        """
        host = dockerconfig.registry_of(ref)
        with self.translating(f"asking {host} for {ref}",
                              lambda message: registry_errors.push_error(ref, host, message, asking=True)):
            data = self.sdk.api.inspect_distribution(ref)
        digest = (data.get("Descriptor") or {}).get("digest")
        if not digest:
            raise PushError(f"{host} gave no digest for {ref}")
        return str(digest)

    def registry_secure(self, host: str) -> bool:
        """Whether the engine talks TLS to registry ``host`` (its own insecure-registries decide)."""
        return dockerconfig.registry_secure(self.info().get("RegistryConfig") or {}, host)

    # -- what the engine is --------------------------------------------------

    @functools.cached_property
    def _version(self) -> dict[str, Any]:
        with self.translating("asking the engine its version"):
            return dict(self.api.version() or {})

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

    def host_facts(self) -> dict[str, Any]:
        """What a verdict records about the engine that ran it."""
        version = self._version
        return {
            "hostname": socket.gethostname(),
            "engine_version": version.get("Version"),
            "api_version": version.get("ApiVersion"),
            "os": version.get("Os"),
            "arch": version.get("Arch"),
        }

    def facts(self) -> EngineFacts:
        """Version, CDI spec folders (API >= 1.44 lists them) and registered runtimes."""
        info = self.info()
        return EngineFacts(
            server_version=str(self._version.get("Version", "")),
            api_version=str(self._version.get("ApiVersion", "")),
            cdi_spec_dirs=tuple(info.get("CDISpecDirs") or ()),
            runtimes=tuple(sorted(info.get("Runtimes") or {})),
            default_runtime=str(info.get("DefaultRuntime") or ""),
            # Spec files can be read only where the engine's files are ours to read.
            local=self.local,
        )

    # -- containers --------------------------------------------------------

    def box(self, image: str, python: str = "python3", *,
            deadline: float | None = None) -> AbstractContextManager[containers.Box]:
        """A container of ``image`` kept alive by its own Python, removed after (:func:`.containers.box`).

        ``deadline``: seconds each engine call for the box may wait (its execs get their own timeout on top).
        """
        return containers.box(self, image, python, deadline=deadline)

    def run(self, image: str, argv: Sequence[str], *, files: Mapping[str, bytes] | None = None,
            files_at: str = "/tmp", gpu: GpuRequest | None = None, network: str = "none",
            timeout: float = 300, env: Mapping[str, str] | None = None,
            writable: Sequence[tuple[str, str]] = (), mounts: Sequence[tuple[str, str]] = (),
            follow: Callable[[str], None] | None = None, shm_size: str | None = None) -> ExecResult:
        """Run ``argv`` (entrypoint overridden) in a new container and return its output.

        ``writable``: (host folder, container path) bind mounts it may write, e.g. a compile cache;
        ``mounts``: ones it may only read (the runner's folder); ``follow``: each stderr line as it comes;
        ``shm_size``: the size of its /dev/shm (``16g``), where the engine's default 64 MB is too small.
        """
        return containers.run(self, image, argv, files=files, files_at=files_at, gpu=gpu, network=network,
                              timeout=timeout, env=env, writable=writable, mounts=mounts, follow=follow,
                              shm_size=shm_size)

    def overlay_volume(self, lower: Path, upper: Path, work: Path) -> AbstractContextManager[str]:
        """A volume of ``lower`` read-only under the private writable ``upper`` (:func:`.volumes.overlay`), by name;
        give it to :meth:`run` in ``writable`` as a host folder would be."""
        return volumes.overlay(self, lower, upper, work)

    def read_files(self, image: str, paths: Sequence[str],
                   keep: Callable[[str], bool] = lambda _p: False) -> layers.Tree:
        """Entries (hashed) under ``paths`` of ``image``, read from its layers, nothing run (:func:`.files.read`)."""
        return layers.read(self, image, paths, keep)

    def save_stream(self, image: str) -> Iterator[bytes]:
        """``docker save`` of ``image`` as an archive, chunk by chunk (for another store to load)."""
        with self.translating(f"save {image[:19]}"):
            yield from self.api.get_image(image)

    def export_layers(self, image: str) -> Iterator[IO[bytes]]:
        """The layer tars of ``image`` as the engine exports it (``docker save``), streamed (:mod:`.files`)."""
        with self.translating(f"export {image[:19]}"):
            yield from layers.exported_layers(self.api.get_image(image))

    def files(self, image: str) -> AbstractContextManager[layers.Reader]:
        """A reader of ``image``'s filesystem, nothing run, its container removed after (:func:`.files.opened`)."""
        return layers.opened(self, image)

    def _containers(self, label: str) -> list[dict[str, Any]]:
        with self.translating("listing containers"):
            return list(self.api.containers(all=True, filters={"label": [label]}) or [])

    def containers_with_role(self, run_id: str | None = None) -> list[str]:
        """Containers this tool started (and, given run_id, that run)."""
        return [c["Id"] for c in self._containers(f"{labels.RUN}={run_id}" if run_id else labels.ROLE)]

    def containers_by_owner(self) -> dict[str, list[str]]:
        """Containers this tool started, grouped by the owner label (host:pid) of the process."""
        out: dict[str, list[str]] = {}
        for c in self._containers(labels.OWNER):
            out.setdefault((c.get("Labels") or {}).get(labels.OWNER, ""), []).append(c["Id"])
        return out

    def remove_container(self, container_id: str) -> None:
        """Remove it, running or not; one that is gone already is no error."""
        with self._absent_ok(f"removing container {container_id[:12]}"):
            self.api.remove_container(container_id, force=True)
