"""A smoke run's phases without an engine: the compile cache folder's key, phase times, ordering, --keep-going.

The runner's checks are replaced by recorders (:class:`vllm_hotfix.inimage.runner.main.Run`
runs them in every launcher, the default Docker one included), so what is
tested is the order they run in and when a failure ends the run.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from vllm_hotfix.checking import compile_cache
from vllm_hotfix.checking.launchers.docker import Clock, format_phases
from vllm_hotfix.engine import ImageInfo, labels
from vllm_hotfix.errors import SmokeError
from vllm_hotfix.inimage.runner.main import Run
from vllm_hotfix.verdicts import NOT_APPLICABLE, Check, Status, Verdict, judge, judge_gpu

BASE = "sha256:" + "b" * 64
PATCHED = "sha256:" + "a" * 64


def _image(image_id: str, base: str | None = None) -> ImageInfo:
    return ImageInfo(id=image_id, tags=(), repo_digests=(), entrypoint=None, cmd=None, env=(), user="",
                     labels={labels.BASE_ID: base} if base else {}, architecture="amd64")


# -- the compile cache folder -------------------------------------------------

def test_a_patched_image_and_its_base_share_one_folder(tmp_path: Path) -> None:
    patched = compile_cache.folder(tmp_path, PATCHED, BASE, ["NVIDIA H200"])
    base = compile_cache.folder(tmp_path, BASE, None, ["NVIDIA H200"])
    assert patched == base
    assert patched.host == tmp_path / "compile" / ("b" * 64) / "nvidia-h200"
    assert patched.host.is_dir() and patched.mount == (str(patched.host), "/root/.cache")


def test_the_gpu_model_is_part_of_the_key(tmp_path: Path) -> None:
    h200 = compile_cache.folder(tmp_path, PATCHED, BASE, ["NVIDIA H200", "NVIDIA H200"])
    b200 = compile_cache.folder(tmp_path, PATCHED, BASE, ["NVIDIA B200"])
    none = compile_cache.folder(tmp_path, PATCHED, BASE, [])
    assert h200.host != b200.host and h200.gpu == "nvidia-h200" and b200.gpu == "nvidia-b200"
    assert none.gpu == compile_cache.NO_GPU
    assert compile_cache.gpu_slug(["NVIDIA H200", "NVIDIA H100 80GB HBM3"]) == "nvidia-h100-80gb-hbm3+nvidia-h200"


@pytest.mark.parametrize("label", ["../../../etc", "sha256:xyz", "", "sha256:" + "c" * 63])
def test_a_base_label_that_is_no_image_id_keys_the_image_alone(tmp_path: Path, label: str) -> None:
    got = compile_cache.folder(tmp_path, PATCHED, label, ["../../x"])
    assert got.base_id == "a" * 64 and got.gpu == "x"
    assert got.host.resolve().is_relative_to((tmp_path / "compile").resolve())


def test_folders_are_the_users_and_the_leaf_writable_by_the_container(tmp_path: Path) -> None:
    got = compile_cache.folder(tmp_path, PATCHED, BASE, ["NVIDIA H200"])
    assert stat.S_IMODE(os.stat(tmp_path / "compile").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(got.host.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(got.host).st_mode) == 0o777
    env = got.env
    assert all(v.startswith(("/root/.cache", "/root")) for v in env.values())
    assert {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"} <= set(env)


def test_an_unwritable_cache_root_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "compile").write_text("a file where the folder should be")
    with pytest.raises(SmokeError, match="cannot make the compile cache folder"):
        compile_cache.folder(tmp_path, PATCHED, BASE, ["NVIDIA H200"])


def test_only_a_trusted_run_writes_the_shared_folder_and_a_recording_shares_none() -> None:
    assert compile_cache.access(trusted=True, recording=False) == compile_cache.SHARED
    assert compile_cache.access(trusted=False, recording=False) == compile_cache.LAYERED
    assert compile_cache.access(trusted=True, recording=True) == compile_cache.PRIVATE
    assert compile_cache.access(trusted=False, recording=True) == compile_cache.PRIVATE


def test_a_recordings_folder_is_its_own_and_gone_after_the_run(tmp_path: Path) -> None:
    shared = compile_cache.folder(tmp_path, PATCHED, BASE, ["NVIDIA H200"])
    (shared.host / "kernel.bin").write_bytes(b"another image's")
    private = replace(shared, access=compile_cache.PRIVATE)
    with compile_cache.given(None, private) as mounted:  # type: ignore[arg-type]  # no engine asked
        own = Path(mounted.mount[0])
        assert own != shared.host and own.is_dir() and not list(own.iterdir())
        assert mounted.to_dict()["access"] == "private" and mounted.mount[1] == "/root/.cache"
        (own / "written").write_text("x")
    assert not own.exists() and not list((tmp_path / "compile" / "private").iterdir())
    assert [p.name for p in shared.host.iterdir()] == ["kernel.bin"]
    with compile_cache.given(None, shared) as mounted:  # type: ignore[arg-type]
        assert mounted.mount == (str(shared.host), "/root/.cache")


def test_a_recording_of_a_proven_image_warms_the_bases_folder_after_it_and_reads_nothing_of_it(
        tmp_path: Path) -> None:
    """A recording starts from an empty folder of its own whatever the base's holds; where its image's layers were
    proven (``keep``), what it compiled moves into the base's folder once it ended, so the next image of that base
    starts warm; where they were not, nothing does."""
    shared = compile_cache.folder(tmp_path, PATCHED, BASE, ["NVIDIA H200"])
    (shared.host / "kernel.bin").write_bytes(b"another image's")
    private = replace(shared, access=compile_cache.PRIVATE)
    for proven in (False, True):
        with compile_cache.given(None, private, keep=lambda p=proven: p) as mounted:  # type: ignore[arg-type]
            own = Path(mounted.mount[0])
            assert not list(own.iterdir())  # nothing of the base's folder to read
            (own / "triton").mkdir()
            (own / "triton" / f"compiled-{proven}").write_text("x")
        assert not own.exists()
    assert sorted(p.name for p in shared.host.rglob("*") if p.is_file()) == ["compiled-True", "kernel.bin"]


def test_a_passing_runs_private_writes_are_adopted_and_nothing_else(tmp_path: Path) -> None:
    """What a layered run wrote moves into the shared folder (renames on one file system); a folder, a file that
    is a folder there, and anything that is not a file or a link (an overlay whiteout) stay out."""
    shared = compile_cache.folder(tmp_path, PATCHED, BASE, ["NVIDIA H200"]).host
    (shared / "triton" / "held").mkdir(parents=True)
    upper = tmp_path / "upper"
    (upper / "triton" / "ab").mkdir(parents=True)
    (upper / "triton" / "ab" / "kernel.cubin").write_bytes(b"k")
    (upper / "triton" / "held").write_bytes(b"a file where the shared folder has a folder")
    (upper / "link").symlink_to("triton/ab/kernel.cubin")
    os.mkfifo(upper / "not-a-file")
    assert compile_cache.adopt(upper, shared) == 2
    assert (shared / "triton" / "ab" / "kernel.cubin").read_bytes() == b"k"
    assert (shared / "link").is_symlink() and (shared / "triton" / "held").is_dir()
    assert not (shared / "not-a-file").exists()


def _full_smoke(**changed: Status) -> Verdict:
    """A GPU-verified verdict of every check the default policy counts (passed, unless ``changed`` says otherwise),
    its identity proved: what a full smoke on a GPU host with a reference gives."""
    from vllm_hotfix.trust import policy_file

    names = sorted({*policy_file.build().checks, "layer-identity"})
    entry = {"judged": 400, "positions": 1536}
    data: dict[str, dict[str, object]] = {
        "layer-identity": {"definition": "v0.25.1", "patch_set": "v0.25.1", "patch_set_digest": "sha256:" + "c" * 64,
                           "base_id": BASE},
        # The golden judged above the floor at every level and of both prompt classes; the full schedule ran.
        "golden": {"coverage": {"levels": {str(c): dict(entry) for c in (1, 2, 4, 8, 16)},
                                "classes": {"short": dict(entry), "long": dict(entry)}}},
        "exact-levels": {"levels": [{"concurrency": c, "requests": 32} for c in (1, 2, 4, 8, 16)]}}
    checks = [Check(n, changed.get(n.replace("-", "_"), Status.PASS), "x", ran_against="vllm", data=data.get(n))
              for n in names]
    return judge("ops/vllm:fix", PATCHED, checks, gpu_verified=True, started="2026-12-07T03:00:00+00:00",
                 gpu={"devices": ["NVIDIA H200"], "verified": True},
                 sweep={"reference": {"sha256": "d" * 64}, "levels": []})


def test_only_a_run_that_meets_the_default_policy_writes_the_compile_cache() -> None:
    """The cache adopts a run's writes, and lets an image write it in place, only where the run meets the default
    verification policy (the one `verify` asks of a signed verdict): a pass that judged no answers does not."""
    assert compile_cache.trusted_by(_full_smoke())
    # Passed, but its sweep and exact-levels skipped (no --serve-model, no reference): no answers judged.
    assert not compile_cache.trusted_by(_full_smoke(serve_sweep=Status.SKIP, exact_levels=Status.SKIP))
    assert _full_smoke(serve_sweep=Status.SKIP, exact_levels=Status.SKIP).passed
    # Passed on a host without a GPU: GPU-unverified.
    assert not compile_cache.trusted_by(replace(_full_smoke(), gpu_verified=False))
    assert not compile_cache.trusted_by(_full_smoke(exact_levels=Status.FAIL))


def test_a_bad_image_id_is_refused() -> None:
    with pytest.raises(SmokeError, match="not a sha256 image ID"):
        compile_cache.base_key("../x", None)


# -- phase times ---------------------------------------------------------------

def _ticks(*values: float) -> Iterator[float]:
    yield from values


def test_the_clock_charges_each_phase_its_own_time() -> None:
    ticks = _ticks(0.0, 2.0, 2.5, 10.0, 12.25)
    phases: dict[str, float] = {}
    clock = Clock(phases, now=lambda: next(ticks))
    assert clock.mark("checks") == 2.0
    clock.restart()  # 2.0 -> 2.5 is charged to nothing
    clock.mark("server_start")
    clock.mark("server_start")
    assert phases == {"checks": 2.0, "server_start": 9.75}
    assert format_phases(phases) == "checks 2.0 s, server_start 9.8 s"
    # Given the run's total, the line adds up to it (it said 0.34 s of phases under a 0.647 s heading).
    assert format_phases(phases, 12.5) == "checks 2.0 s, server_start 9.8 s, outside the phases 0.8 s"
    assert format_phases(phases, 11.0) == "checks 2.0 s, server_start 9.8 s"  # overlapping phases: nothing added


def test_phases_are_in_the_report_and_read_back() -> None:
    verdict = judge("img", PATCHED, [Check("x", Status.PASS)], gpu_verified=False,
                    phases={"checks": 1.5, "sweep": 3.0})
    raw = verdict.to_dict()
    assert raw["phases"] == {"checks": 1.5, "sweep": 3.0}
    assert Verdict.from_dict(raw) == verdict
    old = dict(raw)
    del old["phases"]  # an entry written before phases were kept
    assert Verdict.from_dict(old).phases == {}


# -- ordering and --keep-going ---------------------------------------------------

class Recorder(Run):
    """The runner, each check faked: it records that it ran and reports the status it is told to."""

    def __init__(self, outcomes: dict[str, str], *, serve: bool = True, keep_going: bool = False,
                 overlap: bool = False) -> None:
        super().__init__({
            "image": "img", "image_id": PATCHED, "keep_going": keep_going, "gpu": {"mode": "auto"},
            # Made on the host from the image's layers, handed in with the job.
            "checks": [{"name": "patch-landed", "status": outcomes.get("patch-landed", "pass"), "detail": "faked"}],
            "serve": {"argv": ["vllm", "serve"], "port": 8000, "overlap": overlap} if serve else None,
        })
        self.outcomes = outcomes
        self.ran: list[str] = []
        # The fakes write nothing: the scratch folder the real runner's main() would remove goes now.
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _fake(self, name: str) -> dict[str, Any]:
        self.ran.append(name)
        return {"name": name, "status": self.outcomes.get(name, "pass"), "detail": "faked"}

    def probe(self, script: str, args: Any, name: str) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
        return [self._fake(name)], {}, 0.0

    def gpu(self) -> tuple[bool, dict[str, Any]]:
        check = self._fake("gpu")
        self.add([check], 0, "gpu")
        return check["status"] == "pass", {"mode": "auto", "verified": check["status"] == "pass"}

    def serving(self, spec: dict[str, Any], phases: dict[str, float]) -> Any:
        run = self

        class Serving:
            started = False

            def start(self) -> None:
                self.started = True
                run.ran.append("server-start")

            def stop(self) -> None:
                if self.started:
                    run.ran.append("server-stop")

            def finish(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
                phases["sweep"] = 0.0
                return run._fake("serve-sweep"), None

        return Serving()


def test_phases_run_cheapest_first_and_report_their_times() -> None:
    run = Recorder({})
    verdict = run.run()
    assert run.ran == ["env-report", "gpu", "serve-sweep"]
    assert [c.name for c in verdict.checks] == ["patch-landed", "env-report", "gpu", "serve-sweep"]
    assert verdict.status is Status.PASS and verdict.gpu_verified
    assert list(verdict.phases) == ["checks", "gpu_checks", "sweep"]


@pytest.mark.parametrize(("failing", "ran", "skipped"), [
    ("patch-landed", ["env-report"], ["gpu", "serve-sweep"]),
    ("env-report", ["env-report"], ["gpu", "serve-sweep"]),
    ("gpu", ["env-report", "gpu"], ["serve-sweep"]),
])
def test_a_failed_phase_ends_the_run_and_names_what_did_not_run(failing: str, ran: list[str],
                                                                 skipped: list[str]) -> None:
    run = Recorder({failing: "fail"})
    verdict = run.run()
    assert run.ran == ran and verdict.status is Status.FAIL
    got = {c.name: c for c in verdict.checks}
    for name in skipped:
        assert got[name].status is Status.SKIP
        assert got[name].detail == f"not run: {failing} failed first (--keep-going runs every check)"
    assert verdict.gpu_verified is False


def test_keep_going_runs_every_phase_after_a_failure() -> None:
    run = Recorder({"patch-landed": "fail", "gpu": "fail"}, keep_going=True)
    verdict = run.run()
    assert run.ran == ["env-report", "gpu", "serve-sweep"]
    assert verdict.status is Status.FAIL and verdict.failed == ["patch-landed", "gpu"]


def test_an_incomplete_phase_does_not_end_the_run() -> None:
    # The host's shortcoming (no GPU under require) is not the image's failure: the sweep still runs.
    run = Recorder({"gpu": "incomplete"})
    assert run.run().status is Status.INCOMPLETE
    assert run.ran == ["env-report", "gpu", "serve-sweep"]


def test_with_overlap_the_server_starts_first_and_stops_when_a_check_fails() -> None:
    # The server's start is the run's longest path: with overlap it starts before every other check, and a failed
    # check (the CPU checks' or the GPU checks') stops it unless --keep-going.
    run = Recorder({}, overlap=True)
    assert run.run().status is Status.PASS
    assert run.ran == ["server-start", "env-report", "gpu", "serve-sweep"]
    failing = Recorder({"gpu": "fail"}, overlap=True)
    verdict = failing.run()
    assert failing.ran == ["server-start", "env-report", "gpu", "server-stop"]
    assert {c.name: c.status for c in verdict.checks}["serve-sweep"] is Status.SKIP
    early = Recorder({"env-report": "fail"}, overlap=True)
    verdict = early.run()
    assert early.ran == ["server-start", "env-report", "server-stop"]
    assert {c.name: c.status for c in verdict.checks}["serve-sweep"] is Status.SKIP
    kept = Recorder({"gpu": "fail"}, overlap=True, keep_going=True)
    kept.run()
    assert kept.ran == ["server-start", "env-report", "gpu", "serve-sweep"]


def test_without_a_model_the_sweep_is_a_skip() -> None:
    run = Recorder({}, serve=False)
    verdict = run.run()
    assert run.ran == ["env-report", "gpu"]
    assert {c.name: c.status for c in verdict.checks}["serve-sweep"] is Status.SKIP


# -- not applicable on this GPU family -------------------------------------------

NA = Check("topk-layout", Status.SKIP, "not applicable on this GPU family: vLLM picks the MSA path",
           ran_against=NOT_APPLICABLE)
TORCH = Check("gpu-torch", Status.PASS, "1 device(s)", ran_against="torch")


def test_not_applicable_never_counts_towards_gpu_verified() -> None:
    got = judge_gpu([TORCH, NA], require=False)
    assert not got.verified and got.checks[1].status is Status.SKIP
    assert got.not_applicable == (f"topk-layout: {NA.detail}",)
    assert "not applicable on this GPU family" in got.why_unverified
    # Even a check that says pass while not applicable is no evidence.
    lying = Check("topk-layout", Status.PASS, "ok", ran_against=NOT_APPLICABLE)
    assert not judge_gpu([TORCH, lying], require=False).verified
    assert not lying.real


def test_not_applicable_under_require_is_incomplete_not_a_failure() -> None:
    got = judge_gpu([TORCH, NA], require=True)
    assert not got.verified and got.checks[1].status is Status.INCOMPLETE
    verdict = judge("img", PATCHED, list(got.checks), gpu_verified=got.verified)
    assert verdict.status is Status.INCOMPLETE


# -- the GPU checks side by side --------------------------------------------------

def test_gpu_checks_run_side_by_side_and_report_in_order(tmp_path: Path) -> None:
    """gpu_check.py: the imports and each extra script run at once; their checks come back in the order they are
    named. Each script marks that it started, then waits for the other two marks: run one after the other, the
    first would never see them and fail (no clock is compared, so a loaded machine cannot fail it)."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    names = ("a_first", "b_second", "c_third")
    for name in names:
        (tmp_path / f"{name}.py").write_text(
            "import json, pathlib, time\n"
            f"here = pathlib.Path({str(tmp_path)!r})\n"
            f"(here / '{name}.started').touch()\n"
            "limit = time.monotonic() + 20\n"
            f"while time.monotonic() < limit and not all((here / f'{{n}}.started').exists() for n in {names!r}):\n"
            "    time.sleep(0.05)\n"
            f"others = all((here / f'{{n}}.started').exists() for n in {names!r})\n"
            f"print(json.dumps({{'checks': [{{'name': '{name}', 'status': 'pass' if others else 'fail', "
            "'detail': 'met the others' if others else 'ran alone'}]}))\n")
    # Isolated and without site-packages, as the runner starts its probes: no torch to import for the GPU checks,
    # which have no GPU to find here anyway (seconds of a loaded machine saved, the order and overlap unchanged).
    done = subprocess.run([sys.executable, "-I", "-S", str(REPO / "vllm_hotfix" / "inimage" / "probes" /
                                                           "gpu_check.py"),
                           "--extra", str(tmp_path), "--modules", "json"], capture_output=True, text=True,
                          timeout=120)
    checks = json.loads(done.stdout.strip().splitlines()[-1])["checks"]
    assert [c["name"] for c in checks][-4:] == ["model-imports", *names]
    assert [c["status"] for c in checks][-3:] == ["pass"] * 3, checks


@pytest.mark.parametrize("args, overlap", [
    ((), False),  # vLLM sizes the KV cache from the free memory the checks change
    (("--kv-cache-memory-bytes", "4294967296"), False),  # vLLM's default share, 0.9: a second engine cannot start
    (("--kv-cache-memory-bytes=4294967296", "--gpu-memory-utilization", "0.3"), True),
    (("--kv-cache-memory-bytes", "4294967296", "--gpu-memory-utilization=0.5"), True),
    (("--kv-cache-memory-bytes", "4294967296", "--gpu-memory-utilization", "0.6"), False),
    (("--kv-cache-memory-bytes", "4294967296", "--gpu-memory-utilization", "most"), False),
])
def test_the_server_overlaps_the_checks_and_the_probe_only_where_two_engines_can_start(
        args: tuple[str, ...], overlap: bool) -> None:
    from vllm_hotfix.checking.launchers import plan

    assert plan.overlaps(args) is overlap
