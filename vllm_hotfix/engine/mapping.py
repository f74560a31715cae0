"""The one place where what goes wrong between the tool and the engine becomes a PipelineError.

Every engine call runs under :func:`translating`, which names the operation.
An engine that answered and refused becomes the operation's own error
(:class:`EngineError` unless the caller says otherwise, e.g. a refused pull
is a base-image error); an engine that is gone (its socket removed, the
connection refused, reset or cut mid-answer, or silent past the deadline)
becomes :class:`EngineLost`, one line naming the operation. Errors of other
kinds (a bug, an interrupt) pass through untouched.

The Docker SDK, ``requests`` and ``urllib3`` are looked up among the loaded
modules, not imported: an error cannot come from a library nobody loaded,
and the commands that never need the SDK must not pay for importing it.
"""

from __future__ import annotations

import http.client
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import EngineError, EngineLost, PipelineError, short
from .dockerconfig import helper_error
from .model import Refused

LOST_HINT = ("check the engine (docker version); containers and images this run left are removed "
             "by the next run once it answers")
NO_ENGINE_HINT = "start one (make services), or point DOCKER_HOST at a running engine"



def _loaded(module: str, *names: str) -> tuple[type[BaseException], ...]:
    found = sys.modules.get(module)
    return tuple(getattr(found, name) for name in names) if found is not None else ()


def _gone_types() -> tuple[type[BaseException], ...]:
    """Errors that say the engine is not there (any more), not that it refused."""
    return (
        ConnectionError,  # refused, reset, broken pipe
        FileNotFoundError,  # its socket file is gone (an engine stopped with SIGTERM removes it)
        TimeoutError,  # silent past the deadline
        http.client.IncompleteRead,
        http.client.BadStatusLine,  # RemoteDisconnected among them
        *_loaded("requests.exceptions", "ConnectionError", "Timeout", "ChunkedEncodingError"),
        *_loaded("urllib3.exceptions", "ProtocolError", "TimeoutError"),
    )


def _engine_types() -> tuple[type[BaseException], ...]:
    """Errors of talking to an engine at all: the transport's, the SDK's and its libraries'."""
    return (
        OSError,
        http.client.HTTPException,
        *_loaded("docker.errors", "DockerException"),
        *_loaded("requests.exceptions", "RequestException"),
        *_loaded("urllib3.exceptions", "HTTPError"),
    )


def gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says the engine is not answering."""
    kinds = _gone_types()
    seen: BaseException | None = exc
    for _ in range(8):  # the SDK wraps what urllib3 wraps what the socket raised
        if seen is None:
            return False
        if isinstance(seen, kinds):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def lost(operation: str, exc: BaseException) -> EngineLost:
    return EngineLost(f"{operation}: the Docker engine stopped answering ({short(exc)})", hint=LOST_HINT)


def unreachable(address: str, exc: BaseException | str) -> EngineError:
    """No engine answers at ``address`` (and none ever did in this run)."""
    why = getattr(exc, "strerror", None) or short(exc)
    return EngineError(f"no Docker engine answers ({address}: {why})", hint=NO_ENGINE_HINT)


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
    if isinstance(exc, _engine_types()):
        # A credential helper that cannot run is the login's fault whatever the operation (exit 8).
        helper = helper_error(exc) if "docker" in sys.modules else None
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


def refusal(operation: str, status: int, body: bytes, refused: Refused | None = None) -> PipelineError:
    """What an HTTP error answer of the engine becomes."""
    message = short(body) or f"HTTP {status}"
    return refused(message) if refused is not None else EngineError(f"{operation}: {message}")
