"""`.ci/services`, run for real on folders of the test's own: what set-up writes host-wide, what stop and prune
undo. A state folder of the test's own holds no note of a started engine, so nothing running is stopped."""

from __future__ import annotations

import subprocess
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / ".ci" / "services"
SETTING = '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]\n'


def test_setup_writes_no_host_wide_podman_setting() -> None:
    install = SERVICES.read_text().split("\n  install)\n", 1)[1].split("\n    ;;\n", 1)[0]
    assert "containers.conf" not in install


def test_stop_removes_the_podman_setting_an_earlier_setup_wrote_and_nothing_else(tmp_path: Path) -> None:
    """`.ci/services stop` with a state folder of its own: it started nothing there, so it stops nothing."""
    ours, theirs = tmp_path / "50-vllm-hotfix-ci.conf", tmp_path / "60-site.conf"
    ours.write_text(SETTING)
    theirs.write_text(SETTING.replace("4096", "8192"))
    for dropin, kept in ((ours, False), (theirs, True)):
        done = subprocess.run([str(SERVICES), "stop"], capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "VLLM_HOTFIX_STATE": str(tmp_path / "s"),
                                   "VLLM_HOTFIX_PODMAN_DROPIN": str(dropin)})
        assert done.returncode == 0, done.stderr
        assert dropin.exists() is kept
        assert ("removed" in done.stdout) is not kept


def test_prune_removes_the_services_data(tmp_path: Path) -> None:
    """`.ci/services prune` on folders of the test's own, no engine answering there: the registry's state folder
    and the engines' data roots go."""
    state, second, third, cdi = tmp_path / "state", tmp_path / "second", tmp_path / "third", tmp_path / "cdi"
    # What each instance keeps under /run: a folder holding its socket and its exec root (containerd's state).
    run = {name: tmp_path / "run" / f"vllm-hotfix-{name}" for name in ("second", "third", "cdi")}
    for folder in (state / "registry", second / "data", third / "data", cdi / "data", cdi / "exec" / "containerd",
                   run["second"] / "x" / "containerd", run["third"] / "x" / "netns", run["cdi"]):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "blob").write_bytes(b"x" * 1000)
    (run["cdi"] / "blob").unlink()  # its exec root is under its data root: the folder holds the socket alone
    beside = tmp_path / "run" / "other.pid"  # not the services': stays, and so does the folder holding it
    beside.write_text("1")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "VLLM_HOTFIX_STATE": str(state),
           "VLLM_HOTFIX_SECOND_ROOT": str(second), "SECOND_SOCKET": str(run["second"] / "docker.sock"),
           "VLLM_HOTFIX_SECOND_EXEC": str(run["second"] / "x"),
           "VLLM_HOTFIX_THIRD_ROOT": str(third), "THIRD_SOCKET": str(run["third"] / "docker.sock"),
           "VLLM_HOTFIX_THIRD_EXEC": str(run["third"] / "x"),
           "VLLM_HOTFIX_CDI_ROOT": str(cdi), "CDI_SOCKET": str(run["cdi"] / "docker.sock"),
           "VLLM_HOTFIX_PODMAN_DROPIN": str(tmp_path / "no-dropin")}
    for folder in run.values():
        (folder / "docker.sock").write_text("")  # where the socket was; no engine answers on it
    done = subprocess.run([str(SERVICES), "prune"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert not state.exists() and not second.exists() and not third.exists() and not cdi.exists()
    assert f"removing {second}" in done.stdout and f"removing {third}" in done.stdout
    assert [p for p in run.values() if p.exists()] == [], done.stdout
    assert beside.exists()
