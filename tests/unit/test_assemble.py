"""The assemble builder's pure parts: the engine store check and the base history."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_hotfix.building import assemble
from vllm_hotfix.errors import BuildError


def test_containerd_image_store_is_named_as_the_reason() -> None:
    # The engine here keeps the classic store; only the answer of a
    # containerd-store engine's /info is stood in for.
    class Info:
        def __init__(self, status: list[list[str]]) -> None:
            self.status = status

        def info(self) -> dict[str, Any]:
            return {"DriverStatus": self.status}

    assert assemble.supported(Info([["driver-type", "io.containerd.snapshotter.v1"]])) is not None  # type: ignore[arg-type]
    assert assemble.supported(Info([["Backing Filesystem", "extfs"]])) is None  # type: ignore[arg-type]


def _hist(*entries: tuple[str, int]) -> list[dict[str, Any]]:
    return [{"Created": 1700000000 + i, "CreatedBy": by, "Comment": "", "Size": size}
            for i, (by, size) in enumerate(entries)]


def test_base_history_marks_the_entries_that_made_layers() -> None:
    hist = _hist(("", 100), ("/bin/sh -c #(nop)  ENV A=1", 0), ("/bin/sh -c touch /x", 0),
                 ("/bin/sh -c #(nop) COPY dir:abc in /opt ", 20), ("LABEL a=b", 0))
    out = assemble.base_history(hist, 3, "base")
    assert [bool(h.get("empty_layer")) for h in out] == [False, True, False, False, True]
    assert out[0]["created"] == "2023-11-14T22:13:20Z" and "created_by" not in out[0]
    # Every zero-size entry made a layer.
    assert not any(h.get("empty_layer") for h in assemble.base_history(hist, 5, "base"))
    # Two candidates for one layer: refuse rather than guess.
    hist2 = _hist(("", 100), ("RUN a", 0), ("RUN b", 0), ("ENV x", 0))
    with pytest.raises(BuildError, match="history entries"):
        assemble.base_history(hist2, 2, "base")
