"""Containers the tool starts: each removed before the call that started it returns, whatever happens.

All three kinds (a probe :func:`box`, a one-shot :func:`run`, a
:func:`service` on host network) live through one :func:`lifetime`: labelled
for leftover sweeps, counted for the run's note, every engine error mapped,
and removed at the end. If the engine is gone when the container should be
removed, the run ends with that one error (unless another is already on its
way out) and its note tells the next run to remove the container.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from .. import interrupts
from ..errors import BaseImageError, EngineError, PipelineError
from . import labels
from .mapping import gone, lost
from .model import ExecResult, GpuRequest, Refused, Seam

log = logging.getLogger(__name__)

EXEC_GRACE = 3  # seconds the engine may take beyond a command's own timeout to answer an exec
_EMULATOR_HINT = ("register qemu on the engine's host: mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc; "
                  "apt-get install qemu-user-static binfmt-support")


def gpu_arguments(gpu: GpuRequest | None) -> dict[str, Any]:
    """Create-time arguments for ``gpu``: a plain translation, the choice is made by the caller."""
    if gpu is None:
        return {}
    import docker.types

    if gpu.way == "cdi":
        return {"device_requests": [docker.types.DeviceRequest(driver="cdi", device_ids=gpu.device.split(","))]}
    if gpu.way == "gpus":
        return {"device_requests": [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]}
    if gpu.way == "runtime":
        # The NVIDIA runtime exposes GPUs by this variable; CUDA images set it, others may not.
        return {"runtime": gpu.runtime, "environment": {"NVIDIA_VISIBLE_DEVICES": "all"}}
    raise EngineError(f"unknown GPU request way {gpu.way!r}")


def extras(gpu: GpuRequest | None, *, env: Mapping[str, str] | None = None,
           writable: Sequence[tuple[str, str]] = (), read_only: Sequence[tuple[str, str]] = (),
           shm_size: str | None = None) -> dict[str, Any]:
    """Create-time arguments for the GPU request, extra environment, bind mounts (host path, container path) and
    the size of /dev/shm (what NCCL needs between the GPUs of a tensor-parallel server)."""
    create = gpu_arguments(gpu)
    if shm_size:
        create["shm_size"] = shm_size
    if env:
        create["environment"] = {**create.get("environment", {}), **env}
    volumes = {src: {"bind": dst, "mode": "ro"} for src, dst in read_only}
    volumes.update({src: {"bind": dst, "mode": "rw"} for src, dst in writable})
    if volumes:
        create["volumes"] = volumes
    return create


def remove(engine: Seam, container_id: str, *, quiet: bool) -> None:
    """Remove a container we started and tell the run's note so.

    A refusal (the engine still busy with it) is tried again twice; one that
    stays is left to the next run's sweep. An engine that is gone is that
    error, unless ``quiet`` (another error is already on its way out).
    """
    for attempt in range(3):
        try:
            engine.remove_container(container_id)
        except PipelineError as exc:
            if gone(exc) and not quiet:
                raise
            if gone(exc) or attempt == 2:
                log.warning("could not remove container %s: %s", container_id[:12], exc)
                return
            time.sleep(0.5)
        else:
            engine.notify(-1)
            return


@contextmanager
def lifetime(engine: Seam, image: str, role: str, operation: str, refused: Refused | None = None,
             **create: Any) -> Iterator[Any]:
    """A created (not started) SDK container of ``image``, removed when the block ends.

    Only the creation runs under the error mapper here: the block's own engine
    calls name their operation themselves, and its other errors are not the engine's.
    """
    name = f"vllm-hotfix-{role}-{uuid.uuid4().hex[:20]}"
    made = False
    try:
        # Counted in the run's note before it is asked for, and asked for with Ctrl-C and SIGTERM held: an
        # interrupt while the engine made it would stop the wait for its answer, and the engine would finish the
        # container after the run had looked for it (left `Created`, its note settled). Held, the answer comes,
        # the container is removed by its ID below, and the interrupt is raised then. An interrupt while the
        # note is written (a slow disk) is held the same way, so the count is settled below too.
        with interrupts.held(), engine.translating(operation, refused):
            engine.notify(+1)
            try:
                container = engine.sdk.containers.create(image, name=name, labels=labels.for_container(role),
                                                          **create)
            except Exception as exc:
                if not gone(exc):
                    engine.notify(-1)  # refused: there is no container (a lost engine may have made one)
                raise
            made = True
        # In the same try as the create: an interrupt between the two blocks would leave the container behind.
        yield container
    except BaseException:
        if made:
            remove(engine, container.id, quiet=True)
        # Not made: refused (the count settled above), or asked twice while the engine made it (the note keeps
        # its count, and the next run's sweep finds the container by its owner label).
        raise
    remove(engine, container.id, quiet=False)


class Box:
    """A running throw-away container to read from, write to and exec in."""

    def __init__(self, engine: Seam, container: Any) -> None:
        self._engine = engine
        self._container = container

    def exec(self, cmd: Sequence[str], *, user: str = "0", timeout: int = 120) -> ExecResult:
        # exec_run has no timeout of its own: wrap the command in one when
        # `timeout` exists in the image, which every Debian-based image has.
        # The engine must answer within that time and a little more.
        limit = timeout + EXEC_GRACE
        with self._engine.deadline(limit), self._engine.translating("running a probe in a container"):
            result = _within(limit, "running a probe in a container",
                             lambda: _exec_demuxed(self._container, ["timeout", str(timeout), *cmd], user))
        out, err = result.output
        stderr = (err or b"").decode("utf-8", "replace")
        if result.exit_code == 124:
            stderr += f"\ntimed out after {timeout} s"
        return ExecResult(result.exit_code, (out or b"").decode("utf-8", "replace"), stderr)

    def write(self, folder: str, files: Mapping[str, bytes]) -> None:
        """Put files (relative path -> bytes) under ``folder``."""
        from ..tarball import tar_bytes

        with self._engine.translating("copying files into a container"):
            self._container.put_archive(folder, tar_bytes(files))


MISREAD_TRIES = 3


def _exec_demuxed(container: Any, argv: list[str], user: str) -> Any:
    """``exec_run`` with stdout and stderr apart. The SDK's reader of the engine's multiplexed answer now and then
    takes the payload's bytes for a frame's header ("ValueError: 105 is not a valid stream", docker-py issue 3160),
    after the command ran: the command is run again (every command a box runs is a probe that reads, or writes
    the same files again), :data:`MISREAD_TRIES` times in all, then an EngineError says so in one line."""
    for attempt in range(1, MISREAD_TRIES + 1):
        try:
            return container.exec_run(argv, user=user, demux=True)
        except ValueError as exc:
            if "is not a valid stream" not in str(exc):
                raise
            log.debug("the engine's answer to an exec was misread (%s); try %d of %d", exc, attempt, MISREAD_TRIES)
            if attempt == MISREAD_TRIES:
                raise EngineError(f"running a probe in a container: the engine's answer could not be read "
                                  f"{MISREAD_TRIES} times ({exc})") from exc
    raise AssertionError("unreachable")


def _within(seconds: float, operation: str, call: Callable[[], Any]) -> Any:
    """``call()``, or the engine lost after ``seconds``.

    The SDK reads an exec's output with an untimed poll on its socket, which
    the client's timeout does not bound: an engine frozen mid-exec would hold
    the run forever. The call runs in a thread of its own; one that the engine
    never answers is left behind (a daemon), and the run ends with one line.
    """
    got: dict[str, Any] = {}

    def target() -> None:
        try:
            got["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            got["error"] = exc

    thread = threading.Thread(target=target, name="engine-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise lost(operation, TimeoutError(f"no answer within {seconds:.0f} s"))
    if "error" in got:
        raise got["error"]
    return got["value"]


def _foreign_arch(image: str, said: str) -> BaseImageError:
    return BaseImageError(f"{image} is for another CPU architecture and the engine's host cannot run it ({said})",
                          hint=_EMULATOR_HINT)


@contextmanager
def box(engine: Seam, image: str, python: str = "python3", *, deadline: float | None = None) -> Iterator[Box]:
    """A container of ``image`` kept alive by its own Python, removed after.

    The entrypoint is always overridden: a vLLM image's own entrypoint would start a server.
    ``deadline``: seconds each engine call for the box may wait (creating,
    starting and removing it; :meth:`Box.exec` gives its command's timeout on top).
    """
    with engine.deadline(deadline), _box(engine, image, python) as made:
        yield made


@contextmanager
def _box(engine: Seam, image: str, python: str) -> Iterator[Box]:
    def refused(message: str) -> PipelineError:
        if "exec format error" in message:
            return _foreign_arch(image, message)
        return EngineError(f"cannot run a container of {image}: {message}")

    operation = f"running a container of {image}"
    with lifetime(engine, image, "probe", operation, refused,
                  entrypoint=[python, "-c", "import time; time.sleep(3600)"], network_mode="none") as container:
        with engine.translating(operation, refused):
            container.start()
            time.sleep(0.05)
            container.reload()
            running = container.status == "running"
            said = "" if running else (container.logs().decode("utf-8", "replace").strip().splitlines()
                                       or ["no output"])[-1]
        if not running:
            if "exec format error" in said:
                raise _foreign_arch(image, said)
            raise BaseImageError(
                f"{python} in {image} exited at once ({said}): is it the image's Python interpreter?",
                hint="set [package] python in the image definition to the image's Python",
            )
        yield Box(engine, container)


def run(engine: Seam, image: str, argv: Sequence[str], *, files: Mapping[str, bytes] | None = None,
        files_at: str = "/tmp", gpu: GpuRequest | None = None, network: str = "none",
        timeout: float = 300, env: Mapping[str, str] | None = None,
        writable: Sequence[tuple[str, str]] = (), mounts: Sequence[tuple[str, str]] = (),
        follow: Callable[[str], None] | None = None, shm_size: str | None = None) -> ExecResult:
    """Run ``argv`` (entrypoint overridden) and return its output; exit code 124 when it ran past ``timeout``.

    ``mounts``: (host folder, container folder) pairs mounted read-only (the runner's folder);
    ``follow``: called with each line of its stderr as it is written (the runner's progress).
    """
    from ..tarball import tar_bytes

    operation = f"running {argv[0]} in {image}"
    with lifetime(engine, image, "smoke", operation, entrypoint=list(argv[:1]), command=list(argv[1:]),
                  network_mode=network, **extras(gpu, env=env, writable=writable, read_only=mounts,
                                                 shm_size=shm_size)) as container, \
            engine.translating(operation):
        if files:
            container.put_archive(files_at, tar_bytes(files))
        container.start()
        reader = _follow(container, follow) if follow is not None else None
        code = _wait(container, timeout)
        if reader is not None:
            reader.join(5)  # the stream ends with the container; a stuck one is left to its daemon thread
        out = container.logs(stdout=True, stderr=False).decode("utf-8", "replace")
        err = container.logs(stdout=False, stderr=True).decode("utf-8", "replace")
        if code == 124:
            err += f"\n(timed out after {timeout:.0f} s)"
        return ExecResult(code, out, err)


# What of a container's stderr is relayed as progress: an image that floods its stderr (its own Python, a
# broken base) would otherwise flood the user's terminal and log with it. The run's outcome never depends on it.
FOLLOW_LINES = 2000
FOLLOW_LINE_CHARS = 2000


def _follow(container: Any, say: Callable[[str], None]) -> threading.Thread:
    """A thread that hands each stderr line of ``container`` to ``say`` until the container ends: at most
    :data:`FOLLOW_LINES` lines of at most :data:`FOLLOW_LINE_CHARS` characters, then one line saying the rest
    is not shown (its last lines still come with the run's outcome)."""
    def read() -> None:
        pending = b""
        shown = 0

        def relay(line: bytes) -> None:
            nonlocal shown
            shown += 1
            if shown <= FOLLOW_LINES:
                text = line.decode("utf-8", "replace")
                say(text if len(text) <= FOLLOW_LINE_CHARS else text[:FOLLOW_LINE_CHARS] + " [...]")
            elif shown == FOLLOW_LINES + 1:
                say(f"    [the container's further output is not shown here: more than {FOLLOW_LINES} lines]")

        try:
            for chunk in container.logs(stdout=False, stderr=True, stream=True, follow=True):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    relay(line)
                if len(pending) > 4 * FOLLOW_LINE_CHARS:  # a line without end: shown cut, never held whole
                    relay(pending)
                    pending = b""
            if pending:
                relay(pending)
        except Exception as exc:  # noqa: BLE001 - progress only: the run's outcome comes from its full log
            log.debug("following %s ended: %s", container.id[:12], exc)

    thread = threading.Thread(target=read, name="follow-" + container.id[:12], daemon=True)
    thread.start()
    return thread


def _wait(container: Any, timeout: float) -> int:
    """The container's exit code, or 124 when it did not end within ``timeout`` (it is removed after)."""
    import requests.exceptions
    import urllib3.exceptions

    try:
        return int(container.wait(timeout=timeout).get("StatusCode", 1))
    except requests.exceptions.ReadTimeout:
        return 124
    except requests.exceptions.ConnectionError as exc:
        # Over a Unix socket the SDK's wait that runs out of time comes as a ConnectionError around urllib3's
        # read timeout: the container outlived its time, the engine did not go away.
        if any(isinstance(a, urllib3.exceptions.ReadTimeoutError) for a in exc.args):
            return 124
        raise
