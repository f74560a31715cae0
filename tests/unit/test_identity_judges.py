"""Layer identity's pure judges, table-driven: the first difference between a layer read and the builder's, and
between an image's config and its base's, as typed differences (path, field, expected, found)."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_hotfix.engine import labels as L
from vllm_hotfix.judges.identity import config_difference, first_difference
from vllm_hotfix.layers import Layer, LayerEntry

F = "/s/pkg/a.py"


def layer(*entries: LayerEntry) -> Layer:
    return Layer({e.path: e for e in entries})


def file(path: str = F, sha: str = "aa", mode: int = 0o644, kind: str = "file") -> LayerEntry:
    return LayerEntry(path, kind, sha256=sha, mode=mode)


BUILT = layer(LayerEntry("/s", "dir", mode=0o755), LayerEntry("/s/pkg", "dir", mode=0o755), file())

LAYER_CASES = [
    # (what, the layer read, path, field, expected, found)
    ("the builder's own layer", BUILT, None),
    ("a hard link with the file's bytes is the file",
     layer(LayerEntry("/s", "dir", mode=0o755), LayerEntry("/s/pkg", "dir", mode=0o755), file(kind="hardlink")), None),
    ("owners and times are the builder's business",
     layer(LayerEntry("/s", "dir", mode=0o755, uid=7, mtime=9), LayerEntry("/s/pkg", "dir", mode=0o755), file()),
     None),
    ("a file beside the patched one", layer(*BUILT.entries.values(), file("/s/pkg/a.so", "bb")),
     ("/s/pkg/a.so", "entry", "", "a file, mode 644, sha256 bb")),
    ("the patched file missing", layer(LayerEntry("/s", "dir", mode=0o755), LayerEntry("/s/pkg", "dir", mode=0o755)),
     (F, "entry", "a file, mode 644, sha256 aa", "")),
    ("other bytes", layer(LayerEntry("/s", "dir", mode=0o755), LayerEntry("/s/pkg", "dir", mode=0o755), file(sha="cc")),
     (F, "sha256", "aa", "cc")),
    ("another mode", layer(LayerEntry("/s", "dir", mode=0o755), LayerEntry("/s/pkg", "dir", mode=0o755),
                           file(mode=0o755)), (F, "mode", "644", "755")),
    ("a link in its place", layer(LayerEntry("/s", "dir", mode=0o755), LayerEntry("/s/pkg", "dir", mode=0o755),
                                  LayerEntry(F, "link", target="/elsewhere")), (F, "kind", "file", "link")),
    ("a folder made opaque", layer(LayerEntry("/s", "dir", mode=0o755), LayerEntry("/s/pkg", "dir", mode=0o755,
                                                                                    opaque=True), file()),
     ("/s/pkg", "opaque", "False", "True")),
    ("a whiteout the builder does not write", layer(*BUILT.entries.values(), LayerEntry("/s/pkg/b.py", "whiteout")),
     ("/s/pkg/b.py", "entry", "", "removed")),
    ("the first difference in path order is named",
     layer(LayerEntry("/s", "dir", mode=0o700), LayerEntry("/s/pkg", "dir", mode=0o755), file(sha="cc")),
     ("/s", "mode", "755", "700")),
]


@pytest.mark.parametrize(("read", "want"), [(c[1], c[2]) for c in LAYER_CASES], ids=[c[0] for c in LAYER_CASES])
def test_the_first_difference_between_a_layer_read_and_the_builders(read: Layer, want: tuple[str, ...] | None
                                                                    ) -> None:
    found = first_difference(read, BUILT)
    if want is None:
        assert found is None
    else:
        assert found is not None and (found.path, found.field, found.expected, found.found) == want
        assert str(found).startswith(want[0])


BASE: dict[str, Any] = {"Os": "linux", "Architecture": "amd64", "Config": {
    "Entrypoint": ["vllm", "serve"], "Env": ["PATH=/usr/bin"], "Labels": {"vendor": "x"}}}


def image(**changes: Any) -> dict[str, Any]:
    config = {**BASE["Config"], **changes.pop("Config", {})}
    return {**BASE, **changes, "Config": config}


CONFIG_CASES = [
    ("the base's config", image(), None),
    ("the builder's labels added", image(Config={"Labels": {"vendor": "x", f"{L.PREFIX}.patches": "p",
                                                            L.OCI_BASE_NAME: "b"}}), None),
    ("an empty value is no value", image(Config={"Cmd": []}), None),
    ("another architecture", image(Architecture="arm64"), ("platform", "architecture", "amd64", "arm64")),
    ("an environment added", image(Config={"Env": ["PATH=/usr/bin", "PYTHONPATH=/old"]}),
     ("config", "Env", "['PATH=/usr/bin']", "['PATH=/usr/bin', 'PYTHONPATH=/old']")),
    ("another entrypoint", image(Config={"Entrypoint": ["python3"]}),
     ("config", "Entrypoint", "['vllm', 'serve']", "['python3']")),
    ("a base label changed", image(Config={"Labels": {"vendor": "y"}}), ("label", "vendor", "x", "y")),
    ("a label of its own added", image(Config={"Labels": {"vendor": "x", "other": "z"}}),
     ("label", "other", "", "z")),
]


@pytest.mark.parametrize(("config", "want"), [(c[1], c[2]) for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_where_an_images_config_differs_from_its_bases(config: dict[str, Any], want: tuple[str, ...] | None) -> None:
    found = config_difference(BASE, config)
    if want is None:
        assert found is None
    else:
        assert found is not None and (found.path, found.field, found.expected, found.found) == want
