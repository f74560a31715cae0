"""Helpers for running the pipeline on a GPU host through its own Docker engine.

    python3 gpu-runs/gpu_host.py base REF --vllm-src DIR --wheels DIR [--python PY] [--paths P ...] [--cuda]
    python3 gpu-runs/gpu_host.py record OUT --patched REPORT --unpatched REPORT --source-manifest FILE
                                    [--patched-again REPORT] [--unpatched-first REPORT] [--reference-run REPORT]
                                    [--source-call FILE ...]
                                    [--timings RUN_LOG] [--model DIR] [--base REF] [--reference FILE]
                                    [--inputs-from FILE] [--public-key PEM] [--attestation KIND=FILE ...]
                                    [--target-seconds S] [--launcher docker|podman] [--no-engine]
    python3 gpu-runs/gpu_host.py inputs [--model DIR] [--base REF] [--reference FILE] [--write FILE | --check FILE]

``base`` makes a GPU base image from the host's own filesystem (its Python,
torch and Triton, its system libraries) by ``tar`` piped to ``docker import``,
then adds vLLM's sources with their dist-info to that Python's site-packages
and installs the given wheels there, without a network. The imported
filesystem stays tagged ``REF-hostfs`` so a later base (e.g. with the full
vLLM wheel) can start from it. The console scripts of the distributions in
--vllm-src (``vllm``, the entrypoint) are written into the Python's bin folder.
With --cuda the host's CUDA toolkit (the folder holding ``nvcc``) comes along
and CUDA_HOME names it, as in the upstream image, where FlashInfer compiles its
kernels at first use.

``record`` folds the smoke reports (``build.py smoke --report``) into the run
record committed under gpu-runs/: the run that recorded the reference
answers (``--reference-run``: the reference image, another build of the same
definition), the patched image (``--patched``, and ``--patched-again``: a
second server start) and the unpatched base (``--unpatched``, warm; and
``--unpatched-first``, its first run here, which filled its caches). What it holds
and says is derived from the reports alone (:mod:`gpu_record`: per image its
verdict, smoke and phase times against ``--target-seconds``, checks, and per
level every request's evidence; ``findings``: the questions the run answers).
It refuses (exit 2) to write anything unless the checkout is the clean
commit ``--source-manifest`` names and every ``--source-call`` (each call's
own check) ran from that same tree; ``source`` says which commit and tree,
and how that was checked (:mod:`source_manifest`). ``launcher`` names what
started the smokes' containers (``--launcher podman`` for podman runs), and
``engine`` the Docker engine that built the images. Each ``--attestation
KIND=FILE`` (the DSSE envelope ``smoke --attestation`` wrote) is verified
with ``--public-key`` and recorded by file name and key ID, so the verdicts
can be verified again on another machine. Its ``inputs`` are hashed (the
model folder file by file, the base image's ID, the reference file, the
reports, the public key); the base must be the image the unpatched report
judged, and a report or envelope that does not verify is refused.
``--no-engine`` leaves out the engine's facts and the base (a self-test
without an engine).

``inputs`` hashes the same inputs on their own: ``--write FILE`` keeps them
after a host made them, ``--check FILE`` (a file from --write, or a record)
refuses, naming the input, to reuse a model folder, base or reference whose
hash is not the one written there. ``record --inputs-from FILE`` does the same
before it writes, and a record never replaces one made from other inputs.

Uses the tool's own engine module; DOCKER_HOST selects the engine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_record  # noqa: E402
from campaign_core import sha256_file as _sha256_file  # noqa: E402  (one file hasher for the campaign and records)

from vllm_hotfix.engine import Engine  # noqa: E402
from vllm_hotfix.tarball import tar_bytes  # noqa: E402

# What a GPU host's Python needs at run time; caches and docs are left out.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_PATHS = ["bin", "sbin", "lib", "lib64", "usr", "etc", "opt/torch"]
# Bytecode stays: without it every container would recompile torch on import.
EXCLUDES = ["usr/local/cuda*", "usr/share/doc", "usr/share/man", "var/cache"]


def _site(python: str) -> tuple[str, str]:
    """The Python's site-packages and the installation it runs from (a venv's base_prefix)."""
    code = "import sys, sysconfig; print(sysconfig.get_paths()['purelib']); print(sys.base_prefix)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    site, prefix = out.stdout.split("\n")[:2]
    return site, prefix


def _chunks(proc: subprocess.Popen[bytes]) -> Iterator[bytes]:
    assert proc.stdout is not None
    while True:
        block = proc.stdout.read(1 << 20)
        if not block:
            return
        yield block


def _tree(folder: Path, prefix: str) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            files[f"{prefix}/{path.relative_to(folder).as_posix()}"] = path.read_bytes()
    return files


def _cuda_root() -> str | None:
    """The CUDA toolkit folder holding the host's nvcc (through links), or None."""
    import shutil

    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if candidate and os.path.isfile(os.path.join(candidate, "bin", "nvcc")):
            return os.path.realpath(candidate)
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


def _console_scripts(src: Path, python: str) -> dict[str, bytes]:
    """bin/NAME launchers for the console_scripts of every dist-info under src.

    As pip writes them, with the ``__main__`` guard: vLLM starts its engine core
    with multiprocessing's spawn, whose child imports the launcher again and
    must not run the command a second time.
    """
    import configparser

    scripts: dict[str, bytes] = {}
    for ep in sorted(src.glob("*.dist-info/entry_points.txt")):
        cp = configparser.ConfigParser(delimiters=("=",))
        cp.optionxform = str  # type: ignore[assignment,method-assign]
        cp.read_string(ep.read_text(encoding="utf-8"))
        if not cp.has_section("console_scripts"):
            continue
        for name, target in cp.items("console_scripts"):
            module, _, attr = target.strip().partition(":")
            scripts[name] = (
                f"#!{python}\nimport sys\nfrom {module} import {attr.split('.')[0]}\n\n"
                f"if __name__ == \"__main__\":\n    sys.exit({attr}())\n"
            ).encode()
    return scripts


def _bytecode(python: str, folder: Path, site: str) -> None:
    """Bytecode for every module under ``folder`` (vLLM's unpacked wheel, the wheels installed beside it), as pip
    writes it when it installs a wheel into an image: without it every Python of every container (the server, its
    engine core, the fixed-batch probe, the GPU checks) compiles vLLM's modules again as it imports them. Checked
    hashes (Python re-hashes the source before it uses one), so that a patched file's old bytecode can serve
    nothing, whatever times the image's files carry; the names inside are the image's (``site``). A module that
    does not compile (a test file of another Python) is left without, as pip leaves it."""
    t0 = time.monotonic()
    done = subprocess.run([python, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "checked-hash",
                           "-d", site, str(folder)], capture_output=True, text=True)
    print(f"bytecode for {folder}: exit {done.returncode} after {time.monotonic() - t0:.1f} s", flush=True)


def base(args: argparse.Namespace) -> int:
    engine = Engine.connect(timeout=1800)
    # Not resolved: a venv's python is a link, and the venv is what the base must run.
    python = args.python
    bindir = os.path.dirname(args.python)
    site, prefix = _site(args.python)
    hostfs = f"{args.ref}-hostfs"
    cuda = _cuda_root() if args.cuda else None
    if args.cuda and cuda is None:
        print("error: --cuda: no nvcc on this host (CUDA_HOME, /usr/local/cuda, PATH)", file=sys.stderr)
        return 1
    excludes = [e for e in EXCLUDES if not (cuda and e.startswith("usr/local/cuda"))]
    t0 = time.monotonic()
    stage = engine.image(hostfs)
    if stage is None or args.rebuild:
        paths = [p for p in args.paths if os.path.lexists(os.path.join("/", p))]
        if cuda and not any(cuda == f"/{p}" or cuda.startswith(f"/{p}/") for p in paths):
            paths.append(cuda.lstrip("/"))
        # The interpreter a venv links to must come along, wherever it is installed.
        if not any(prefix == f"/{p}" or prefix.startswith(f"/{p}/") for p in paths):
            paths.append(prefix.lstrip("/"))
        cmd = ["tar", "-C", "/", "-cf", "-", *[f"--exclude={e}" for e in excludes], *paths]
        print(f"importing the host's {' '.join(paths)} as {hostfs}", flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        path_env = f"{bindir}:{SYSTEM_PATH}"
        stage = engine.import_stream(_chunks(proc), hostfs, changes=[f"ENV PATH={path_env}"])
        # tar exits 1 when a file changed while read (logs, /etc/mtab): not fatal here.
        if proc.wait() not in (0, 1):
            print(f"error: tar of the host filesystem failed (exit {proc.returncode})", file=sys.stderr)
            return 1
    imported = time.monotonic() - t0
    _bytecode(python, Path(args.vllm_src), site)
    files = _tree(Path(args.vllm_src), "vllm-src")
    with tempfile.TemporaryDirectory() as extra:
        # Installed by the host's own pip (same Python as the base), so the image needs
        # no pip of its own; --target writes each distribution's RECORD as usual.
        wheels = sorted(str(w) for w in Path(args.wheels).glob("*.whl"))
        if wheels:
            subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--disable-pip-version-check", "--target", extra, *wheels], check=True)
            _bytecode(python, Path(extra), site)
        files.update({k: v for k, v in _tree(Path(extra), "site-extra").items()
                      if not k.startswith("site-extra/bin/")})
    scripts = _console_scripts(Path(args.vllm_src), python)
    files.update({f"scripts/{name}": body for name, body in scripts.items()})
    env = [
        # Hosts whose GPUs others share keep NVLink multicast off in every program.
        "NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1",
    ]
    if cuda:
        env += [f"CUDA_HOME={cuda}", f"PATH={bindir}:{cuda}/bin:{SYSTEM_PATH}"]
    files["Dockerfile"] = (
        f"FROM {stage.id}\n"
        f"COPY vllm-src/ {site}/\n"
        + (f"COPY site-extra/ {site}/\n" if any(k.startswith("site-extra/") for k in files) else "")
        + (f"COPY scripts/ {bindir}/\nRUN chmod 0755 {' '.join(f'{bindir}/{n}' for n in scripts)}\n" if scripts else "")
        + "".join(f"ENV {e.split('=', 1)[0]}={e.split('=', 1)[1]}\n" for e in env)
        + "RUN mkdir -p /tmp && chmod 1777 /tmp\n"
        # The upstream image's entrypoint: anything that forgets to override it fails as there.
        'ENTRYPOINT ["vllm", "serve"]\n'
    ).encode()
    image_id = engine.build(tar_bytes(files), progress=lambda line: print(f"  {line}", flush=True))
    engine.tag(image_id, args.ref)
    info = engine.image(args.ref)
    assert info is not None
    print(json.dumps({"ref": args.ref, "id": info.id, "hostfs": stage.id, "site": site, "size": info.size,
                      "import_seconds": round(imported, 1), "seconds": round(time.monotonic() - t0, 1)}))
    return 0


class InputMismatch(Exception):
    """An input is not the one a record or inputs file says it was (the message names it)."""


def hash_model(folder: Path) -> dict[str, Any]:
    """The model folder's sha256: over each file's relative path and sha256, in path order."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    h = hashlib.sha256()
    size = 0
    for p in files:
        h.update(f"{p.relative_to(folder).as_posix()}\0{_sha256_file(p)}\n".encode())
        size += p.stat().st_size
    return {"path": str(folder), "sha256": h.hexdigest(), "files": len(files), "bytes": size}


def hash_inputs(model: str | None, base_ref: str | None, reference: str | None,
                engine: Engine | None = None) -> dict[str, Any]:
    """The inputs of a GPU run that a host may keep between runs, each with its hash."""
    inputs: dict[str, Any] = {}
    if model:
        inputs["model"] = hash_model(Path(model))
    if base_ref:
        info = (engine or Engine.connect()).image(base_ref)
        if info is None:
            raise InputMismatch(f"base {base_ref}: not in the engine")
        inputs["base"] = {"ref": base_ref, "id": info.id}
    if reference:
        data = json.loads(Path(reference).read_text(encoding="utf-8"))
        inputs["reference"] = {"path": reference, "sha256": _sha256_file(Path(reference)),
                               "content_sha256": data.get("sha256")}
    return inputs


def compare_inputs(have: dict[str, Any], recorded: dict[str, Any], where: str) -> None:
    """InputMismatch naming the first input whose hash is not the one ``where`` recorded."""
    keys = {"model": "sha256", "base": "id", "reference": "sha256"}
    for name, key in keys.items():
        if name in have and name in recorded and have[name].get(key) != recorded[name].get(key):
            what = have[name].get("path") or have[name].get("ref")
            raise InputMismatch(f"{name} {what}: {key} {have[name].get(key)}, but {where} was made with "
                                f"{recorded[name].get(key)}: not the same input (make it again, or use that one)")


def _load_json(path: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputMismatch(f"{what} {path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise InputMismatch(f"{what} {path}: not a JSON object")
    return data


def record(args: argparse.Namespace) -> int:
    try:
        return _record(args)
    except InputMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def attestations(given: list[str], public_key: str | None, reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each ``KIND=FILE`` envelope verified with the public key against its report: file name, key ID, subject."""
    if not given:
        return {}
    if public_key is None:
        raise InputMismatch("--attestation needs --public-key (the key the envelopes are verified with)")
    from vllm_hotfix.errors import PipelineError
    from vllm_hotfix.trust import signing

    try:
        public = signing.load_public_key(public_key)
    except PipelineError as exc:
        raise InputMismatch(str(exc)) from None
    out: dict[str, Any] = {}
    for item in given:
        kind, _, path = item.partition("=")
        if kind not in reports or not path:
            raise InputMismatch(f"--attestation {item}: expected KIND=FILE, KIND one of {', '.join(reports)}")
        try:
            found = signing.open_envelope(Path(path).read_bytes(), public, path)
        except OSError as exc:
            raise InputMismatch(f"--attestation {path}: cannot read it ({exc.strerror or exc})") from None
        except PipelineError as exc:
            raise InputMismatch(str(exc)) from None
        report, signed = reports[kind], found.predicate
        for key in ("image_id", "status", "gpu_verified", "started"):
            if signed.get(key) != report.get(key):
                raise InputMismatch(f"--attestation {path}: its signed {key} is {signed.get(key)!r}, the {kind} "
                                    f"report's {report.get(key)!r}: not the verdict of that run")
        out[kind] = {"file": Path(path).name, "sha256": _sha256_file(Path(path)), "key_id": found.key_id,
                     "verified": True, "subjects": sorted(found.digests), "status": signed.get("status"),
                     "gpu_verified": signed.get("gpu_verified")}
    return out


def source(manifest: str, root: str, calls: list[str]) -> dict[str, Any]:
    """What ran (:mod:`source_manifest`): the checkout here checked against the manifest now, and every call's
    own check (the tree each smoke ran from) the same tree; InputMismatch unless clean."""
    import source_manifest

    try:
        data = json.loads(Path(manifest).read_text(encoding="utf-8"))
        now = source_manifest.check(data, Path(root))
    except (OSError, ValueError) as exc:
        raise InputMismatch(f"--source-manifest {manifest}: cannot use it ({exc})") from None
    trees = {}
    for path in calls:
        call = _load_json(path, "--source-call")
        trees[Path(path).name] = call.get("tree")
        if not call.get("clean"):
            raise InputMismatch(f"--source-call {path}: that call ran from a tree that is not the clean commit "
                                f"({call.get('differ') or call.get('extra') or call.get('tree')})")
    other = sorted(name for name, tree in trees.items() if tree != now["tree"])
    if not now["clean"] or other:
        why = (f"calls {', '.join(other)} ran from another tree" if other and now["clean"] else
               f"tree {now['tree']} here, the commit's {now['tree_expected']}; differ {now['differ']}, missing "
               f"{now['missing']}, extra {now['extra']}, sender clean {now['sender_clean']}")
        raise InputMismatch(f"the checkout {root} is not the clean commit {now['commit']} ({why}): no record is "
                            "written from an unclean tree")
    return {"commit": now["commit"], "tree": now["tree"], "clean": True, "files": now["files"],
            "calls": dict(sorted(trees.items())), "how": now["how"] + "; each call of the run checked the same way"}


def builder_of(image_id: str | None) -> str | None:
    """The builder the journal of this checkout names for ``image_id`` (None where it has no build of it)."""
    if not image_id:
        return None
    try:
        from vllm_hotfix.journal import records

        found = records.builds_of_image(Path(__file__).resolve().parent.parent, image_id)
    except Exception:  # noqa: BLE001 - a journal that cannot be read names no builder
        return None
    return str(found[0].data.get("builder")) if found else None


def _record(args: argparse.Namespace) -> int:
    given = {"reference": args.reference_run, "patched": args.patched, "patched_again": args.patched_again,
             "patched_third": args.patched_third, "unpatched_first": args.unpatched_first,
             "unpatched": args.unpatched}
    for flag, items in (("mutant", args.mutant), ("variant", args.variant), ("badrecord", args.bad_recording)):
        for item in items or []:
            name, _, path = item.partition("=")
            if not name or not path:
                raise InputMismatch(f"--{flag} {item}: expected NAME=REPORT")
            given[f"{flag}_{name}"] = path
    reports = {kind: _load_json(path, f"--{kind.replace('_', '-')}") for kind, path in given.items() if path}
    patched, unpatched = reports["patched"], reports["unpatched"]
    src = source(args.source_manifest, args.source_root, args.source_call or [])
    engine = None if args.no_engine else Engine.connect()
    facts = engine.facts() if engine is not None else None
    inputs = hash_inputs(args.model, None if engine is None else args.base, args.reference, engine)
    if "base" in inputs and inputs["base"]["id"] != unpatched.get("image_id"):
        raise InputMismatch(f"base {args.base} is {inputs['base']['id']}, but the unpatched report "
                            f"{args.unpatched} judged {unpatched.get('image_id')}")
    for kind in ("patched_again", "patched_third"):
        again = reports.get(kind)
        if again is not None and again.get("image_id") != patched.get("image_id"):
            raise InputMismatch(f"--{kind.replace('_', '-')} {given[kind]} judged {again.get('image_id')}, but "
                                f"--patched {args.patched} judged {patched.get('image_id')}: not the same image")
    first = reports.get("unpatched_first")
    if first is not None and first.get("image_id") != unpatched.get("image_id"):
        raise InputMismatch(f"--unpatched-first {args.unpatched_first} judged {first.get('image_id')}, but "
                            f"--unpatched {args.unpatched} judged {unpatched.get('image_id')}: not the same image")
    for kind, report in reports.items():
        ref = ((report.get("sweep") or {}).get("reference") or {})
        if "reference" in inputs and ref and ref.get("sha256") != inputs["reference"]["content_sha256"]:
            raise InputMismatch(f"--reference {args.reference}: the {kind} report was judged against other "
                                f"reference answers (sha256 {ref.get('sha256')})")
    for earlier in (args.inputs_from, args.out if Path(args.out).exists() else None):
        if earlier:
            compare_inputs(inputs, _load_json(earlier, "inputs").get("inputs") or {}, earlier)
    signed = attestations(args.attestation or [], args.public_key, reports)
    inputs["reports"] = {kind: {"path": path, "sha256": _sha256_file(Path(path))}
                         for kind, path in given.items() if path}
    if args.public_key:
        inputs["public_key"] = {"path": args.public_key, "sha256": _sha256_file(Path(args.public_key))}
    images = {kind: gpu_record.image(report) for kind, report in reports.items()}
    for img in images.values():
        img["builder"] = builder_of(img.get("id"))
    for kind, found in signed.items():
        images[kind]["attestation"] = found
    answers = _load_json(args.reference, "--reference") if args.reference else {}
    reference = {k: answers.get(k) for k in ("recorded", "recorded_from", "settings", "noise", "repeat",
                                             "prompt_sensitivity", "sha256", "format")}
    reference["tolerance_nats"] = ((patched.get("sweep") or {}).get("reference") or {}).get("tolerance_nats")
    launcher = {"name": args.launcher, "version": args.launcher_version or (facts.server_version if facts and
                                                                           args.launcher == "docker" else None)}
    rec: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": src,
        # Which model (the record is per model; a campaign's models share the images).
        "model": {"path": args.model, "made_with": args.model_made},
        # The engine that built the images (and, with the docker launcher, ran the smokes).
        "engine": {"name": "docker", "version": facts.server_version, "api": facts.api_version,
                   "cdi_spec_dirs": list(facts.cdi_spec_dirs), "runtimes": list(facts.runtimes)} if facts else None,
        "launcher": launcher,
        "gpu_request_way": (patched.get("gpu") or {}).get("way"),
        "gpu_devices": (patched.get("gpu") or {}).get("devices"),
        "inputs": inputs,
        "reference": reference,
        "images": images,
        "smoke_seconds_target": args.target_seconds,
        "result": {kind: gpu_record.image_sentences(img, args.target_seconds) for kind, img in images.items()},
    }
    for prefix, key in (("mutant_", "mutants"), ("variant_", "variants")):
        shown = [kind.removeprefix(prefix) for kind in images if kind.startswith(prefix)]
        if shown:
            import mutants

            # What each broken backport is and where its header says it should first show; what each correct
            # one changes and why it is right.
            rec[key] = {name: mutants.header(name) for name in shown}
    if args.golden_run:
        # The golden forward against this model's reference (its noise per prompt, the confident positions and
        # their agreement), as golden_run.py measured it on this host.
        rec["golden"] = _load_json(args.golden_run, "--golden-run")
        inputs["golden_run"] = {"path": args.golden_run, "sha256": _sha256_file(Path(args.golden_run))}
    # The recording images of broken backports are no judged images: they are held to being refused.
    bad = {kind: Path(given[kind]).with_name(f"badrecord-{kind.removeprefix('badrecord_')}.answers.json").exists()
           for kind in images if kind.startswith("badrecord_")}
    judged_images = {k: v for k, v in images.items() if not k.startswith("badrecord_")}
    rec["findings"] = gpu_record.findings(judged_images, reference, args.target_seconds,
                                          alone=not args.side_by_side and not args.warm)
    host_seconds = None
    if args.host_uptime:
        host_seconds = float(Path(args.host_uptime).read_text().split()[0])
    rec["findings"].update(gpu_record.campaign(images, warm=[k.replace("-", "_") for k in args.warm or []],
                                               make_smoke=args.make_smoke, bad=bad, host_seconds=host_seconds,
                                               host_target=args.host_target_seconds, target=args.target_seconds))
    rec["findings"]["done"] = all(v["met"] for v in rec["findings"].values() if isinstance(v, dict) and "met" in v)
    rec["result"]["findings"] = gpu_record.finding_sentences(rec["findings"])
    if args.calls and Path(args.calls).exists():
        # Which call of the lent host made what, each with the host's clock (campaign-call.sh's calls.log).
        rec["calls"] = Path(args.calls).read_text().splitlines()
    if args.timings and Path(args.timings).exists():
        # The run log's own timestamped lines, not the build output between them.
        rec["timings"] = [ln for ln in Path(args.timings).read_text().splitlines() if ln.startswith(("[", "  gpu:"))]
    Path(args.out).write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    print(f"source: commit {src['commit']} tree {src['tree']} (clean)")
    for kind, img in rec["images"].items():
        print(f"{kind}: {img['ref']} {img['id']}" + (f" (builder {img['builder']})" if img.get("builder") else ""))
        for line in rec["result"][kind]:
            print(f"  {line}")
        for c in img["checks"]:
            print(f"  {c['status']:<4} {c['name']}: {str(c['detail'])[:400]}")
    for line in rec["result"]["findings"]:
        print(line)
    return 0


def inputs_cmd(args: argparse.Namespace) -> int:
    try:
        have = hash_inputs(args.model, args.base, args.reference)
        if args.check:
            data = _load_json(args.check, "--check")
            compare_inputs(have, data.get("inputs") or {}, args.check)
    except InputMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.write:
        Path(args.write).write_text(json.dumps({"inputs": have}, indent=2, sort_keys=True) + "\n")
    print(json.dumps(have, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base", help="make a GPU base image from this host's filesystem")
    b.add_argument("ref")
    b.add_argument("--vllm-src", required=True, help="folder holding vllm/ and its dist-info")
    b.add_argument("--wheels", required=True, help="folder of wheels to install into the base")
    b.add_argument("--python", default=sys.executable, help="the host Python the base runs (default: this one)")
    b.add_argument("--paths", nargs="+", default=DEFAULT_PATHS, help="top-level paths of / to import")
    b.add_argument("--rebuild", action="store_true", help="import the filesystem again even if REF-hostfs exists")
    b.add_argument("--cuda", action="store_true", help="bring the host's CUDA toolkit (nvcc) and set CUDA_HOME")
    r = sub.add_parser("record", help="fold the smoke reports into a run record")
    r.add_argument("out")
    r.add_argument("--patched", required=True, help="the patched image's report")
    r.add_argument("--unpatched", required=True, help="the unpatched base's report")
    r.add_argument("--patched-again", default=None, help="the patched image's report from a second server start")
    r.add_argument("--patched-third", default=None, help="the patched image's report from a third server start")
    r.add_argument("--mutant", action="append", default=None, metavar="NAME=FILE",
                   help="a broken backport's report (gpu-runs/mutants/NAME.patch), each judged as the patched image")
    r.add_argument("--variant", action="append", default=None, metavar="NAME=FILE",
                   help="a correct backport's report (gpu-runs/variants/NAME.patch), which must pass as the patched "
                        "image does")
    r.add_argument("--bad-recording", action="append", default=None, metavar="NAME=FILE",
                   help="a broken backport's second build used as the recording image: its report (the golden must "
                        "refuse it; badrecord-NAME.answers.json beside it must not exist)")
    r.add_argument("--warm", action="append", default=None, metavar="KIND",
                   help="a report of a smoke that ran alone (patched, patched-third): its time is a warm verdict's")
    r.add_argument("--make-smoke", default=None, metavar="KIND",
                   help="the report made through `make smoke` and the definition's [smoke] table (patched_third), "
                        "held to --patched's verdict")
    r.add_argument("--host-uptime", default=None, metavar="FILE",
                   help="/proc/uptime of the GPU host: its seconds since it started, held to --host-target-seconds")
    r.add_argument("--host-target-seconds", type=float, default=1500.0)
    r.add_argument("--calls", default=None, metavar="FILE",
                   help="campaign-call.sh's calls.log: each call of the lent host, what it was and its clock")
    r.add_argument("--golden-run", default=None,
                   help="gpu-runs/golden_run.py's output for this model: kept as the record's golden section")
    r.add_argument("--side-by-side", action="store_true",
                   help="the patched and unpatched smokes ran beside others: no warm times are judged here")
    r.add_argument("--model-made", default=None,
                   help="how the model was made (e.g. gpu-runs/tiny_minimax_m3.py --seed 1 --layers 3)")
    r.add_argument("--unpatched-first", default=None,
                   help="the unpatched base's first run on this host (its caches filled; --unpatched is the warm one)")
    r.add_argument("--reference-run", default=None,
                   help="the report of the run that recorded the reference answers (the reference image's)")
    r.add_argument("--timings", default=None)
    r.add_argument("--public-key", default=None, help="PEM public key the --attestation envelopes verify with")
    r.add_argument("--attestation", action="append", default=None, metavar="KIND=FILE",
                   help="a DSSE envelope of one report (KIND: reference, patched, patched_again, unpatched_first, "
                        "unpatched); repeatable")
    r.add_argument("--target-seconds", type=float, default=90.0, help="the smoke time each warm image should meet")
    r.add_argument("--source-manifest", required=True,
                   help="the manifest of the commit sent (source_manifest.py make): refused unless this checkout "
                        "is that clean commit")
    r.add_argument("--source-root", default=str(Path(__file__).resolve().parent.parent),
                   help="the checkout that ran (default: this script's)")
    r.add_argument("--source-call", action="append", default=None, metavar="FILE",
                   help="a source check one call of the run wrote (source_manifest.py check --write); repeatable")
    r.add_argument("--launcher", default="docker", choices=["docker", "podman"],
                   help="what started the smokes' containers (the record names it)")
    r.add_argument("--launcher-version", default=None, help="its version (podman: `podman --version`)")
    r.add_argument("--no-engine", action="store_true", help="record without an engine (no engine facts, no base)")
    for parser in (r, i := sub.add_parser("inputs", help="hash the inputs a host keeps; check them before reuse")):
        parser.add_argument("--model", default=None, help="the model folder served")
        parser.add_argument("--base", default=None, help="the base image (the unpatched image of the run)")
        parser.add_argument("--reference", default=None, help="the reference answers file the sweep judged against")
    r.add_argument("--inputs-from", default=None, help="refuse unless the inputs match this inputs file or record")
    check = i.add_mutually_exclusive_group()
    check.add_argument("--write", default=None, help="keep the hashes in this file")
    check.add_argument("--check", default=None, help="refuse (exit 2) unless the inputs match this file or record")
    args = ap.parse_args(argv)
    return {"base": base, "record": record, "inputs": inputs_cmd}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
