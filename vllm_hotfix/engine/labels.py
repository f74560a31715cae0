"""Every label key the tool writes or reads, and the labels its containers get.

Images the tool builds carry their provenance (base, definition, patches,
files, pins) under ``io.vllm-hotfix.*``; stand-in bases and bench images carry
their own keys; every container the tool starts is labelled with its role and
its owner (``host:pid``), so that a run that died can be cleaned up after by
the next one (:mod:`vllm_hotfix.journal.leftovers`). The keys live here, once.
"""

from __future__ import annotations

import os
import socket

PREFIX = "io.vllm-hotfix"

# Built images: what they were made from and of (render.labels writes them).
OCI_BASE_NAME = "org.opencontainers.image.base.name"
OCI_BASE_DIGEST = "org.opencontainers.image.base.digest"
BASE_ID = f"{PREFIX}.base.id"
DEFINITION = f"{PREFIX}.definition"
PACKAGE = f"{PREFIX}.package"
PACKAGE_VERSION = f"{PREFIX}.package.version"
SITE_DIR = f"{PREFIX}.site-dir"
PATCHES = f"{PREFIX}.patches"
FILES = f"{PREFIX}.files"
TOOL_VERSION = f"{PREFIX}.tool.version"
PINS = f"{PREFIX}.pins"
PINS_SHA256 = f"{PREFIX}.pins.sha256"
PINS_ACCEPTED = f"{PREFIX}.pins.accepted"

# Stand-in bases (standin.py).
STANDIN = f"{PREFIX}.standin"
STANDIN_ROOTFS = f"{PREFIX}.standin.rootfs"
STANDIN_DEPS = f"{PREFIX}.standin.deps"

# Images and containers of the benchmarks (bench/).
BENCH = f"{PREFIX}.bench"

# Containers the tool starts.
ROLE = f"{PREFIX}.role"
OWNER = f"{PREFIX}.owner"
RUN = f"{PREFIX}.run"
RUN_ID_ENV = "VLLM_HOTFIX_RUN_ID"


def patch(name: str) -> str:
    """The key holding one patch's sha256 on a built image."""
    return f"{PREFIX}.patch.{name}"


def owner() -> str:
    """This process, as container labels and leftover sweeps name it."""
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_gone(owner_label: str) -> bool:
    """Whether ``owner_label`` (host:pid) names a process of this host that is no longer running."""
    host, _, pid = owner_label.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def for_container(role: str) -> dict[str, str]:
    """Labels for a container we start (``probe``, ``smoke``, ``serve``), so leaks can be found by owner.

    A run id from the environment is added too: a test session finds its own
    containers by it, whatever process started them.
    """
    labels = {ROLE: role, OWNER: owner()}
    run_id = os.environ.get(RUN_ID_ENV)
    if run_id:
        labels[RUN] = run_id
    return labels
