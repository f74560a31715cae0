"""The runner in a container started by podman: no daemon, GPUs as CDI devices.

Everything goes through the podman CLI as argument lists (never a shell).
Debian's podman (4.3) reads CDI specs from /etc/cdi and /var/run/cdi, so
``nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`` is what a GPU host
needs; the request is ``--device nvidia.com/gpu=all``.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import resource
import shutil
import subprocess
import tarfile
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from ...engine import ImageInfo
from ...engine import labels as L
from ...engine.files import FileFact, FolderReader, Found, exported_layers, scan_tar
from ...errors import BaseImageError, EngineError, RunnerFailed, SmokeError
from ...inimage.runner import MOUNT
from .base import Launched, argv, results
from .plan import shm_size

log = logging.getLogger(__name__)

DEFAULT_DEVICE = "nvidia.com/gpu=all"
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")  # where podman 4.3 reads CDI specs (it has no option for another)


def settle_gpu(mode: str, request: str | None, spec_dirs: Sequence[str] = SPEC_DIRS
               ) -> tuple[str | None, dict[str, str] | None]:
    """The GPU request podman's container gets, or the ``gpu`` check settled here when podman could not give it.

    As the docker launcher: a host whose CDI specs define no such device is
    the host's shortcoming, so ``--gpu auto`` leaves the image GPU-unverified
    and ``--gpu require`` makes the run incomplete (exit 11); podman is never
    asked to start a container with a device it would refuse.
    """
    if mode == "off":
        return None, None
    device = device_of(request or "auto")
    if device is None:
        return None, None
    from ..gpu_access import cdi_devices

    defined, _unreadable = cdi_devices(tuple(d for d in spec_dirs if os.path.isdir(d)))
    if device in defined:
        return f"cdi:{device}", None
    why = (f"podman: no CDI spec in {' or '.join(spec_dirs)} defines {device} (on a GPU host: nvidia-ctk cdi "
           f"generate --output=/etc/cdi/nvidia.yaml)")
    if mode == "require":
        return None, {"status": "incomplete", "detail": f"--gpu require: {why}", "why": why}
    return None, {"status": "skip", "detail": f"{why}: image is GPU-unverified", "why": why}


def device_of(gpu: str | None) -> str | None:
    """The CDI device for a ``--gpu-request``; podman has no other way to hand out GPUs."""
    if not gpu or gpu == "none":
        return None
    way, _, arg = gpu.partition(":")
    if way in ("auto", "gpus"):
        return DEFAULT_DEVICE
    if way == "cdi":
        return arg or DEFAULT_DEVICE
    raise SmokeError(f"--gpu-request {gpu}: podman reaches GPUs through CDI devices only (cdi[:DEVICE])")


CALL_TIMEOUT = 120.0  # seconds podman may take for a call other than the runner's run (inspect, create, rm)
# What podman's own process needs of this one's environment. Nothing else: with env_host=true in
# containers.conf podman hands its whole environment to the container, and a signing key given as env:NAME
# must never get there.
PODMAN_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR", "XDG_RUNTIME_DIR",
              "XDG_CONFIG_HOME", "XDG_DATA_HOME", "CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF",
              "CONTAINERS_REGISTRIES_CONF", "REGISTRIES_CONFIG_PATH", "DBUS_SESSION_BUS_ADDRESS",
              # a remote podman (podman --remote) and its store's settings
              "CONTAINER_HOST", "CONTAINER_CONNECTION", "CONTAINER_SSHKEY", "STORAGE_DRIVER", "STORAGE_OPTS")


# Rootful podman gives a container 1048576 open files and processes unless told otherwise; a runtime
# without CAP_SYS_RESOURCE (podman run inside a container, as CI does) may not raise a limit above its
# own hard one, and runc then refuses to start the container ("error setting rlimits"). podman 4.3 also
# lowers its own process limit to 32768 before it starts the runtime, so no container of it gets more.
PODMAN_NOFILE = 1 << 20
PODMAN_NPROC = 1 << 15


def ulimit_args() -> list[str]:
    """``--ulimit`` options for one container: podman's own values, capped by this host's hard limits.

    Per container, from the limits podman inherits from this process, so no
    host-wide setting (containers.conf) is needed, and a host whose limits
    are higher gets no less than podman would give. Soft and hard alike, as
    podman sets them. A remote podman's host has limits this one cannot see:
    there podman chooses.
    """
    if os.environ.get("CONTAINER_HOST") or os.environ.get("CONTAINER_CONNECTION"):
        return []
    out = []
    for name, which, ceiling in (("nofile", resource.RLIMIT_NOFILE, PODMAN_NOFILE),
                                 ("nproc", resource.RLIMIT_NPROC, PODMAN_NPROC)):
        hard = resource.getrlimit(which)[1]
        value = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
        out += ["--ulimit", f"{name}={value}:{value}"]
    return out


def podman_env() -> dict[str, str]:
    """The environment podman runs with: :data:`PODMAN_ENV` as this process has them, nothing more."""
    return {k: v for k, v in os.environ.items() if k in PODMAN_ENV}


def _remove(podman: PodmanLauncher, name: str) -> None:
    """``podman rm --force NAME``, bounded in time (a container left behind is swept by owner label)."""
    try:
        subprocess.run(podman.command("rm", "--force", name), capture_output=True, check=False,
                       timeout=CALL_TIMEOUT, env=podman_env())
    except subprocess.TimeoutExpired:
        log.warning("podman rm --force %s did not answer within %.0f s", name, CALL_TIMEOUT)


class PodmanLauncher:
    name = "podman"

    def __init__(self, podman: str = "podman", python: str = "python3", timeout: float = 3600,
                 global_args: Sequence[str] = ()) -> None:
        self.podman = podman
        self.python = python
        self.timeout = timeout
        self.global_args = list(global_args)  # e.g. --root/--runroot for a private store

    def command(self, *args: str) -> list[str]:
        return [self.podman, *self.global_args, *args]

    def require(self) -> None:
        """EngineError (exit 5, one line) when podman is not there to run: before any command of it runs."""
        if shutil.which(self.podman) is None:
            raise EngineError(f"podman: {self.podman} is not installed or not on PATH",
                              hint="install podman (apt-get install podman), or use --launcher docker")

    def run_argv(self, image: str, runner_dir: Path, gpu: str | None, model: Path | None, name: str,
                 shm_size: str | None = None) -> list[str]:
        """The ``podman run`` command line, as data (``shm_size``: /dev/shm of a tensor-parallel server's run)."""
        cmd = self.command("run", "--rm", "--name", name, "--network", "none", "--pull", "never",
                           "--label", f"{L.OWNER}={L.owner()}", "--entrypoint", self.python,
                           "--volume", f"{runner_dir}:{MOUNT}:ro")
        if "--remote" not in self.global_args:
            cmd += ulimit_args()
        if shm_size:
            cmd += ["--shm-size", shm_size]
        if model is not None:
            cmd += ["--volume", f"{model}:/model:ro"]
        device = device_of(gpu)
        if device is not None:
            cmd += ["--device", device]
        return [*cmd, image, *argv(self.python)[1:]]

    def launch(self, image: str, runner_dir: Path, job: Mapping[str, Any], gpu: str | None,
               model: Path | None = None) -> Launched:
        self.require()
        name = f"vllm-hotfix-runner-{uuid.uuid4().hex[:12]}"
        cmd = self.run_argv(image, runner_dir, gpu, model, name, shm_size(job))
        log.debug("running %s", cmd)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=self.timeout,
                                  env=podman_env())
        except subprocess.TimeoutExpired:
            _remove(self, name)
            raise RunnerFailed(f"the runner in {image} (podman) did not finish within {self.timeout:.0f} s",
                               incomplete=True,
                               hint="its Python may hang; give it longer with --deadline S if it is only slow") \
                from None
        if done.returncode in (125, 126, 127) and "@@vllm-hotfix-runner" not in done.stdout:
            # podman's own failures: the image missing, a CDI device unknown, a runtime refusing.
            said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            raise EngineError(f"podman could not run {image}: {said}")
        return results(done.stdout, done.stderr, f"runner in {image} (podman)")

    def _call(self, *args: str, stdin: IO[bytes] | None = None, timeout: float = CALL_TIMEOUT
              ) -> subprocess.CompletedProcess[str]:
        self.require()
        try:
            return subprocess.run(self.command(*args), stdin=stdin, capture_output=True, text=True,
                                  errors="replace", timeout=timeout, env=podman_env())
        except subprocess.TimeoutExpired:
            raise EngineError(f"podman {args[0]} {args[1] if len(args) > 1 else ''} did not answer within "
                              f"{timeout:.0f} s") from None

    def has_image(self, image: str) -> bool:
        return self._call("image", "exists", image).returncode == 0

    def image_id(self, image: str) -> str:
        done = self._call("image", "inspect", "--format", "{{.Id}}", image)
        return "sha256:" + done.stdout.strip().removeprefix("sha256:") if done.returncode == 0 else ""

    def load(self, tar_chunks: Iterator[bytes], image: str) -> None:
        """``podman load`` of an image archive (``docker save``'s), piped chunk by chunk, never held whole."""
        self.require()
        with tempfile.TemporaryFile(prefix="vllm-hotfix-podman-load-") as said:
            proc = subprocess.Popen(self.command("load"), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=said, env=podman_env())
            assert proc.stdin is not None
            try:
                try:
                    for chunk in tar_chunks:
                        proc.stdin.write(chunk)
                except BrokenPipeError:
                    pass  # podman stopped reading: its exit status and words say why
                finally:
                    proc.stdin.close()
                code = proc.wait(timeout=max(CALL_TIMEOUT, self.timeout))
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            if code != 0:
                said.seek(0)
                last = (said.read().decode("utf-8", "replace").strip().splitlines() or [f"exit {code}"])[-1]
                raise EngineError(f"podman load of {image} failed: {last}")

    def pull(self, by_digest: str, image: str) -> None:
        """``podman pull NAME@sha256:...``, then tagged ``image`` (the name the run was asked for)."""
        done = self._call("pull", "--quiet", by_digest, timeout=max(CALL_TIMEOUT, self.timeout))
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            raise BaseImageError(f"podman could not pull {by_digest}: {said}")
        tagged = self._call("tag", by_digest, image)
        if tagged.returncode != 0:
            raise EngineError(f"podman tag {by_digest} {image}: {(tagged.stderr.strip().splitlines() or ['?'])[-1]}")

    def images_labelled(self, label: str) -> list[tuple[str, tuple[str, ...], int]]:
        """The images of podman's store carrying ``label``: (ID, names, size in bytes) each."""
        done = self._call("images", "--filter", f"label={label}", "--format", "json")
        if done.returncode != 0:
            raise EngineError(f"podman images: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        listed = json.loads(done.stdout or "[]") or []
        return [("sha256:" + str(i.get("Id", "")).removeprefix("sha256:"), tuple(i.get("Names") or ()),
                 int(i.get("Size") or 0)) for i in listed]

    def remove_image(self, image_id: str) -> bool:
        """``podman rmi`` of ``image_id`` (every name of it); False where podman keeps it (a container uses it)."""
        return self._call("rmi", image_id.removeprefix("sha256:")).returncode == 0

    def image_facts(self, image: str) -> dict[str, Any]:
        """``podman image inspect`` of ``image``; BaseImageError (exit 4, as under docker) when podman lacks it."""
        self.require()
        try:
            done = subprocess.run(self.command("image", "inspect", image), capture_output=True, text=True,
                                  errors="replace", timeout=CALL_TIMEOUT, env=podman_env())
        except subprocess.TimeoutExpired:
            raise EngineError(f"podman image inspect {image} did not answer within {CALL_TIMEOUT:.0f} s") from None
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["no such image"])[-1]
            raise BaseImageError(f"podman has no image {image}: {said}",
                              hint="neither the Docker engine nor the journal had it to move there: podman pull "
                                   "NAME@sha256:... (or build it with `image` on this host)")
        found = json.loads(done.stdout)
        return dict(found[0]) if found else {}


# A created container's entrypoint: never started, and inert even if someone started it.
NEVER_STARTED = "/nonexistent-vllm-hotfix-never-started"


class PodmanFiles:
    """Files of an image in podman's store, read without running it (an
    :class:`~vllm_hotfix.sitefacts.site.FileSource`).

    As the Docker engine's reader (:mod:`vllm_hotfix.engine.files`) does: a
    container is created and never started, each folder comes out of it as a
    tar stream (``podman cp CTR:PATH -``) parsed by the same
    :func:`~vllm_hotfix.engine.files.scan_tar`, and the container is removed
    whatever happens. So where podman starts the image, its file facts are
    read from the copy podman starts, with no Docker engine involved.

    One difference: ``podman cp`` follows a link named as the path itself
    (never one inside the folder). A followed link whose target has another
    name shows as such and is reported as a link; one whose target has the
    same name reads as the folder it points to.
    """

    def __init__(self, podman: PodmanLauncher) -> None:
        self.podman = podman

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        self.podman.require()
        try:
            return subprocess.run(self.podman.command(*args), capture_output=True, text=True, errors="replace",
                                  timeout=timeout, env=podman_env())
        except subprocess.TimeoutExpired:
            raise EngineError(f"podman {args[0]} did not answer within {timeout:.0f} s") from None

    def image(self, ref: str) -> ImageInfo | None:
        """The image as podman's store holds it (its ID as the Docker engine writes it); None if absent."""
        done = self._run("image", "inspect", ref)
        if done.returncode != 0:
            return None
        try:
            found = json.loads(done.stdout)
            attrs = dict(found[0])
            attrs["Id"] = "sha256:" + str(attrs["Id"]).removeprefix("sha256:")
        except (ValueError, LookupError, TypeError) as exc:
            raise EngineError(f"podman image inspect {ref}: unreadable answer ({exc})") from None
        return ImageInfo.from_inspect(attrs)

    def export_layers(self, image: str) -> Iterator[IO[bytes]]:
        """The layer tars of ``image`` as ``podman save`` streams them (docker-archive format)."""
        self.podman.require()
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(self.podman.command("save", "--format", "docker-archive", image),
                                    stdout=subprocess.PIPE, stderr=err, env=podman_env())
            assert proc.stdout is not None
            try:
                yield from exported_layers(iter(lambda: proc.stdout.read(1 << 20), b""))  # type: ignore[union-attr]
            finally:
                proc.stdout.close()
                code = proc.wait()
            err.seek(0)
            if code != 0:
                said = (err.read().decode("utf-8", "replace").strip().splitlines() or [f"exit {code}"])[-1]
                raise EngineError(f"podman save {image}: {said}")

    @contextmanager
    def files(self, image: str) -> Iterator[PodmanReader]:
        """A reader of ``image``'s filesystem; its container (created, never started) removed after."""
        name = f"vllm-hotfix-read-{uuid.uuid4().hex[:12]}"
        done = self._run("create", "--name", name, "--pull", "never", "--network", "none",
                         "--label", f"{L.OWNER}={L.owner()}", "--entrypoint", NEVER_STARTED, image)
        try:
            if done.returncode != 0:
                said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
                raise EngineError(f"cannot read the files of {image} through podman: {said}")
            yield PodmanReader(self.podman, image, name)
        finally:
            # Also after a failed create: podman may have made the container before failing.
            _remove(self.podman, name)


class PodmanReader(FolderReader):
    """Reads folders of one created (never started) podman container."""

    def __init__(self, podman: PodmanLauncher, image: str, container: str) -> None:
        super().__init__(image, "podman")
        self.podman = podman
        self.container = container

    def _one(self, path: str, keep: Callable[[str], bool]) -> Found | None:
        parent, name = posixpath.split(path)
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(self.podman.command("cp", f"{self.container}:{path}", "-"),
                                    stdout=subprocess.PIPE, stderr=err, env=podman_env())
            assert proc.stdout is not None
            try:
                found = scan_tar(proc.stdout, parent, keep)
                failure: str | None = None
            except tarfile.TarError as exc:
                found, failure = ({}, {}), str(exc)
            finally:
                proc.stdout.close()
                code = proc.wait()
            err.seek(0)
            said = err.read().decode("utf-8", "replace").strip()
        if code != 0:
            if "no such file or directory" in said or "could not be found" in said:
                return None
            last = (said.splitlines() or [f"exit {code}"])[-1]
            raise EngineError(f"cannot read {path} of {self._image} through podman: {last}")
        if failure is not None:
            raise EngineError(f"podman's archive of {path} in {self._image} is not a readable tar: {failure}")
        entries, kept = found
        if path not in entries and entries:
            # podman followed a link named as the path itself: the image holds a link there, not this folder.
            top = min(entries, key=len)
            return {path: FileFact(path, "link", target=posixpath.basename(top))}, {}
        return entries, kept
