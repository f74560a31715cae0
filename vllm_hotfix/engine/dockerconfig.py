"""Docker's configuration as the tool needs it: references, stored logins, registries without TLS.

Read the docker way, through the SDK (imported here on first use): references
split by docker-py's own parser, so the tool and the engine never disagree;
logins from DOCKER_CONFIG or ~/.docker/config.json, credential stores and
helpers included; whether a registry is spoken to over TLS from the engine's
own insecure-registries list and CIDRs (which hold 127.0.0.0/8 by default).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import warnings
from collections.abc import Mapping
from typing import Any

from ..errors import PushError, short

# The SDK's words for a credential helper (credsStore / credHelpers) that cannot run.
_HELPER = re.compile(r"docker-credential-([^\s'\"]+) not installed or not available in PATH")
_STORE_ERROR = "Credentials store error"

# The SDK also warns on stderr when a helper is missing; the error says it in one line.
warnings.filterwarnings("ignore", message=r"docker-credential-.* not installed", category=UserWarning)

_AUTH_WORDS = ("no basic auth credentials", "unauthorized", "authentication required", "denied",
               "incorrect username or password")


def split_reference(ref: str) -> tuple[str, str]:
    """Split ``repo[:tag]`` or ``repo@sha256:...`` into repository and tag or digest (``latest`` if none)."""
    import docker.utils

    repo, tag = docker.utils.parse_repository_tag(ref)
    return repo, tag or "latest"


def registry_of(ref: str) -> str:
    """The registry host a reference names (``docker.io`` for Docker Hub names)."""
    import docker.auth

    host, _ = docker.auth.resolve_repository_name(split_reference(ref)[0])
    return "docker.io" if host == docker.auth.INDEX_NAME else str(host)


def registry_credentials(host: str) -> tuple[str, str] | None:
    """The login `docker login HOST` stored, as (username, password-or-token), or None.

    An identity token is returned with the username ``<token>``, as the
    credential helpers spell it.
    """
    import docker.auth
    import docker.errors

    try:
        found = docker.auth.load_config().resolve_authconfig(host)
    except docker.errors.DockerException as exc:
        raise helper_error(exc, host) or PushError(f"cannot read the stored login for {host}: {short(exc)}",
                                                   hint=f"docker login {host}") from exc
    if not found:
        return None
    data = {str(k).lower(): v for k, v in dict(found).items()}
    if data.get("identitytoken"):
        return "<token>", str(data["identitytoken"])
    if data.get("username") is None and data.get("password") is None:
        return None
    return str(data.get("username") or ""), str(data.get("password") or "")


def config_file() -> str:
    """The docker config file logins are read from (DOCKER_CONFIG, else ~/.docker/config.json)."""
    import docker.utils.config

    return str(docker.utils.config.find_config_file() or docker.utils.config.get_default_config_file())


def helper_error(exc: BaseException, host: str | None = None) -> PushError | None:
    """A PushError naming the credential helper ``exc`` says could not run (not installed, or failed); else None."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        text = str(seen)
        if _STORE_ERROR in text or type(seen).__name__ == "StoreError":
            where = f" for {host}" if host else ""
            missing = _HELPER.search(text)
            if missing:
                helper = f"docker-credential-{missing.group(1)}"
                return PushError(
                    f"credential helper {helper}, named{where} in {config_file()}, is not installed "
                    "(or not in PATH)",
                    hint=f"install {helper}, or remove it from credHelpers/credsStore in {config_file()}")
            return PushError(f"the credential helper{where} named in {config_file()} failed: {short(seen)}",
                             hint=f"check the helper, or docker login {host or 'HOST'} again")
        seen = seen.__cause__ or seen.__context__
    return None


def registry_secure(registry_config: Mapping[str, Any], host: str) -> bool:
    """Whether the engine talks TLS to ``host`` (False: a registry it trusts over plain HTTP).

    ``registry_config``: the ``RegistryConfig`` of the engine's ``/info``.
    """
    index = (registry_config.get("IndexConfigs") or {}).get(host)
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
    for cidr in registry_config.get("InsecureRegistryCIDRs") or []:
        net = ipaddress.ip_network(cidr, strict=False)
        if addresses and all(a in net for a in addresses):
            return False
    return True


DAEMON_JSON = "/etc/docker/daemon.json"


def registry_secure_without_engine(host: str, daemon_json: str = DAEMON_JSON) -> bool:
    """Whether ``host`` is spoken to over TLS when no engine is asked: as a Docker engine with this host's
    daemon.json would (its insecure-registries, and loopback, which an engine trusts without TLS by default)."""
    import json

    insecure: list[str] = []
    try:
        with open(daemon_json, encoding="utf-8") as fh:
            found = json.load(fh).get("insecure-registries") or []
        insecure = [str(x) for x in found] if isinstance(found, list) else []
    except (OSError, ValueError, AttributeError):
        pass
    config = {"InsecureRegistryCIDRs": ["127.0.0.0/8", "::1/128", *(x for x in insecure if "/" in x)],
              "IndexConfigs": {x: {"Secure": False} for x in insecure if "/" not in x}}
    return registry_secure(config, host)


def auth_refused(message: str) -> bool:
    """Whether a registry's answer (relayed by the engine) says the login was missing or wrong."""
    low = message.lower()
    return any(word in low for word in _AUTH_WORDS)


def push_error(ref: str, host: str, message: str, *, asking: bool = False) -> PushError:
    """A push (or asking the registry for a digest) that the registry refused."""
    doing = f"asking {host} for {ref}" if asking else f"push of {ref}"
    if auth_refused(message):
        return PushError(
            f"{doing}: registry {host} refused the credentials (not logged in, or wrong login): {message}",
            hint=f"docker login {host}",
        )
    return PushError(f"{doing} failed: {message}")
