"""A registry's failures told apart by status and exception type: transient ones are tried again, others not.

The exceptions are real where this machine can make them without a network
(a refused connection, a silent server and a cut connection on loopback);
a name that does not resolve and the engine's answers are built as the
libraries and the engine make them.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import docker.errors
import pytest
import requests
import urllib3.exceptions

from vllm_hotfix.engine import registry_errors
from vllm_hotfix.engine.registry_errors import FINAL, TRANSIENT, UNREACHABLE, classify
from vllm_hotfix.errors import PushError
from vllm_hotfix.release import push


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, int]]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    try:
        yield server, int(server.getsockname()[1])
    finally:
        server.close()


def _raised(url: str, timeout: float = 2) -> requests.RequestException:
    with pytest.raises(requests.RequestException) as caught:
        requests.get(url, timeout=timeout)
    return caught.value


def test_a_refused_connection_is_unreachable() -> None:
    found = classify(_raised(f"http://127.0.0.1:{_free_port()}/v2/"))
    assert (found.kind, found.why) == (UNREACHABLE, registry_errors.REFUSED)
    assert found.hint("127.0.0.1:5999") == (f"{registry_errors.REFUSED}: check the registry address (127.0.0.1:5999) "
                                            "and that a registry runs there")


def test_a_silent_registry_is_transient(listener: tuple[socket.socket, int]) -> None:
    found = classify(_raised(f"http://127.0.0.1:{listener[1]}/v2/", timeout=0.2))
    assert (found.kind, found.why) == (TRANSIENT, "timed out")


def test_a_connection_cut_before_the_answer_is_transient(listener: tuple[socket.socket, int]) -> None:
    server, port = listener
    cutter = threading.Thread(target=lambda: server.accept()[0].close(), daemon=True)
    cutter.start()
    found = classify(_raised(f"http://127.0.0.1:{port}/v2/"))
    cutter.join(5)  # one connection, cut: a thread left running would keep the CLI tests from forking
    assert found.kind == TRANSIENT and found.hint("x") is None


def test_a_name_that_does_not_resolve_is_unreachable() -> None:
    # As urllib3 2 and requests raise it (built: resolving a name needs a network).
    try:
        try:
            try:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            except socket.gaierror as gai:
                raise urllib3.exceptions.NewConnectionError(None, f"Failed to resolve 'registry.invalid' ({gai})") \
                    from gai
        except urllib3.exceptions.NewConnectionError as conn:
            raise urllib3.exceptions.MaxRetryError(None, "/v2/", conn) from conn  # type: ignore[arg-type]
    except urllib3.exceptions.MaxRetryError as retries:
        wrapped = requests.exceptions.ConnectionError(retries)
        wrapped.__context__ = retries
    assert classify(wrapped) == registry_errors.Failure(UNREACHABLE, registry_errors.NO_NAME)


def _api_error(code: int, message: str) -> docker.errors.APIError:
    response = requests.models.Response()
    response.status_code = code
    response._content = json.dumps({"message": message}).encode()
    try:
        response.raise_for_status()
    except requests.HTTPError as exc:
        try:
            docker.errors.create_api_error_from_http_exception(exc)
        except docker.errors.APIError as api:
            return api
    raise AssertionError("no APIError")


@pytest.mark.parametrize(("code", "kind"), [(503, TRANSIENT), (502, TRANSIENT), (504, TRANSIENT), (500, TRANSIENT),
                                            (429, TRANSIENT), (404, FINAL), (400, FINAL), (401, FINAL)])
def test_the_engines_answer_by_its_status(code: int, kind: str) -> None:
    assert classify(_api_error(code, "something went wrong")) == registry_errors.Failure(kind, f"HTTP {code}")


def test_a_refusal_in_a_5xx_answer_is_final() -> None:
    assert classify(_api_error(500, "denied: requested access to the resource is denied")).kind == FINAL


@pytest.mark.parametrize(("said", "kind", "why"), [
    ("received unexpected HTTP status: 503 Service Unavailable", TRANSIENT, "HTTP 503"),
    ("received unexpected HTTP status: 500 Internal Server Error", TRANSIENT, "HTTP 500"),
    ("received unexpected HTTP status: 404 Not Found", FINAL, "HTTP 404"),
    ("toomanyrequests: too many requests, retry later", TRANSIENT, "HTTP 429"),
    ('Get "http://127.0.0.1:5933/v2/": EOF', TRANSIENT, "connection cut short (EOF)"),
    ("Patch http://r:5000/v2/x/blobs/uploads/1: unexpected EOF", TRANSIENT, "connection cut short (EOF)"),
    ("net/http: TLS handshake timeout", TRANSIENT, "timed out"),
    ("dial tcp 10.0.0.9:443: i/o timeout", TRANSIENT, "timed out"),
    ("write tcp 127.0.0.1:4242->127.0.0.1:5000: write: connection reset by peer", TRANSIENT, "connection reset"),
    ('Get "http://127.0.0.1:45463/v2/": http: server closed idle connection', TRANSIENT, "connection reset"),
    ('Get "http://127.0.0.1:5939/v2/": dial tcp 127.0.0.1:5939: connect: connection refused', UNREACHABLE,
     registry_errors.REFUSED),
    ('Get "https://registry.invalid:5000/v2/": dial tcp: lookup registry.invalid on 10.0.0.53:53: no such host',
     UNREACHABLE, registry_errors.NO_NAME),
    ("denied: requested access to the resource is denied", FINAL, "refused the login"),
    # Words that only look like a transient failure: a digest holding 503, a repository named eof-i/o.
    ("manifest invalid: layer sha256:503eof0 is unknown", FINAL, ""),
    ("name unknown: repository ops/eof-i/o-503 not found", FINAL, ""),
])
def test_the_engines_relayed_words(said: str, kind: str, why: str) -> None:
    pushed = registry_errors.push_error("r:5000/ops/x:1", "r:5000", said)
    assert classify(pushed) == registry_errors.Failure(kind, why)
    assert (pushed.hint is not None and "check the registry address (r:5000)" in pushed.hint) == (kind == UNREACHABLE)


class _Engine:
    """Fails each push with the next of ``failures`` (then succeeds)."""

    def __init__(self, *failures: PushError) -> None:
        self.failures = list(failures)
        self.pushes = 0

    def push(self, ref: str, progress: object = None) -> str:
        self.pushes += 1
        if self.failures:
            raise self.failures.pop(0)
        return "sha256:" + "a" * 64


def test_a_transient_failure_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(push.time, "sleep", lambda _s: None)
    said: list[str] = []
    engine = _Engine(registry_errors.push_error("r/x:1", "r", "received unexpected HTTP status: 503 Service "
                                                "Unavailable"), PushError("push of r/x:1 failed", hint=None))
    engine.failures[1].__cause__ = _api_error(429, "slow down")
    assert push._push_with_retries(engine, "r/x:1", 4, said.append) == "sha256:" + "a" * 64  # type: ignore[arg-type]
    assert engine.pushes == 3
    assert [line for line in said if "transient" in line][0].startswith("    transient registry error (HTTP 503)")


@pytest.mark.parametrize("said", [
    'Get "http://127.0.0.1:5939/v2/": dial tcp 127.0.0.1:5939: connect: connection refused',
    'Get "https://registry.invalid/v2/": dial tcp: lookup registry.invalid on 10.0.0.53:53: no such host',
    "denied: requested access to the resource is denied",
])
def test_an_unreachable_or_refusing_registry_fails_at_once(monkeypatch: pytest.MonkeyPatch, said: str) -> None:
    monkeypatch.setattr(push.time, "sleep", lambda _s: pytest.fail("slept before a retry"))
    engine = _Engine(registry_errors.push_error("r/x:1", "r", said))
    with pytest.raises(PushError) as caught:
        push._push_with_retries(engine, "r/x:1", 4, lambda _l: None)  # type: ignore[arg-type]
    assert engine.pushes == 1 and caught.value.exit_code == 8


def test_a_long_library_message_is_shortened_at_a_word() -> None:
    from vllm_hotfix.engine.registry_errors import shortened

    text = "HTTPConnectionPool(host='127.0.0.1', port=5009): Max retries exceeded with url: /v2/ " + "x" * 40 + \
        " (Caused by NewConnectionError('Failed to establish a new connection'))"
    short = shortened(text, 120)
    assert short.endswith(" ...") and len(short) <= 124
    assert text.startswith(short[:-4]) and text[len(short) - 4] == " "  # cut where a word ends
    assert shortened("a  b\n c") == "a b c"


def test_an_expired_token_is_asked_for_again_once() -> None:
    """A registry's token runs out mid-run (300 s is common): the next 401 gets a new token, once, instead of
    "refused the credentials"; a token refused twice is a refusal."""
    import http.server
    import json
    import threading

    from vllm_hotfix.errors import PushError
    from vllm_hotfix.registry.client import Client

    state = {"current": "t1", "issued": 0, "refuse_all": False}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_a: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            host = f"127.0.0.1:{self.server.server_address[1]}"
            if self.path.startswith("/token"):
                state["issued"] += 1
                body = json.dumps({"token": state["current"]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if self.headers.get("Authorization") == f"Bearer {state['current']}" and not state["refuse_all"]:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(401)
            self.send_header("WWW-Authenticate", f'Bearer realm="http://{host}/token",service="test"')
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = Client(f"127.0.0.1:{server.server_address[1]}", secure=False, credentials=None)
        assert client.manifest("ops/x", "t") is None and state["issued"] == 1
        state["current"] = "t2"  # the first token expired
        assert client.manifest("ops/x", "t") is None and state["issued"] == 2
        state["refuse_all"] = True
        with pytest.raises(PushError, match="refused the credentials"):
            client.manifest("ops/x", "t")
    finally:
        server.shutdown()
        server.server_close()
