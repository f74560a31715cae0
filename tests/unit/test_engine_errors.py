"""The engine seam's error mapper and container lifetime, without an engine.

The SDK is made to raise what a real engine produces only at random moments
(a connection cut mid-answer, a socket file that vanished): each must leave
the seam as one EngineError line naming the operation, a gone engine as
EngineLost, and nothing else may be caught.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker.errors
import pytest
import requests.exceptions
import urllib3.exceptions

from vllm_hotfix.engine import Engine, facade
from vllm_hotfix.engine.mapping import translate, translating
from vllm_hotfix.errors import BaseImageError, EngineError, EngineLost, PipelineError


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and len(text) < 600, text
    return text


@pytest.mark.parametrize("raised", [
    requests.exceptions.ConnectionError("('Connection aborted.', ConnectionResetError(104, 'reset by peer'))"),
    urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead(0 bytes read)"),
    FileNotFoundError(2, "No such file or directory"),
    ConnectionRefusedError(111, "Connection refused"),
    requests.exceptions.ReadTimeout("UnixHTTPConnectionPool: Read timed out. (read timeout=120)"),
    TimeoutError("timed out"),
])
def test_a_gone_engine_is_engine_lost_naming_the_operation(raised: Exception) -> None:
    with pytest.raises(EngineLost) as caught, translating("removing container abc123"):
        raise raised
    assert _one_line(caught.value).startswith("removing container abc123: the Docker engine stopped answering (")
    assert caught.value.exit_code == 5 and caught.value.__cause__ is raised


def test_an_sdk_error_wrapping_a_gone_engine_is_lost() -> None:
    try:
        try:
            raise requests.exceptions.ConnectionError("Connection refused")
        except requests.exceptions.ConnectionError as inner:
            raise docker.errors.DockerException(f"Error while fetching server API version: {inner}") from inner
    except docker.errors.DockerException as exc:
        mapped = translate("pinging the engine", exc)
    assert isinstance(mapped, EngineLost)


def test_before_the_engine_ever_answered_a_missing_socket_is_no_engine() -> None:
    mapped = translate("inspecting image x", FileNotFoundError(2, "No such file or directory"),
                       address="unix:///nonexistent/docker.sock")
    assert isinstance(mapped, EngineError) and not isinstance(mapped, EngineLost)
    assert str(mapped) == "no Docker engine answers (unix:///nonexistent/docker.sock: No such file or directory)"
    assert mapped.hint and "make services" in mapped.hint


def test_a_refusal_is_the_operations_error() -> None:
    refusal = docker.errors.APIError("500 Server Error", explanation='{"message": "conflict:\\n in use"}')
    mapped = translate("removing image x", refusal)
    assert type(mapped) is EngineError and str(mapped) == "removing image x: conflict: in use"
    mapped = translate("pulling x", refusal, refused=lambda m: BaseImageError(f"cannot pull base image x: {m}"))
    assert isinstance(mapped, BaseImageError) and str(mapped) == "cannot pull base image x: conflict: in use"


def test_errors_that_are_not_the_engines_pass_untouched() -> None:
    with pytest.raises(KeyError), translating("reading"):
        raise KeyError("a bug")
    own = BaseImageError("the base is wrong")
    with pytest.raises(BaseImageError) as caught, translating("reading"):
        raise own
    assert caught.value is own


# -- a container whose engine vanishes before it is removed ----------------------------


class _Container:
    id = "abc123def4567890"
    status = "running"

    def start(self) -> None:
        pass

    def reload(self) -> None:
        pass


class _Sdk:
    """The SDK's low-level client of a socket path, with just enough of the high-level one to create a container."""

    def __init__(self, path: str, timeout: float) -> None:
        self.containers = self
        # The API version given: the client asks the engine nothing before the first call.
        self.api = docker.APIClient(base_url=f"unix://{path}", version="1.41", timeout=timeout)

    def close(self) -> None:
        self.api.close()

    def create(self, image: str, **_kwargs: Any) -> _Container:
        return _Container()


@pytest.fixture
def vanished(tmp_path: Path) -> Iterator[tuple[Engine, list[int]]]:
    """An engine that answered (its SDK client exists) and whose socket file is gone since."""
    path = str(tmp_path / "docker.sock")
    engine = Engine(base_url=f"unix://{path}", timeout=2, client=_Sdk(path, 2))
    changes: list[int] = []
    engine.on_container = changes.append
    yield engine, changes
    engine.close()


def test_engine_gone_while_a_container_is_removed_is_one_line(vanished: tuple[Engine, list[int]]) -> None:
    engine, changes = vanished
    with pytest.raises(EngineLost) as caught, engine.box("some-image"):
        pass
    assert _one_line(caught.value) == (
        "removing container abc123def456: the Docker engine stopped answering (No such file or directory)")
    # Not counted as removed: the run's note sends the next run to remove it.
    assert changes == [+1]


def test_engine_gone_at_removal_leaves_the_first_error_on_its_way(vanished: tuple[Engine, list[int]]) -> None:
    engine, changes = vanished
    with pytest.raises(BaseImageError, match="the patch is wrong"), engine.box("some-image"):
        raise BaseImageError("the patch is wrong")
    assert changes == [+1]


def test_a_refused_create_counts_no_container(vanished: tuple[Engine, list[int]]) -> None:
    engine, changes = vanished

    def refuse(image: str, **_kwargs: Any) -> None:
        raise docker.errors.APIError("400 Client Error", explanation="unknown or invalid runtime name: nvidia")

    engine.sdk.create = refuse
    with pytest.raises(PipelineError, match="unknown or invalid runtime name"):
        engine.run("some-image", ["true"])
    assert changes == [+1, -1]



def test_no_engine_at_the_socket_is_one_line_not_a_lost_engine() -> None:
    engine = Engine.connect(base_url="unix:///nonexistent/docker.sock", ping=False)
    with pytest.raises(EngineError) as caught:
        engine.image("x")
    assert not isinstance(caught.value, EngineLost)
    assert str(caught.value) == "no Docker engine answers (unix:///nonexistent/docker.sock: No such file or directory)"


# -- the deadline of every call ---------------------------------------------------------


@pytest.fixture
def frozen(tmp_path: Path) -> Iterator[str]:
    """A socket that accepts connections and never answers (an engine stopped with SIGSTOP): its path."""
    path = str(tmp_path / "frozen.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    server.settimeout(0.05)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    # Ended and joined after the test: a thread left running would keep the CLI tests from forking.
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        done.set()
        thread.join(5)
        server.close()
        for conn in held:
            conn.close()


def test_a_frozen_engine_ends_the_first_call_at_its_deadline(frozen: str) -> None:
    """Frozen before it ever answered: the SDK's version question ends at the deadline; no engine answers."""
    engine = Engine(base_url=f"unix://{frozen}", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(EngineError) as caught:
        engine.image("x")
    assert time.monotonic() - started < 5
    assert not isinstance(caught.value, EngineLost)
    assert _one_line(caught.value).startswith(f"no Docker engine answers (unix://{frozen}: ")
    assert "timed out" in str(caught.value)


def test_an_engine_frozen_mid_run_is_lost_at_the_deadline_and_later_calls_wait_less(frozen: str) -> None:
    engine = Engine(base_url=f"unix://{frozen}", timeout=0.5, client=_Sdk(frozen, 0.5))
    try:
        with pytest.raises(EngineLost) as caught:
            engine.image("x")
        assert _one_line(caught.value).startswith("inspecting image x: the Docker engine stopped answering (")
        assert "timed out" in str(caught.value)
        # Within a longer deadline too, a lost engine gets only LOST_DEADLINE per call.
        with engine.deadline(30):
            assert engine.call_timeout == min(0.5, facade.LOST_DEADLINE)
            assert engine.sdk.api.timeout == engine.call_timeout
    finally:
        engine.close()


def test_a_lost_engine_is_told_in_the_socket_or_http_clients_words() -> None:
    """What the SDK wraps (requests wraps urllib3 wraps the socket's or http.client's error) reads as the latter."""
    import http.client

    for inner, words in ((http.client.RemoteDisconnected("Remote end closed connection without response"),
                          "Remote end closed connection without response"),
                         (ConnectionResetError(104, "Connection reset by peer"), "Connection reset by peer")):
        try:
            try:
                try:
                    raise inner
                except Exception as exc:
                    raise urllib3.exceptions.ProtocolError("Connection aborted.", exc) from exc
            except urllib3.exceptions.ProtocolError as exc:
                raise requests.exceptions.ConnectionError(exc) from exc
        except requests.exceptions.ConnectionError as exc:
            mapped = translate("removing container abc123", exc)
        assert str(mapped) == f"removing container abc123: the Docker engine stopped answering ({words})"


class _Misreading:
    """A container whose exec answers the SDK misreads ``misreads`` times first (docker-py issue 3160: an error
    path the real engine produces only now and then, so a stand-in for the container object, nothing more)."""

    def __init__(self, misreads: int, error: str = "105 is not a valid stream") -> None:
        self.misreads, self.error, self.calls = misreads, error, 0

    def exec_run(self, argv: list[str], user: str, demux: bool) -> Any:
        from docker.models.containers import ExecResult

        self.calls += 1
        if self.calls <= self.misreads:
            raise ValueError(self.error)
        return ExecResult(0, (b"out", b""))


def test_an_exec_answer_the_sdk_misreads_is_asked_again_then_named_in_one_line() -> None:
    from vllm_hotfix.engine import containers

    twice = _Misreading(2)
    assert containers._exec_demuxed(twice, ["true"], "0").output == (b"out", b"")
    assert twice.calls == 3
    always = _Misreading(containers.MISREAD_TRIES)
    with pytest.raises(EngineError, match=r"^running a probe in a container: the engine's answer could not be read"):
        containers._exec_demuxed(always, ["true"], "0")
    other = _Misreading(1, "invalid literal")  # any other ValueError is no misread: it passes untouched
    with pytest.raises(ValueError, match="invalid literal"):
        containers._exec_demuxed(other, ["true"], "0")
    assert other.calls == 1
