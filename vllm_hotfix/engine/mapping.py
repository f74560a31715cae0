"""The one place where what goes wrong between the tool and the engine becomes a PipelineError.

Every engine call runs under :func:`translating`, which names the operation.
An engine that answered and refused (the SDK's ``APIError``) becomes the
operation's own error (:class:`EngineError` unless the caller says
otherwise, e.g. a refused pull is a base-image error); an engine that is
gone (its socket removed, the connection refused, reset or cut mid-answer,
or silent past the deadline) becomes :class:`EngineLost`, one line naming
the operation. Errors of other kinds (a bug, an interrupt) pass through
untouched.

The error classes are those of the Docker SDK and the libraries under it
(``requests``, ``urllib3``), imported on the first error to translate: every
engine call goes through the SDK, and a command that never calls the engine
does not pay for importing it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import EngineError, EngineLost, PipelineError, short
from .dockerconfig import helper_error
from .model import Refused

LOST_HINT = ("check the engine (docker version); containers and images this run left are removed "
             "by the next run once it answers")
NO_ENGINE_HINT = "start one (make services), or point DOCKER_HOST at a running engine"


@functools.cache
def _kinds() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(errors that say the engine is not there any more, errors of talking to an engine at all)."""
    import docker.errors
    import requests.exceptions
    import urllib3.exceptions

    gone_kinds = (
        ConnectionError,  # refused, reset, broken pipe
        FileNotFoundError,  # its socket file is gone (an engine stopped with SIGTERM removes it)
        TimeoutError,  # silent past the deadline
        requests.exceptions.ConnectionError,
        requests.exceptions.Timeout,
        requests.exceptions.ChunkedEncodingError,  # the answer cut mid-stream
        urllib3.exceptions.ProtocolError,
        urllib3.exceptions.TimeoutError,
    )
    engine_kinds = (
        OSError,  # requests' errors, the SDK's APIError among them, are OSErrors too
        docker.errors.DockerException,
        urllib3.exceptions.HTTPError,
    )
    return gone_kinds, engine_kinds


def gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says the engine is not answering."""
    kinds = _kinds()[0]
    seen: BaseException | None = exc
    for _ in range(8):  # the SDK wraps what requests wraps what urllib3 wraps what the socket raised
        if seen is None:
            return False
        if isinstance(seen, kinds):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def status(exc: BaseException) -> int | None:
    """The HTTP status of the engine's refusal ``exc`` (the SDK's ``APIError``), else None."""
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def _why(exc: BaseException | str) -> str:
    """Why, in the socket's or the HTTP client's own words when the SDK's error was raised from theirs.

    ``Connection refused``, ``No such file or directory``, ``Remote end closed
    connection without response``; else the error's own line (a read timeout
    says its deadline there).
    """
    import http.client  # here: with the email parser it pulls in, ~10 ms a command that meets no error never pays

    seen: BaseException | str | None = exc
    for _ in range(8):
        if not isinstance(seen, BaseException):
            break
        if isinstance(seen, OSError) and seen.strerror:
            return str(seen.strerror)
        if isinstance(seen, http.client.HTTPException) and str(seen):
            return short(seen)
        seen = seen.__cause__ or seen.__context__
    return short(exc)


def lost(operation: str, exc: BaseException) -> EngineLost:
    return EngineLost(f"{operation}: the Docker engine stopped answering ({_why(exc)})", hint=LOST_HINT)


def unreachable(address: str, exc: BaseException | str) -> EngineError:
    """No engine answers at ``address`` (and none ever did in this run)."""
    return EngineError(f"no Docker engine answers ({address}: {_why(exc)})", hint=NO_ENGINE_HINT)


def translate(operation: str, exc: BaseException, *, refused: Refused | None = None,
              address: str | None = None) -> PipelineError | None:
    """The PipelineError ``exc`` means for ``operation``; None when it is no engine error at all.

    ``address``: the engine's, given while it has not answered yet in this
    run, so that a missing engine reads as one, not as one lost mid-run.
    """
    if isinstance(exc, PipelineError):
        return exc
    if gone(exc):
        return unreachable(address, exc) if address is not None else lost(operation, exc)
    if isinstance(exc, _kinds()[1]):
        # A credential helper that cannot run is the login's fault whatever the operation (exit 8).
        helper = helper_error(exc)
        if helper is not None:
            return helper
        message = short(exc)
        return refused(message) if refused is not None else EngineError(f"{operation}: {message}")
    return None


@contextmanager
def translating(operation: str, *, refused: Refused | None = None, address: str | None = None) -> Iterator[None]:
    """Run the body as ``operation``: engine errors leave it as PipelineErrors (see :func:`translate`)."""
    try:
        yield
    except Exception as exc:
        mapped = translate(operation, exc, refused=refused, address=address)
        if mapped is None or mapped is exc:
            raise
        raise mapped from exc
