"""What went wrong between a registry and the engine (or this tool), told apart by kind.

Trying again helps only some failures:

- ``transient``: the registry answered 429 or a 5xx, or the connection timed
  out, was reset, closed under a request or cut short (EOF): a registry
  restarting or overloaded;
- ``unreachable``: its name does not resolve, or nothing listens at its
  address: the address is wrong or no registry runs there, and waiting does
  not change that, so the error says so at once, with a hint;
- ``final``: anything else (a refused login, a denied push, an invalid
  manifest) is the registry's answer.

The kind is read from the exception where there is one: the SDK's
``APIError`` and its HTTP status, the exception types of requests and
urllib3, the socket's own errors. A push is different: the engine relays a
registry's failure as one line of text written with Go's fixed phrasings
(``received unexpected HTTP status: 503 Service Unavailable``, ``dial tcp:
lookup HOST on DNS: no such host``, ``connect: connection refused``). Those
lines are parsed here, each pattern anchored to its phrasing, so a digest or
a repository name that happens to hold ``503`` or ``eof`` is not mistaken
for one.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

from ..errors import PushError
from .mapping import status

TRANSIENT, UNREACHABLE, FINAL = "transient", "unreachable", "final"
# Statuses a registry (or a proxy before it) answers while restarting or overloaded.
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
NO_NAME, REFUSED = "its name does not resolve", "nothing accepts connections at its address"

# The engine's relayed words, by Go's phrasings (distribution's client, net, net/http, io).
_STATUS = re.compile(r"\bunexpected HTTP status: (\d{3})\b")
# Registry error codes as the engine writes them ("code: message"), after whatever it says first ("...: ").
_CODE = re.compile(r"(?:^|: )(toomanyrequests|unavailable): ", re.IGNORECASE)
_NO_NAME = re.compile(r"\blookup \S+(?: on \S+)?: (?:no such host|server misbehaving|"
                      r"Temporary failure in name resolution)\b")
_REFUSED = re.compile(r"\bconnect: connection refused\b")
_TIMEOUT = re.compile(r"\b(?:i/o timeout|TLS handshake timeout|Client\.Timeout exceeded|context deadline exceeded)\b")
# Go's net/http says "server closed idle connection" when the registry closed a kept-alive connection the
# client was about to reuse: cut as a reset is.
_RESET = re.compile(r"\b(?:connection reset by peer|broken pipe|http: server closed idle connection)\b")
_EOF = re.compile(r"(?:^|: )(?:unexpected )?EOF$")
_AUTH = re.compile(r"(?:^|: )(?:unauthorized|denied|forbidden): |\bno basic auth credentials\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Failure:
    """A registry failure's kind, and why in a few words (``HTTP 503``, ``timed out``)."""

    kind: str
    why: str = ""

    @property
    def transient(self) -> bool:
        return self.kind == TRANSIENT

    def hint(self, host: str) -> str | None:
        """What to do about an unreachable registry; None for the other kinds."""
        if self.kind != UNREACHABLE:
            return None
        return f"{self.why}: check the registry address ({host}) and that a registry runs there"


def from_message(message: str) -> Failure | None:
    """The kind the engine's relayed words name; None when they name none."""
    text = " ".join(message.split())
    if _AUTH.search(text):
        return Failure(FINAL, "refused the login")
    if _NO_NAME.search(text):
        return Failure(UNREACHABLE, NO_NAME)
    if _REFUSED.search(text):
        return Failure(UNREACHABLE, REFUSED)
    found = _STATUS.search(text)
    if found:
        code = int(found.group(1))
        return Failure(TRANSIENT if code in TRANSIENT_STATUSES else FINAL, f"HTTP {code}")
    code_word = _CODE.search(text)
    if code_word:
        return Failure(TRANSIENT, "HTTP 429" if code_word.group(1).lower() == "toomanyrequests" else "HTTP 503")
    if _TIMEOUT.search(text):
        return Failure(TRANSIENT, "timed out")
    if _RESET.search(text):
        return Failure(TRANSIENT, "connection reset")
    if _EOF.search(text):
        return Failure(TRANSIENT, "connection cut short (EOF)")
    return None


def _from_type(exc: BaseException) -> Failure | None:
    """The kind one exception's type (not its words) names; None when its type names none."""
    import requests.exceptions
    import urllib3.exceptions

    if isinstance(exc, socket.gaierror) or isinstance(exc, getattr(urllib3.exceptions, "NameResolutionError", ())):
        return Failure(UNREACHABLE, NO_NAME)
    if isinstance(exc, ConnectionRefusedError):
        return Failure(UNREACHABLE, REFUSED)
    if isinstance(exc, (TimeoutError, requests.exceptions.Timeout, urllib3.exceptions.TimeoutError)):
        return Failure(TRANSIENT, "timed out")
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return Failure(TRANSIENT, "connection reset")
    if isinstance(exc, (requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError)):
        return Failure(TRANSIENT, "connection cut short")
    return None


def shortened(text: str, limit: int = 300) -> str:
    """``text`` on one line, cut at a word boundary (with " ...") when longer than ``limit``."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    cut = flat.rfind(" ", 0, limit)
    return flat[:cut if cut > 0 else limit] + " ..."


def in_words(exc: BaseException) -> str:
    """Why a registry could not be read, for one line: the kind in words where it is known ("nothing accepts
    connections at its address"), else the library's message shortened at a word, never cut inside one."""
    return classify(exc).why or shortened(f"{type(exc).__name__}: {exc}")


def classify(exc: BaseException) -> Failure:
    """The kind of a registry failure: by the types of the exception and those it was raised from,
    an HTTP status it carries, or the engine's words it holds, in that order."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    # The deepest cause first: a socket's refusal wrapped in requests' ConnectionError is a refusal.
    for one in reversed(chain):
        found = _from_type(one)
        if found is not None:
            return found
    for one in chain:
        words = from_message(str(getattr(one, "explanation", None) or one))
        if words is not None:
            return words
        code = status(one)
        if code is not None:
            return Failure(TRANSIENT if code in TRANSIENT_STATUSES else FINAL, f"HTTP {code}")
    return Failure(FINAL)


# -- the error a push (or a digest asked through the engine) leaves with -------------------

_AUTH_WORDS = ("no basic auth credentials", "unauthorized", "authentication required", "denied",
               "incorrect username or password")


def auth_refused(message: str) -> bool:
    """Whether a registry's answer (relayed by the engine) says the login was missing or wrong."""
    low = message.lower()
    return any(word in low for word in _AUTH_WORDS)


def push_error(ref: str, host: str, message: str, *, asking: bool = False) -> PushError:
    """A push (or asking the registry for a digest) that the registry refused or could not be reached for.

    A registry whose name does not resolve, or where nothing accepts
    connections, gets a hint to check its address.
    """
    doing = f"asking {host} for {ref}" if asking else f"push of {ref}"
    if auth_refused(message):
        return PushError(
            f"{doing}: registry {host} refused the credentials (not logged in, or wrong login): {message}",
            hint=f"docker login {host}",
        )
    found = from_message(message)
    return PushError(f"{doing} failed: {message}", hint=found.hint(host) if found is not None else None)
