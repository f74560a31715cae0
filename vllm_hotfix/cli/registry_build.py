"""``image --in-registry``: its option checks and what it prints (the image command hands over to it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import UsageError
from .app import print_json, progress


def image_in_registry(plan: Any, wanted: Any, asked: bool, *, in_registry: bool, bytecode: str | None, pull: str,
                      builder: str, wheelhouse: Path | None, rebuild: bool, skip_included: bool, force: bool,
                      as_json: bool) -> None:
    """Make the image in the registry (no engine is asked anything) and print where it landed."""
    from ..building import inregistry, pipeline

    if not in_registry:
        raise UsageError("--bytecode is for --in-registry (the engine's builders compile with the image's Python)")
    for given, option in ((pull != "missing", "--pull"), (builder != "dockerfile", "--builder"),
                          (wheelhouse is not None, "--wheelhouse")):
        if given:
            raise UsageError(f"{option} is for a build in the engine; --in-registry pulls nothing and builds in the "
                             "registry")
    from ..registry.layerscan import TICK_WORDS

    def said(line: str) -> None:  # under --json, the every-few-seconds lines of a long read are left out
        if not (as_json and line.endswith(TICK_WORDS)):
            progress(line)

    options = inregistry.Options(rebuild=rebuild, skip_included=skip_included, force=force,
                                 bytecode=bytecode or "auto", progress=said)
    result = inregistry.build(plan, wanted, asked, options)
    if isinstance(result, pipeline.NoHotfix):
        if as_json:
            print_json({"result": "no-hotfix-needed", "base": result.base_ref, "patches": list(result.patches)})
        else:
            click.echo(result.message())
        return
    how = "reused" if all(i.reused for i in result.images) else "built"
    name = result.ref.rpartition(":")[0]
    progress(smoke_state(plan.root, result, name))
    if as_json:
        print_json({"result": how, "ref": result.ref, "digest": result.digest, "index": result.index,
                    "images": [{"ref": i.ref, "digest": i.digest, "image_id": i.image_id, "platform": i.platform,
                                "reused": i.reused, "record": i.record.path.name, "bytecode": i.bytecode,
                                "read": i.read, "base_layers": i.blobs} for i in result.images]})
        return
    for i in result.images:
        click.echo(f"{'reused' if i.reused else 'built'} {i.ref} {i.image_id} {i.platform} {name}@{i.digest}")
    if result.index:
        click.echo(f"index {result.ref} {name}@{result.digest}")


def smoke_state(root: Path, result: Any, name: str) -> str:
    """What the journal says of the images' smoke runs: a reused image that passed says so (it said "not
    smoke-tested" after a pass), one not yet judged what to do."""
    from ..journal import records

    judged = [records.judgement(root, i.image_id) for i in result.images]
    if all(j is not None and j.verdict.status.value == "pass" for j in judged):
        gpu = ", ".join("GPU-verified" if j.verdict.gpu_verified else "GPU-unverified" for j in judged if j)
        return (f"==> smoke-tested: its newest verdict passed ({gpu}; {', '.join(j.path.name for j in judged if j)})"
                f": push it")
    failed = [j.path.name for j in judged if j is not None and j.verdict.status.value != "pass"]
    if failed:
        return f"==> its newest smoke verdict failed ({', '.join(failed)}): fix it, build and smoke it again"
    first = result.digest if not result.index else result.images[0].digest
    return (f"==> not smoke-tested (nothing runs here): smoke it where an engine and GPUs are, "
            f"python build.py smoke {name}@{first}, then push it")

