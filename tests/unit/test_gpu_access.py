"""GPU request parsing and the order of ways to ask an engine for a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli, fails
from vllm_hotfix.checking import gpu_access
from vllm_hotfix.engine import EngineFacts
from vllm_hotfix.errors import SmokeError


@pytest.mark.parametrize("text", ["auto", "cdi", "cdi:nvidia.com/gpu=0", "gpus", "runtime", "runtime:nvidia-legacy"])
def test_parse_request_accepts(text: str) -> None:
    assert gpu_access.parse_request(text) == text


@pytest.mark.parametrize("text", ["", "cuda", "gpus:all", "cdi:", "cdi:nvidia.com/gpu", "runtime:", "auto:x"])
def test_parse_request_rejects(text: str) -> None:
    with pytest.raises(SmokeError, match="--gpu-request"):
        gpu_access.parse_request(text)


def test_cdi_devices_read_json_and_nvidia_ctk_yaml(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"cdiVersion": "0.6.0", "kind": "vendor.com/fpga",
                                                 "devices": [{"name": "all"}]}))
    (tmp_path / "nvidia.yaml").write_text(
        "---\ncdiVersion: 0.5.0\ncontainerEdits:\n  deviceNodes:\n  - path: /dev/nvidiactl\n"
        "devices:\n- containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n  name: \"0\"\n"
        "- name: all\n  containerEdits: {}\nkind: nvidia.com/gpu\n")
    names, unreadable = gpu_access.cdi_devices((str(tmp_path), str(tmp_path / "absent")))
    assert names == ["nvidia.com/gpu=0", "nvidia.com/gpu=all"]
    assert unreadable == [str(tmp_path / "absent")]


def _facts(**kw: object) -> EngineFacts:
    base: dict[str, object] = dict(server_version="26.1.5", api_version="1.45", cdi_spec_dirs=(),
                                   runtimes=("runc",), default_runtime="runc", local=True)
    base.update(kw)
    return EngineFacts(**base)  # type: ignore[arg-type]


def test_candidates_follow_what_the_engine_offers(tmp_path: Path) -> None:
    ways, ruled_out = gpu_access.candidates(_facts(api_version="1.41", server_version="20.10.24"))
    assert [str(w) for w in ways] == ["gpus"]
    assert {a.way for a in ruled_out} == {"cdi", "runtime:nvidia"} and not any(a.tried for a in ruled_out)

    (tmp_path / "nvidia.json").write_text(json.dumps({"kind": "nvidia.com/gpu", "devices": [{"name": "all"}]}))
    ways, _ = gpu_access.candidates(_facts(cdi_spec_dirs=(str(tmp_path),), runtimes=("nvidia", "runc")))
    assert [str(w) for w in ways] == ["cdi:nvidia.com/gpu=all", "gpus", "runtime:nvidia"]

    empty = tmp_path / "empty"
    empty.mkdir()
    ways, ruled_out = gpu_access.candidates(_facts(cdi_spec_dirs=(str(empty),)))
    assert [str(w) for w in ways] == ["gpus"]
    assert "defines a nvidia.com/gpu device" in ruled_out[0].detail


def test_bad_gpu_request_is_a_usage_error(tmp_path: Path) -> None:
    r = cli("smoke", "any-image", "--gpu-request", "cuda", root=tmp_path)
    assert r.rc == 64
    fails(r, "--gpu-request", "'cuda'", "expected auto, cdi[:DEVICE], gpus or runtime[:NAME]")


def test_the_engines_refusal_of_gpus_is_said_as_what_the_host_lacks() -> None:
    from vllm_hotfix.checking.gpu_access import engine_words

    said = engine_words('could not select device driver "" with capabilities: [[gpu]]')
    assert 'driver ""' not in said and "NVIDIA Container Toolkit" in said and "could not select device driver" in said
    assert engine_words("unknown runtime specified nvidia") == "unknown runtime specified nvidia"
