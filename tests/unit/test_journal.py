"""The journal's order and its damaged entries (no engine).

Order comes from sequence numbers the journal hands out, never from a clock;
an entry that cannot be read is never skipped in silence.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from vllm_hotfix.errors import PushError, RecordError
from vllm_hotfix.journal import records
from vllm_hotfix.release import gate, lifecycle
from vllm_hotfix.trust import policy
from vllm_hotfix.verdicts import Check, Status, Verdict, judge

IMAGE_ID = "sha256:" + "ab" * 32
OTHER_ID = "sha256:" + "cd" * 32
DAY_NS = 86_400 * 10**9


@pytest.fixture(autouse=True)
def _own_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_HOTFIX_RECORDS", raising=False)


def _verdict(status: Status, image_id: str = IMAGE_ID) -> Verdict:
    """A smoke run on a host without a GPU (the push gate takes it under --allow-gpu-unverified), its
    patch-landed check ``status``."""
    checks = [Check(name, status if name == "patch-landed" else Status.PASS) for name in policy.CPU_CHECKS]
    return judge("x:y", image_id, [*checks, Check("gpu", Status.SKIP)], gpu_verified=False)


def _append_many(root: str, n: int) -> list[int]:
    return [records.append(Path(root), "tag", {"ref": "x:y", "image_id": IMAGE_ID}).seq for _ in range(n)]


# -- sequence numbers ------------------------------------------------------------------


def test_sequence_numbers_count_up_from_one_across_every_kind(tmp_path: Path) -> None:
    a = records.append(tmp_path, "build", {"image_id": IMAGE_ID, "inputs": {}})
    b = records.append_verdict(tmp_path, _verdict(Status.PASS))
    c = records.append(tmp_path, "push", {"image_id": IMAGE_ID, "ref": "r", "digest": "d"})
    assert (a.seq, b.seq, c.seq) == (1, 2, 3)
    # Named by number and image, so that a damaged entry can still be told apart.
    assert b.path.name == f"{2:020d}-{'ab' * 32}.json"
    assert sorted(p.name for p in (tmp_path / "build/records/seq").iterdir()) == [f"{n:020d}" for n in (1, 2, 3)]


def test_two_writers_racing_never_share_a_number(tmp_path: Path) -> None:
    seqs: list[int] = []
    lock = threading.Lock()

    def writer() -> None:
        got = _append_many(str(tmp_path), 15)
        with lock:
            seqs.extend(got)

    threads = [threading.Thread(target=writer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seqs) == list(range(1, 91))
    assert [e.seq for e in records.tags(tmp_path)] == list(range(90, 0, -1))


def test_processes_racing_never_share_a_number(tmp_path: Path) -> None:
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_append_many, [str(tmp_path)] * 4, [10] * 4))
    every = [s for got in results for s in got]
    assert sorted(every) == list(range(1, 41))
    for got in results:  # each writer's own entries in the order it wrote them
        assert got == sorted(got)


def test_a_clash_counts_again(tmp_path: Path) -> None:
    records.append(tmp_path, "tag", {"ref": "r", "image_id": IMAGE_ID})
    # Another writer claimed 2 but has not written its entry yet.
    (tmp_path / "build/records/seq" / f"{2:020d}").touch()
    assert records.append(tmp_path, "tag", {"ref": "r", "image_id": IMAGE_ID}).seq == 3


def test_a_journal_of_nanosecond_numbers_goes_on_above_them(tmp_path: Path) -> None:
    folder = tmp_path / "build/records/verdict"
    folder.mkdir(parents=True)
    old = 1_764_000_000_000_000_000
    data = {**_verdict(Status.FAIL).to_dict(), "kind": "verdict", "seq": old, "created": "2026-11-30T00:00:00Z"}
    (folder / f"{old:020d}-0123456789ab.json").write_text(json.dumps(data))
    new = records.append_verdict(tmp_path, _verdict(Status.PASS))
    assert new.seq == old + 1
    assert records.judgement(tmp_path, IMAGE_ID) == new
    assert [v.seq for v in records.verdicts(tmp_path, IMAGE_ID)] == [old + 1, old]


def test_data_cannot_choose_its_own_number(tmp_path: Path) -> None:
    entry = records.append(tmp_path, "tag", {"ref": "r", "image_id": IMAGE_ID, "seq": 10**30, "kind": "build"})
    assert entry.seq == 1 and entry.kind == "tag" and json.loads(entry.path.read_text())["seq"] == 1


# -- attack 3: a clock a day behind ----------------------------------------------------


def test_a_back_dated_clock_changes_no_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = records.append_verdict(tmp_path, _verdict(Status.PASS))
    real_ns, real_time, real_gmtime = time.time_ns, time.time, time.gmtime
    monkeypatch.setattr(time, "time_ns", lambda: real_ns() - DAY_NS)
    monkeypatch.setattr(time, "time", lambda: real_time() - 86_400)
    monkeypatch.setattr(time, "gmtime", lambda secs=None: real_gmtime(real_time() - 86_400 if secs is None else secs))
    failed = records.append_verdict(tmp_path, _verdict(Status.FAIL))
    assert failed.created < first.created  # the clock says older...
    assert failed.seq > first.seq  # ...the journal says newer, and the journal decides
    judged = records.judgement(tmp_path, IMAGE_ID)
    assert judged is not None and judged.path == failed.path and judged.verdict.status is Status.FAIL
    with pytest.raises(PushError, match="failed its newest smoke run"):
        gate.gate(tmp_path, IMAGE_ID, "x:y", allow_gpu_unverified=True)


# -- attack 2: an unreadable entry -----------------------------------------------------


def test_a_truncated_newest_verdict_stops_the_gate_naming_its_file(tmp_path: Path) -> None:
    records.append_verdict(tmp_path, _verdict(Status.PASS))
    failed = records.append_verdict(tmp_path, _verdict(Status.FAIL))
    failed.path.write_bytes(failed.path.read_bytes()[:40])
    with pytest.raises(RecordError, match=re.escape(str(failed.path))) as exc:
        gate.gate(tmp_path, IMAGE_ID, "x:y", allow_gpu_unverified=True)
    assert exc.value.exit_code == 10 and "\n" not in str(exc.value)
    assert "move it out of" in (exc.value.hint or "")
    # Attributed by its name: another image's gate is not stopped by it.
    records.append_verdict(tmp_path, _verdict(Status.PASS, OTHER_ID))
    assert gate.gate(tmp_path, OTHER_ID, "o:p", allow_gpu_unverified=True).verdict.image_id == OTHER_ID


def test_an_unreadable_entry_that_names_no_image_stops_every_gate(tmp_path: Path) -> None:
    records.append_verdict(tmp_path, _verdict(Status.PASS))
    records.append_verdict(tmp_path, _verdict(Status.PASS, OTHER_ID))
    failed = records.append_verdict(tmp_path, _verdict(Status.FAIL))
    # Truncated and renamed as an older entry was named: neither name nor data tells its image.
    hidden = failed.path.with_name(f"{failed.seq:020d}-0123456789ab.json")
    hidden.write_bytes(failed.path.read_bytes()[:40])
    failed.path.unlink()
    for image in (IMAGE_ID, OTHER_ID):
        with pytest.raises(RecordError, match=re.escape(str(hidden))):
            gate.gate(tmp_path, image, "x:y", allow_gpu_unverified=True)


@pytest.mark.parametrize("kind", ["build", "tag", "push"])
def test_a_damaged_entry_of_any_kind_for_the_image_stops_the_gate(tmp_path: Path, kind: str) -> None:
    records.append_verdict(tmp_path, _verdict(Status.PASS))
    entry = records.append(tmp_path, kind, {"image_id": IMAGE_ID, "ref": "r"})
    data = json.loads(entry.path.read_text())
    data["seq"] = "1"  # wrong-typed
    entry.path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=re.escape(str(entry.path))):
        gate.gate(tmp_path, IMAGE_ID, "x:y", allow_gpu_unverified=True)


def test_a_seq_its_name_contradicts_is_damage(tmp_path: Path) -> None:
    records.append_verdict(tmp_path, _verdict(Status.FAIL))
    passed = records.append_verdict(tmp_path, _verdict(Status.PASS))
    data = json.loads(passed.path.read_text())
    data["seq"] = 10**19
    passed.path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match="is not the 2 its name says"):
        records.judgement(tmp_path, IMAGE_ID)


def test_list_reports_damage_and_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "images").mkdir()
    records.append(tmp_path, "build", {"image_id": IMAGE_ID, "inputs": {"definition": "v1"}, "output_ref": "x:y"})
    records.append(tmp_path, "build", {"image_id": OTHER_ID, "inputs": {"definition": "v1"}, "output_ref": "x:y"})
    records.append_verdict(tmp_path, _verdict(Status.PASS))
    records.append_verdict(tmp_path, _verdict(Status.PASS, OTHER_ID))
    bad = records.append_verdict(tmp_path, _verdict(Status.FAIL))
    bad.path.write_text("{\"kind\": \"verd")
    made = {b.image_id: b for b in lifecycle.builds(tmp_path, "v1")}
    assert made[IMAGE_ID].as_dict()["verdict"] == "unreadable"
    assert made[IMAGE_ID].as_dict()["unreadable"] == [str(bad.path)]
    assert made[OTHER_ID].verdict is Status.PASS and not made[OTHER_ID].unreadable
    assert str(bad.path) in caplog.text
