"""A small registry v2 client: read manifests and indexes, put an index.

The engine pushes and pulls images; what it cannot do in the classic image
store is put an index (manifest list) that names one image per platform. This
client does that, and reads a base's index to find each platform's image.

It uses the login `docker login` stored (read by engine/dockerconfig.py, the only
module that reads Docker's configuration), answers a 401 the way registries
ask (Basic, or a Bearer token from the realm in WWW-Authenticate), and uses
plain HTTP only for a registry the engine itself trusts without TLS (its
insecure-registries, which hold loopback by default). Credentials and tokens
never appear in messages.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import requests

from ..engine import Engine, registry_errors
from ..engine.dockerconfig import registry_credentials, registry_of, split_reference
from ..errors import PushError

log = logging.getLogger(__name__)

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
INDEX_TYPES = (DOCKER_LIST, OCI_INDEX)
ACCEPT = ", ".join((OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST))
# (connect, read): a registry that does not answer at all is given up on quickly.
TIMEOUT = (10, 60)
# A read answered with a server error: asked again this many times, after READ_PAUSE s, then twice that.
READ_RETRIES = 2
READ_PAUSE = 0.2


@dataclass(frozen=True)
class Manifest:
    media_type: str
    digest: str
    body: bytes

    @property
    def is_index(self) -> bool:
        return self.media_type in INDEX_TYPES

    def json(self) -> dict[str, Any]:
        data = json.loads(self.body)
        return data if isinstance(data, dict) else {}

    @property
    def size(self) -> int:
        return len(self.body)


@dataclass(frozen=True)
class Child:
    """One platform's entry of an index."""

    digest: str
    media_type: str
    size: int
    os: str
    architecture: str
    variant: str = ""

    def descriptor(self) -> dict[str, Any]:
        plat: dict[str, str] = {"architecture": self.architecture, "os": self.os}
        if self.variant:
            plat["variant"] = self.variant
        return {"mediaType": self.media_type, "size": self.size, "digest": self.digest, "platform": plat}


def sha256(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def split_repo(repo: str) -> tuple[str, str]:
    """``host[:port]/path/name`` -> (host, path/name)."""
    host, _, path = repo.partition("/")
    if not path or ("." not in host and ":" not in host and host != "localhost"):
        raise PushError(f"{repo}: expected HOST[:PORT]/PATH (a registry the client can address)")
    return host, path


_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')


class Client:
    """One registry host, with the login (or none) the user stored for it."""

    def __init__(self, host: str, *, secure: bool, credentials: tuple[str, str] | None) -> None:
        self.host = host
        self.base = f"{'https' if secure else 'http'}://{host}"
        self._credentials = credentials
        self._session = requests.Session()
        self._auth_header: dict[str, tuple[str, str]] = {}  # scope -> header

    def _authorize(self, response: requests.Response, scope: str) -> tuple[str, str]:
        challenge = response.headers.get("WWW-Authenticate", "")
        scheme = challenge.split(" ", 1)[0].lower()
        if scheme == "basic":
            if self._credentials is None:
                raise self._refused("no login stored")
            user, password = self._credentials
            pair = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
            return "Authorization", f"Basic {pair}"
        if scheme == "bearer":
            params = dict(_CHALLENGE.findall(challenge))
            realm = params.pop("realm", "")
            if not realm:
                raise PushError(f"registry {self.host} asked for a token without saying where to get it")
            # A cross-repository mount asks for two scopes at once ("repository:A:pull,push repository:B:pull").
            params["scope"] = scope.split(" ") if " " in scope else scope
            try:
                if self._credentials is not None and self._credentials[0] == "<token>":
                    # An identity token is exchanged by the OAuth2 refresh-token grant, as the docker client does.
                    form = {**params, "grant_type": "refresh_token", "refresh_token": self._credentials[1],
                            "client_id": "vllm-hotfix"}
                    got = self._session.post(realm, data=form, timeout=TIMEOUT)
                else:
                    got = self._session.get(realm, params=params, auth=self._credentials, timeout=TIMEOUT)
            except requests.RequestException as exc:
                raise PushError(f"cannot get a token for {self.host} from its auth server: "
                                f"{type(exc).__name__}") from exc
            if got.status_code in (401, 403):
                raise self._refused(f"the auth server answered {got.status_code}")
            if not got.ok:
                raise PushError(f"auth server of {self.host} answered {got.status_code}")
            try:
                body = got.json()
            except ValueError:
                body = None
            token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else None
            if not token:
                raise PushError(f"auth server of {self.host} gave no token")
            return "Authorization", f"Bearer {token}"
        raise PushError(f"registry {self.host} asks for an authentication scheme the tool does not speak: "
                        f"{scheme or 'none named'}")

    def _refused(self, why: str) -> PushError:
        return PushError(f"registry {self.host} refused the credentials (not logged in, or wrong login): {why}",
                         hint=f"docker login {self.host}")

    def request(self, method: str, path: str, scope: str, **kwargs: Any) -> requests.Response:
        """``path`` under this host (or a whole URL the registry gave, such as an upload's Location).

        A read (GET, HEAD) the registry answers with a server error is asked
        again, twice, after a pause: a registry on its filesystem driver
        answers 500 to a look at a blob or tag another writer is linking at
        that moment (it reads the half-written link), which two hosts
        attaching verdicts to one image at once meet. Writes are not repeated
        here: their callers know whether repeating one is safe.
        """
        for attempt in range(READ_RETRIES + 1):
            res = self._request_once(method, path, scope, **kwargs)
            if method not in ("GET", "HEAD") or res.status_code < 500 or attempt == READ_RETRIES:
                return res
            log.debug("registry %s answered %s to %s %s; asking again", self.host, res.status_code, method, path)
            res.close()
            time.sleep(READ_PAUSE * (attempt + 1))
        raise AssertionError("unreachable")

    def _request_once(self, method: str, path: str, scope: str, **kwargs: Any) -> requests.Response:
        url = path if path.startswith(("http://", "https://")) else f"{self.base}{path}"
        headers = dict(kwargs.pop("headers", {}))
        for attempt in range(2):
            if scope in self._auth_header:
                key, value = self._auth_header[scope]
                headers[key] = value
            try:
                res = self._session.request(method, url, headers=headers, timeout=TIMEOUT, **kwargs)
            except requests.RequestException as exc:
                raise PushError(f"cannot reach registry {self.host}: {registry_errors.in_words(exc)}",
                                hint=registry_errors.classify(exc).hint(self.host)) from exc
            if res.status_code != 401 or attempt == 1:
                break
            res.close()  # the 401 is answered by asking again; its connection goes back to the pool
            if scope in self._auth_header:
                _key, used = self._auth_header.pop(scope)
                if not used.startswith("Bearer "):
                    raise self._refused(f"{method} {path} answered 401 with the login")
                # A token kept from earlier has expired (registries often give 300 s ones, shorter than a long
                # copy): a new one, asked once; a second 401 is a refusal.
            self._auth_header[scope] = self._authorize(res, scope)
        if res.status_code == 401:
            raise self._refused(f"{method} {path} answered 401")
        if res.status_code == 403:
            raise self._refused(f"{method} {path} answered 403 (denied)")
        return res

    def manifest(self, repo: str, reference: str) -> Manifest | None:
        """The manifest or index ``repo:reference`` names, checked against its digest; None if absent."""
        res = self.request("GET", f"/v2/{repo}/manifests/{reference}", f"repository:{repo}:pull",
                           headers={"Accept": ACCEPT})
        if res.status_code == 404:
            return None
        if not res.ok:
            raise PushError(f"registry {self.host} answered {res.status_code} for {repo}:{reference}")
        body = res.content
        digest = sha256(body)
        said = res.headers.get("Docker-Content-Digest")
        if said and said != digest:
            raise PushError(f"registry {self.host} sent {repo}:{reference} with digest {said}, "
                            f"but its bytes hash to {digest}")
        if reference.startswith("sha256:") and reference != digest:
            raise PushError(f"registry {self.host} answered {repo}@{reference} with other bytes ({digest})")
        media = res.headers.get("Content-Type", "").split(";")[0].strip()
        try:
            media = json.loads(body).get("mediaType") or media
        except (ValueError, AttributeError):
            raise PushError(f"registry {self.host} sent a manifest for {repo}:{reference} that is not JSON") \
                from None
        return Manifest(media, digest, body)


def children(index: Manifest) -> list[Child]:
    """The platform entries of an index (attestation entries without a platform left out)."""
    out: list[Child] = []
    for entry in index.json().get("manifests") or []:
        plat = entry.get("platform") or {}
        if not plat.get("architecture") or plat.get("os") in (None, "unknown"):
            continue
        out.append(Child(str(entry["digest"]), str(entry.get("mediaType") or ""), int(entry.get("size") or 0),
                         str(plat["os"]), str(plat["architecture"]), str(plat.get("variant") or "")))
    return out


def index_body(entries: list[Child]) -> tuple[str, bytes]:
    """An index over ``entries``: an OCI index when every child is an OCI manifest, else a Docker manifest
    list (what a classic-store engine pushes, and what every registry that takes its children takes)."""
    media = OCI_INDEX if entries and all(c.media_type == OCI_MANIFEST for c in entries) else DOCKER_LIST
    doc = {"schemaVersion": 2, "mediaType": media, "manifests": [c.descriptor() for c in entries]}
    return media, json.dumps(doc, indent=3).encode() + b"\n"


def client_for(engine: Engine, host: str) -> Client:
    """A client for ``host`` with the engine's scheme and the user's stored login."""
    return Client(host, secure=engine.registry_secure(host), credentials=registry_credentials(host))


class Lookup(NamedTuple):
    """What a reference names in its registry: the client for its host, the repository's path there, and the
    manifest (an index or one image's; None where the registry has no such tag or digest)."""

    client: Client
    path: str
    manifest: Manifest | None


def look_up(engine: Engine, ref: str, reference: str | None = None) -> Lookup:
    """Read ``ref`` (``HOST[:PORT]/PATH:TAG`` or ``...@sha256:...``) from its registry, with the engine's scheme
    and the user's stored login; ``reference``: another tag or digest of the same repository to read instead.

    Raises PushError where the reference names no registry or the registry cannot be read; each caller says
    what an absent manifest means to it."""
    repo, tag = split_reference(ref)
    host, path = split_repo(repo)
    client = client_for(engine, host)
    return Lookup(client, path, client.manifest(path, reference or tag))


def docker_hub(repo: str) -> tuple[Client, str]:
    """A Docker Hub repository's client and path: the API lives on its own host; the login is stored for
    docker.io; a bare name is an official image (``library/``)."""
    path = repo.split("/", 1)[1] if repo.startswith("docker.io/") else repo
    path = path if "/" in path else f"library/{path}"
    return Client("registry-1.docker.io", secure=True, credentials=registry_credentials("docker.io")), path


def read_index(engine: Engine, ref: str) -> Manifest | None:
    """What the registry holds for ``ref`` (an index or a single manifest), or None when it has no such tag."""
    repo, tag = split_reference(ref)
    if registry_of(ref) == "docker.io":
        hub, path = docker_hub(repo)
        return hub.manifest(path, tag)
    host, path = split_repo(repo)
    return client_for(engine, host).manifest(path, tag)
