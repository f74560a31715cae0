"""The [smoke] table decides a real smoke run of an image of its definition: the GPU mode, the signing key (a
path relative to the project), and a flag over either; on the real engine, with the stand-in build."""

from __future__ import annotations

import json
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from conftest import cli
from vllm_hotfix.journal import records
from vllm_hotfix.verdicts import Status


def test_smoke_of_an_image_takes_its_definitions_table_and_a_flag_beats_it(built: tuple[Path, str, str],
                                                                            tmp_path: Path) -> None:
    project, ref, image_id = built
    key = project / "keys" / "site.pem"
    key.parent.mkdir()
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key.chmod(0o600)
    definition = project / "images" / "v0.25.1.toml"
    definition.write_text(definition.read_text() + '\n[smoke]\ngpu = "require"\nsign_key = "keys/site.pem"\n'
                                                   'concurrency = [1, 2]\nrequests = 4\n')
    # The table's gpu = "require" on a host without GPUs: incomplete, as --gpu require is.
    r = cli("smoke", ref, root=project)
    assert r.rc == 11, r.err
    assert "--gpu require: no GPU request gave a container of this image a GPU" in r.last_error
    assert records.verdicts(project, image_id)[0].verdict.status is Status.INCOMPLETE
    # A flag over it: a pass, signed with the table's key (relative to the project, not to where it started).
    report = tmp_path / "r.json"
    r = cli("smoke", ref, "--gpu", "auto", "--report", str(report), root=project)
    assert r.rc == 0, r.err
    assert "==> signed verdict:" in r.err
    newest = records.verdicts(project, image_id)[0]
    assert newest.verdict.status is Status.PASS
    assert json.loads(report.read_text())["gpu"]["mode"] == "auto"
    signed = list(project.rglob("*.dsse.json"))
    assert signed, "the table's key signed nothing"
