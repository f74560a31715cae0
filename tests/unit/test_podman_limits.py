"""The podman launcher gives each container open-file and process limits this host allows, on its command line.

Rootful podman asks runc for 1048576 of each; where the host's hard limits
are lower and the runtime may not raise them (podman inside a container),
the container does not start. No host-wide containers.conf is written for it.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

from vllm_hotfix.checking.launchers.podman import PODMAN_NOFILE, PODMAN_NPROC, PodmanLauncher

PROBE = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[1])))
resource.setrlimit(resource.RLIMIT_NPROC, (int(sys.argv[2]), int(sys.argv[2])))
from pathlib import Path
from vllm_hotfix.checking.launchers.podman import PodmanLauncher
print(json.dumps(PodmanLauncher().run_argv("img", Path("/r"), None, None, "n")))
"""


def _limits(line: list[str]) -> dict[str, str]:
    return dict(line[i + 1].split("=", 1) for i, a in enumerate(line) if a == "--ulimit")


def _argv_under(nofile: int, nproc: int) -> list[str]:
    """The run command line of a process whose hard limits were lowered to these (lowering needs no privilege)."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(nofile), str(nproc)], capture_output=True, text=True,
                          check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    return list(json.loads(done.stdout))


def test_a_host_with_lower_hard_limits_gives_its_own_to_the_container() -> None:
    nofile, nproc = resource.getrlimit(resource.RLIMIT_NOFILE)[1], resource.getrlimit(resource.RLIMIT_NPROC)[1]
    low_files = min(4000, nofile) if nofile != resource.RLIM_INFINITY else 4000
    low_procs = min(3000, nproc) if nproc != resource.RLIM_INFINITY else 3000
    line = _argv_under(low_files, low_procs)
    assert _limits(line) == {"nofile": f"{low_files}:{low_files}", "nproc": f"{low_procs}:{low_procs}"}
    # Options of the run, before the image: never taken for the runner's own arguments.
    assert line.index("--ulimit") < line.index("img")


def test_a_host_with_higher_limits_gets_what_podman_would_give() -> None:
    line = PodmanLauncher().run_argv("img", Path("/r"), None, None, "n")
    got = {k: int(v.split(":")[0]) for k, v in _limits(line).items()}
    nofile, nproc = resource.getrlimit(resource.RLIMIT_NOFILE)[1], resource.getrlimit(resource.RLIMIT_NPROC)[1]
    assert got["nofile"] == (PODMAN_NOFILE if nofile == resource.RLIM_INFINITY else min(nofile, PODMAN_NOFILE))
    assert got["nproc"] == (PODMAN_NPROC if nproc == resource.RLIM_INFINITY else min(nproc, PODMAN_NPROC))


def test_a_remote_podman_chooses_its_own_limits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The limits of a remote podman's host are not this host's."""
    monkeypatch.setenv("CONTAINER_HOST", "ssh://gpu-host/run/podman/podman.sock")
    assert "--ulimit" not in PodmanLauncher().run_argv("img", Path("/r"), None, None, "n")
    monkeypatch.delenv("CONTAINER_HOST")
    assert "--ulimit" not in PodmanLauncher(global_args=["--remote"]).run_argv("img", Path("/r"), None, None, "n")
