"""The GPU campaign on a GPU host without Docker or a package registry: every image built, smoked and recorded.

    python3 gpu-runs/campaign.py PARTS_DIR OUTDIR

The seed's failure and fix end to end, and the record of it, made by this
program alone: a real `vllm serve` of tiny MiniMax-M3 models in the image the
pipeline patched, in another build of the same definition (the reference
image), in the unpatched GPU base, in each broken backport (gpu-runs/mutants/)
and each correct one written another way (gpu-runs/variants/), through the
engine, at concurrency 1, 2, 4, 8, 16, every reply judged by the oracle
against answers recorded from the reference image. It runs on the host's own
Python (the standard library only); the tool, the engine and the helpers it
starts are other processes. gpu-runs/gpu-host-serve.sh runs it with the same
arguments and environment.

MODELS (default "s0-l2:0:2 s1-l3:1:3 s2-l4:2:4"): NAME:SEED:LAYERS, each made by
gpu-runs/tiny_minimax_m3.py --seed SEED --layers LAYERS. The images (base,
patched, reference image, mutants, variants) are built once and shared; each
model has its own reference answers, smokes and record in OUTDIR/NAME/ (run.log,
the signing key's public half and the source checks stay in OUTDIR).

PARTS_DIR holds part-NN and SHA256SUMS from gpu-runs/bundle-serve.sh (they can
arrive one call at a time). The GPU base is the host's filesystem (its Python,
torch, Triton and CUDA toolkit) plus the PyPI vLLM 0.25.1 wheel minus two
members AND their RECORD lines (see bundle-serve.sh: the integrity check stops
GPU-verified for a compiled file RECORD lists but the image lacks), plus the
requirements the host's Python lacks.

What ran: every call first checks this checkout against SOURCE_MANIFEST
(default CHECKOUT/gpu-parts/source.json, made where the tree was sent from by
`python3 gpu-runs/source_manifest.py make`: the commit, its tree, every
tracked file's git blob ID) and refuses to go on unless every tracked file
hashes as in that commit and no other file lies beside them
(OUTDIR/source-<time>.json keeps each call's check; the record step refuses
unless every call's tree is the commit's). OUTDIR must lie outside the
checkout.

Steps (STEPS, default all of them but gpuonly, topk and check, in order); each
skips what is done, so a step cut short is run again as it was:
  unpack    check and join the parts; unzip vLLM's wheel (vllm/ + dist-info),
            refusing a wheel whose RECORD lists a member it lacks
  engine    Docker 26.1 with CDI over the host's NVIDIA devices
            (gpu-runs/gpu-host-engine.sh's engine step)
  base      GPU base REPO:v0.25.1 (gpu_host.py base --cuda); made again when
            the parts it came from changed
  image     build.py image --definition v0.25.1 --base-repo REPO (the patched image,
            REPO:v0.25.1-m3patch, the Dockerfile builder)
  refimage  the same definition by the assemble builder (REPO:v0.25.1-m3patch-assembled):
            the reference image, another image than the one judged
  mutants   each broken backport of gpu-runs/mutants/ (MUTANTS, default all) as the patched
            image is built, from a project root of its own (gpu-runs/mutants.py root):
            REPO:v0.25.1-mutant-NAME; those of RECORD_MUTANTS a second time by the
            assemble builder (REPO:v0.25.1-mutant-NAME-assembled, the badrecord step's)
  variants  each correct backport of gpu-runs/variants/ (VARIANTS, default all), the same
            way: REPO:v0.25.1-variant-NAME
  model     gpu-runs/tiny_minimax_m3.py writes each model of MODELS (WORK/models/NAME)
  inputs    hashes each model and the base into WORK/inputs-NAME.json the first
            time (after either was made), and refuses (gpu_host.py inputs
            --check) to go on with a model or base whose hash changed since
  gpuonly   (not in the default) the patched image and the base, GPU checks alone (no server, no
            reference): OUTDIR/NAME/gpuonly-patched.json, gpuonly-unpatched.json (the first model's)
  topk      (not in the default; no engine) the topk-layout check on the host's Python against
            vLLM 0.25.1's sources as shipped, with the real patch, every variant and every
            mutant (gpu-runs/topk_table.py): OUTDIR/topk-table/table.md and one JSON per name
  check     (not in the default) imports vLLM's server, engine core, model
            runner, MiniMax-M3 and flashinfer.norm in the base, with the GPU
  reference per model, the reference image records the reference answers
            (--record-reference OUTDIR/NAME/answers.json): every model's side by side (PARALLEL),
            all cold (the compile caches emptied once, before the first)
  unpatched1 the first model's base beside the recordings, without a reference (none exists yet):
            it writes the base's compile cache in place (OUTDIR/NAME/unpatched-first.json)
  patched   the first model's patched image alone, after them: the first smoke of a new image on
            a host whose base is warm, and the campaign's warm verdict with every judge; the later
            models' side by side
  makesmoke the first model's third start, alone: `make smoke` with images/v0.25.1.toml's [smoke]
            table (patched-third.json); the later models' third start by the long command
  badrecord the first model's recordings from the second builds (assemble builder) of the broken
            backports RECORD_MUTANTS: the golden must refuse each (nothing written)
  golden    per model, on the host's Python (no engine): gpu-runs/golden_run.py on the model with its
            reference answers (OUTDIR/NAME/golden.json), beside the smokes that follow the recordings
  unpatched per model, side by side: the base, --definition v0.25.1 --reference its answers
  patched2  per model, side by side: the patched image again, a second server start
  patched3  (the later models' third start; the first model's is makesmoke)
  variantsmoke each variant image, --root its own root (OUTDIR/NAME/variant-V.json): must pass
  mutantsmoke each mutant image, --root its own root (OUTDIR/NAME/mutant-M.json): must fail; every
            mutant for the first model, MUTANTS_OTHERS for the others
  record    OUTDIR/NAME/record.json per model (gpu_host.py record, from the reports alone)
Every smoke runs with --gpu require --keep-going (so the unpatched base's
sweep runs after its GPU checks failed), no --min-tokens, and signs its
verdict with a P-256 key made here (WORK/signing-key.pem; the public key is
copied to OUTDIR/signing-key.pub.pem) into OUTDIR/NAME/<which>.dsse.json. The
sweep's server runs with --no-enable-prefix-caching and VLLM_BATCH_INVARIANT=1
(the tool adds both) and here with --kv-cache-memory-bytes, so that vLLM does
not measure the GPU's free memory and the server starts while the GPU checks
run.

Time plan: one run, started detached on the GPU host after the parts arrived
(gpu-runs/campaign-call.sh), the calls that follow only waiting for it (a
lease holds 30 minutes; the campaign must fit 25 of them, counted from the
host's start). Seconds measured on one H100 (2026-12-06, 2026-12-07 before
this plan): setup (unpack, engine, base, images, backports, models, inputs)
133; a cold reference 258 alone; eight smokes side by side about 146 wall; a
warm smoke alone 73-84 (before the server started ahead of the in-image
checks). Planned: setup 133 + the three recordings beside the first base's run
about 300 + two smokes alone about 140 + 36 smokes side by side at 8 (the two
bad recordings cold, first) about 660 + records 20: about 1,250 s, with the
host's start and the parts' transfer about 1,450 s. The queue starts a smoke
as soon as one ends (not in batches). With

  PARALLEL=8 ENGINE_GIB=5 python3 gpu-runs/campaign.py PARTS OUTDIR

(the tiny models need about 0.65 GiB of KV cache at concurrency 16 (3 layers x
2,304 bytes a token x 16 requests of at most 5,722 tokens, reasoned from their
shapes): the 2 GiB given leaves room, and 8 smokes' 16 engines then fit an 80
GB GPU by :func:`fitting_parallel`). CALL_BUDGET still stops a call from
starting a smoke it has no time for, where the run is made in several calls
instead; every step skips what is done, so the same STEPS again go on from
where a run stopped.

OUTDIR gets run.log, dockerd.log, signing-key.pub.pem and source-*.json;
OUTDIR/NAME/ per model smoke-<which>.log, <which>.json (reference, patched,
patched-again, patched-third, unpatched-first, unpatched, variant-V,
mutant-M, badrecord-M), <which>.dsse.json, answers.json, inputs.json and
record.json. run.log's lines `[HH:MM:SS] ...` are the record's timings.

REFERENCE_FROM (an earlier run's OUTDIR: its NAME/answers.json, for a model of the same hash).
TP (1): --tensor-parallel-size of every server; on a host with N GPUs, a run per size, each in its own OUTDIR:
  TP=2 STEPS="reference patched unpatched record" python3 gpu-runs/campaign.py PARTS OUTDIR-tp2
(the images, model and inputs made once, by the default steps' first call).
Environment: PYTHON (python3: the Python the tool and the helpers run with),
GPU_BASE_REPO (vllm-gpu-base), GPU_HOST_WORK (/var/lib/vllm-hotfix-gpu),
SERVE_MEM (0.05), KV_BYTES (2147483648; empty: let vLLM size the KV cache, and
start the server after the GPU checks; the defaults are images/v0.25.1.toml's
[smoke] serve_args, which make smoke uses), CONCURRENCY (1,2,4,8,16), REQUESTS
(32 per level), MUTANTS (names, default every gpu-runs/mutants/*.patch),
MUTANTS_OTHERS (the later models' mutants), RECORD_MUTANTS (the badrecord
step's), VARIANTS (names, default every gpu-runs/variants/*.patch), PARALLEL
(1) and ENGINE_GIB (10) (see :func:`fitting_parallel`), CALL_BUDGET and
SMOKE_ESTIMATE (110; BATCH_ESTIMATE, 200, for a queued smoke) seconds,
SERVE_ARGS (extra `vllm serve` arguments), TIMEOUT_REFERENCE (540),
TIMEOUT_WARM (240) seconds per smoke (the tool cleans up on TERM),
TARGET_SECONDS (60, the record's smoke time target for the warm runs),
SOURCE_MANIFEST, DRY_RUN (1: print each engine-touching command as one
shell-quoted `+ ...` line into run.log instead of running it, and say where a
source check would refuse; a self-test of the steps' logic without a GPU or an
engine).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

import source_manifest  # noqa: E402

logger = logging.getLogger(__name__)

HERE = Path(os.path.abspath(Path(__file__).parent.parent))
TAG = "v0.25.1"
DEFAULT_STEPS = ("unpack engine base image refimage mutants variants model inputs reference unpatched1 patched "
                 "makesmoke badrecord golden unpatched patched2 variantsmoke mutantsmoke record")


class Refused(Exception):
    """The campaign (or, inside a queued smoke, that smoke) stops here; its run.log line is written already."""


# ---------------------------------------------------------------------------------------------------------------
# Settings: the environment, read once.


def _names(folder: Path) -> str:
    """Every NAME of folder/NAME.patch, in name order (the default of MUTANTS and VARIANTS)."""
    return " ".join(sorted(p.name.removesuffix(".patch") for p in folder.glob("*.patch")))


@dataclass(frozen=True)
class Settings:
    """What the environment asks for, each with the default gpu-runs/README.md and the module's help name."""

    env: Mapping[str, str]
    parts: Path
    outdir: Path
    work: str
    python: str
    repo: str
    steps_text: str
    mutants: list[str]
    variants: list[str]
    models_text: str
    mutants_others: list[str]
    record_mutants: list[str]
    dry_run: bool
    source_manifest: str

    @classmethod
    def read(cls, parts: str, outdir: str, env: Mapping[str, str]) -> Settings:
        def get(name: str, default: str) -> str:
            return env.get(name) or default  # as ${NAME:-default}: empty is the default too

        python = shutil.which(get("PYTHON", "python3"), path=env.get("PATH")) or get("PYTHON", "python3")
        return cls(
            env=env, parts=Path(os.path.abspath(parts)), outdir=Path(os.path.realpath(outdir)),
            work=get("GPU_HOST_WORK", "/var/lib/vllm-hotfix-gpu"), python=python,
            repo=get("GPU_BASE_REPO", "vllm-gpu-base"), steps_text=get("STEPS", DEFAULT_STEPS),
            mutants=get("MUTANTS", _names(HERE / "gpu-runs" / "mutants")).split(),
            variants=get("VARIANTS", _names(HERE / "gpu-runs" / "variants")).split(),
            models_text=get("MODELS", "s0-l2:0:2 s1-l3:1:3 s2-l4:2:4"),
            mutants_others=get("MUTANTS_OTHERS", "decode-side-unfixed prefill-write-unfixed read-unfixed").split(),
            record_mutants=get("RECORD_MUTANTS", "decode-side-unfixed decode-write-unfixed").split(),
            dry_run=bool(env.get("DRY_RUN")),
            source_manifest=get("SOURCE_MANIFEST", str(HERE / "gpu-parts" / "source.json")),
        )

    def get(self, name: str, default: str) -> str:
        return self.env.get(name) or default

    def step(self, name: str) -> bool:
        return name in self.steps_text.split()

    @property
    def base(self) -> str:
        return f"{self.repo}:{TAG}"

    @property
    def patched(self) -> str:
        return f"{self.repo}:{TAG}-m3patch"

    @property
    def refimage(self) -> str:
        return f"{self.repo}:{TAG}-m3patch-assembled"

    @property
    def payload(self) -> str:
        return f"{self.work}/payload"

    @property
    def key(self) -> str:
        return f"{self.work}/signing-key.pem"

    @property
    def pubkey(self) -> Path:
        return self.outdir / "signing-key.pub.pem"

    @property
    def log_path(self) -> Path:
        return self.outdir / "run.log"

    @property
    def cache(self) -> str:
        # The tool's caches (wheels, the compile caches of build/cache/compile/<base>/<gpu>/) stay on the host.
        return f"{self.work}/cache"

    def roots(self, kind: str) -> str:
        return f"{self.work}/{kind}-roots"


@dataclass(frozen=True)
class Model:
    """One entry of MODELS: the model's folder, its OUTDIR subfolder, answers and input hashes."""

    name: str
    seed: str
    layers: str
    folder: str
    out: Path
    answers: Path
    inputs: Path

    @classmethod
    def parse(cls, spec: str, settings: Settings) -> Model:
        name, seed, layers = (spec.split(":", 2) + ["", ""])[:3]
        joined = f"{name}:{seed}:{layers}"
        allowed = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.:_-")
        if set(joined) - allowed or joined.startswith(":") or "::" in joined or joined.endswith(":"):
            raise ValueError(f"MODELS entry '{spec}': NAME:SEED:LAYERS (letters, digits, . _ -)")
        out = settings.outdir / name
        return cls(name, seed, layers, f"{settings.work}/models/{name}", out, out / "answers.json",
                   Path(f"{settings.work}/inputs-{name}.json"))


# ---------------------------------------------------------------------------------------------------------------
# Output: run.log's timestamped lines, and where a command's output goes.


@dataclass(frozen=True)
class Output:
    """Where a command's output goes: the console, a file (appended or written anew), or both (tee); ``both``
    sends its stderr the same way (2>&1), else stderr stays on the console."""

    file: Path | None = None
    append: bool = True
    console: bool = True
    both: bool = False


CONSOLE = Output()
QUIET = Output(console=False)  # stdout thrown away; stderr on the console


def into(path: Path, append: bool = True) -> Output:
    return Output(path, append, console=False, both=True)


def tee(path: Path, both: bool = False) -> Output:
    return Output(path, True, console=True, both=both)


class Log:
    """run.log and the console: each line whole, in one write, whichever thread says it."""

    def __init__(self, path: Path, stdout: TextIO, stderr: TextIO) -> None:
        self.path = path
        self.stdout = stdout
        self.stderr = stderr
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        """``[HH:MM:SS] text`` to run.log and the console (the record reads these lines as its timings)."""
        stamped = f"[{time.strftime('%H:%M:%S', time.gmtime())}] {text}\n"
        with self._lock:
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(stamped)
            self.stdout.write(stamped)
            self.stdout.flush()

    def die(self, text: str) -> Refused:
        self.line(f"error: {text}")
        return Refused(text)

    def raw(self, text: str, where: Path | None, console: TextIO | None) -> None:
        """Lines as they came (a command's own output), to a file and/or the console."""
        with self._lock:
            if where is not None:
                with where.open("a", encoding="utf-8") as fh:
                    fh.write(text)
            if console is not None:
                console.write(text)
                console.flush()

    def last(self) -> str:
        """run.log's last line (the steps say how the command before them ended)."""
        with self._lock:
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        return lines[-1] if lines else ""


class Shell:
    """The engine-touching commands: run, or under DRY_RUN each printed as one shell-quoted ``+ ...`` line to
    run.log and to where its stderr goes (a caller's output may go to the log too: two copies then, never one
    line cut into another)."""

    def __init__(self, settings: Settings, log: Log, env: dict[str, str]) -> None:
        self.settings = settings
        self.log = log
        self.env = env
        self.cwd = str(HERE)

    def act(self, argv: list[str], out: Output = CONSOLE, stdin: str | None = None) -> int:
        if self.settings.dry_run:
            line = "+ " + " ".join(shlex.quote(a) for a in argv) + "\n"
            self.log.raw(line, self.log.path, None)
            if out.both:
                if out.file is not None:
                    if not out.append:
                        out.file.write_text("", encoding="utf-8")
                    self.log.raw(line, out.file, None)
                if out.console:
                    self.log.raw(line, None, self.log.stdout)
            else:
                self.log.raw(line, None, self.log.stderr)
            return 0
        return self.run(argv, out, stdin)

    def run(self, argv: list[str], out: Output = CONSOLE, stdin: str | None = None) -> int:
        """One command now, whatever DRY_RUN says (the steps that touch no engine): its exit code (127 where it
        cannot be started)."""
        self.log.stdout.flush()
        data = stdin.encode() if stdin is not None else None
        given = None if data is not None else subprocess.DEVNULL
        stderr = subprocess.STDOUT if out.both else None
        try:
            if out.file is not None and out.console:
                return self._tee(argv, out.file, data, stderr)
            if out.file is not None:
                with out.file.open("ab" if out.append else "wb") as fh:
                    return subprocess.run(argv, input=data, stdin=given, stdout=fh, stderr=stderr, env=self.env,
                                          cwd=self.cwd, check=False).returncode
            stdout = None if out.console else subprocess.DEVNULL
            return subprocess.run(argv, input=data, stdin=given, stdout=stdout, stderr=stderr, env=self.env,
                                  cwd=self.cwd, check=False).returncode
        except OSError as exc:
            self.log.raw(f"{argv[0]}: {exc.strerror or exc}\n", None, self.log.stderr)
            return 127

    def _tee(self, argv: list[str], file: Path, data: bytes | None, stderr: int | None) -> int:
        """Its output to the console and appended to ``file``, line by line as it comes."""
        with subprocess.Popen(argv, stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=stderr, env=self.env, cwd=self.cwd) as proc:
            if data is not None and proc.stdin is not None:
                proc.stdin.write(data)
                proc.stdin.close()
            assert proc.stdout is not None
            for raw in proc.stdout:
                self.log.raw(raw.decode(errors="replace"), file, self.log.stdout)
        return proc.returncode

    def which(self, name: str) -> str | None:
        return shutil.which(name, path=self.env.get("PATH"))


# ---------------------------------------------------------------------------------------------------------------
# Before any step: what ran (the source check).


def check_source(settings: Settings, log: Log) -> None:
    """The checkout against SOURCE_MANIFEST (source_manifest.py check); refused unless it is that clean commit,
    where DRY_RUN only says so. OUTDIR/source-<time>-<pid>.json keeps this call's check for the record."""
    written = settings.outdir / f"source-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}.json"
    why = ""
    try:
        manifest = Path(settings.source_manifest)
        result = source_manifest.check(json.loads(manifest.read_text(encoding="utf-8")), HERE)
    except (OSError, ValueError) as exc:
        why = f"error: --source manifest {settings.source_manifest}: {exc}"
    else:
        written.write_text(json.dumps(result, sort_keys=True) + "\n", encoding="utf-8")
        if result["clean"]:
            log.line(f"checkout {HERE}: commit {result['commit']} tree {result['tree']} clean; "
                     f"steps: {settings.steps_text}")
            return
        why = (f"tree {result['tree']} not {result['tree_expected']} differ {result['differ']} missing "
               f"{result['missing']} extra {result['extra']} sender_clean {result['sender_clean']}")
    if settings.dry_run:
        log.line(f"source check: would refuse ({why or 'no manifest'}); steps: {settings.steps_text}")
        return
    raise log.die(f"source check against {settings.source_manifest}: not the clean commit it names "
                  f"({why or 'no manifest'}); make it with gpu-runs/source_manifest.py make in a clean checkout, "
                  "and send that tree")


# ---------------------------------------------------------------------------------------------------------------
# Setup steps: parts, engine, base, images, backports, models, inputs.


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parts_sum(settings: Settings) -> str:
    """The hash of the parts' SHA256SUMS: what the payload and the base were made from."""
    sums = settings.parts / "SHA256SUMS"
    return sha256_file(sums) if sums.is_file() else ""


def _parts_whole(parts: Path) -> list[str]:
    """What `sha256sum -c` in PARTS_DIR finds wrong: each part SHA256SUMS names that is missing or whose hash
    differs, or SHA256SUMS itself where it names none."""
    sums = parts / "SHA256SUMS"
    rows = [row.split(None, 1) for row in sums.read_text(encoding="utf-8").splitlines()] if sums.is_file() else []
    named = [(want, name.lstrip("*")) for want, name in (r for r in rows if len(r) == 2)]
    if not named:
        return ["SHA256SUMS"]
    return [name for want, name in named if not (parts / name).is_file() or sha256_file(parts / name) != want]


def unzip_vllm(wheel: Path, dest: Path) -> str:
    """vllm/ and its dist-info out of the wheel, refusing a wheel whose RECORD lists a member it lacks (the
    integrity check would refuse GPU-verified for it: the bundle must drop its RECORD line)."""
    with zipfile.ZipFile(wheel) as z:
        have = set(z.namelist())
        record = next(n for n in have if n.endswith(".dist-info/RECORD"))
        listed = [r[0] for r in csv.reader(io.TextIOWrapper(z.open(record), encoding="utf-8")) if r]
        missing = [n for n in listed if n not in have]
        if missing:
            raise ValueError(f"{wheel}: RECORD lists {', '.join(missing)}, which the wheel lacks "
                             "(make the parts again with gpu-runs/bundle-serve.sh)")
        names = [n for n in have if n.startswith(("vllm/", f"vllm-{TAG[1:]}.dist-info/"))]
        z.extractall(dest, names)
    return f"  {len(names)} files of {wheel.name}; RECORD lists only what it holds"


def step_unpack(c: Campaign) -> None:
    s, payload = c.settings, Path(c.settings.payload)
    done = payload / ".complete"
    if not done.is_file() or done.read_text().strip() != c.parts_sum:
        parts = sorted(s.parts.glob("part-*"))
        c.log.line(f"unpack: {len(parts) or 1} part(s) in {s.parts}")
        damaged = _parts_whole(s.parts)
        for name in damaged:
            c.log.raw(f"{name}: FAILED\n", None, c.log.stdout)
        if damaged:
            raise c.log.die(f"a part is missing or damaged (sha256sum -c in {s.parts})")
        shutil.rmtree(payload, ignore_errors=True)
        payload.mkdir(parents=True)
        with subprocess.Popen(["tar", "-C", str(payload), "-xf", "-"], stdin=subprocess.PIPE) as tar:
            assert tar.stdin is not None
            for part in parts:
                with part.open("rb") as fh:
                    shutil.copyfileobj(fh, tar.stdin, 1 << 20)
            tar.stdin.close()
        if tar.returncode != 0:
            raise c.log.die("cannot unpack the parts")
        src = Path(f"{s.work}/src")
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        try:
            wheel = next(iter(sorted(payload.glob(f"vllm-{TAG[1:]}-*.whl"))))
            said = unzip_vllm(wheel, src)
        except (StopIteration, ValueError, OSError, zipfile.BadZipFile) as exc:
            c.log.raw(f"{exc or 'no vLLM wheel in the parts'}\n", None, c.log.stderr)
            raise c.log.die("vLLM's wheel: see the line above") from None
        c.log.raw(said + "\n", None, c.log.stdout)
        done.write_text(c.parts_sum + "\n")
        size = subprocess.run(["du", "-sh", str(payload)], capture_output=True, text=True).stdout.split("\t")[0]
        c.log.line(f"unpacked: {size}")
    # The checkout running this program, as gpu-host-engine.sh unpacks it (refreshed on every run).
    c.shell.run(["tar", "-C", str(HERE), "--exclude=./.gpucarry", "--exclude=./build", "--exclude=./gpu-parts",
                 "--exclude=./.git", "-czf", str(payload / "repo.tar.gz"), "."])


def step_engine(c: Campaign) -> None:
    """Docker 26.1 with CDI: gpu-host-engine.sh starts it (shell: the host has nothing else to start dockerd)."""
    if c.shell.act(["env", "STEPS=engine", "bash", str(HERE / "gpu-runs" / "gpu-host-engine.sh"),
                    c.settings.payload, str(c.settings.outdir)]) != 0:
        raise c.log.die("engine step failed")


def ensure_cryptography(c: Campaign) -> None:
    """The tool signs verdicts with `cryptography`, which a GPU host's Python may lack: its wheels (and cffi's)
    travel among vLLM's requirements; they go where the tool's other wheels went."""
    deps = Path(c.settings.payload) / "wheels" / "deps"
    if not deps.is_dir() or c.shell.run([c.settings.python, "-c", "import cryptography"], QUIET_ALL) == 0:
        return
    wheels = [str(p) for pat in ("cryptography-*.whl", "cffi-*.whl", "pycparser-*.whl")
              for p in sorted(deps.glob(pat))]
    if c.shell.act([c.settings.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--upgrade", "--target", f"{c.settings.work}/site", *wheels],
                   into(c.settings.log_path)) != 0:
        raise c.log.die("cannot install cryptography for the tool")


QUIET_ALL = Output(console=False, both=True)


def have_image(c: Campaign, ref: str) -> bool:
    code = f"import docker; docker.DockerClient(base_url='{c.env['DOCKER_HOST']}').images.get('{ref}')"
    return c.shell.run([c.settings.python, "-c", code], QUIET_ALL) == 0


def step_base(c: Campaign) -> None:
    s = c.settings
    stamp = Path(f"{s.work}/base.parts")
    made_from = stamp.read_text().strip() if stamp.is_file() else None
    if not s.dry_run and have_image(c, s.base) and made_from == c.parts_sum:
        c.log.line(f"GPU base {s.base} already there, made from these parts")
        return
    deps = Path(s.payload) / "wheels" / "deps"
    count = sum(not p.name.startswith(".") for p in deps.iterdir()) if deps.is_dir() else 0
    c.log.line(f"GPU base {s.base}: host filesystem + CUDA toolkit + vLLM 0.25.1 + {count} wheels")
    if c.shell.act([s.python, "gpu-runs/gpu_host.py", "base", s.base, "--vllm-src", f"{s.work}/src", "--wheels",
                    str(deps), "--python", s.python, "--cuda"], into(s.log_path)) != 0:
        raise c.log.die("GPU base failed (see run.log)")
    stamp.write_text(c.parts_sum + "\n")
    for old in Path(s.work).glob("inputs-*.json"):  # a new base: its hash is written again
        old.unlink()
    c.log.line(f"GPU base done: {c.log.last()}")


def build_image(c: Campaign, said: str, argv: list[str], failed: str, done: str) -> None:
    """One `build.py image`: said, built (its output into run.log), and its last line said with ``done``."""
    if said:
        c.log.line(said)
    if c.shell.act([c.settings.python, *argv], into(c.settings.log_path)) != 0:
        raise c.log.die(f"{failed} (see run.log)")
    c.log.line(f"{done}: {c.log.last()}")


def image_argv(s: Settings, tag: str, root: str | None = None, assemble: bool = False) -> list[str]:
    return ["build.py", *(["--root", root] if root else []), "image", "--definition", TAG, "--base-repo", s.repo,
            "--pull", "never", "--no-smoke", *(["--builder", "assemble"] if assemble else []), "--tag", tag]


def step_image(c: Campaign) -> None:
    s = c.settings
    argv = ["build.py", "image", "--definition", TAG, "--base-repo", s.repo, "--pull", "never", "--no-smoke",
            "--tag", s.patched]
    build_image(c, f"build.py image --definition {TAG} --base-repo {s.repo} --pull never", argv,
                "build.py image failed", "image done")


def step_refimage(c: Campaign) -> None:
    # Another image of the same definition: the reference answers must not come from the image judged.
    s = c.settings
    build_image(c, f"build.py image --builder assemble --tag {s.refimage} (the reference image)",
                image_argv(s, s.refimage, assemble=True), "build.py image --builder assemble failed",
                "reference image done")


def step_backports(c: Campaign, kind: str, names: list[str]) -> None:
    """The broken backports (gpu-runs/mutants/) and the correct ones written another way (gpu-runs/variants/),
    each built from a project root of its own with its patch in the real patch's place; a broken one named in
    RECORD_MUTANTS also by the assemble builder: the recording image of step badrecord."""
    s = c.settings
    for name in names:
        root = f"{s.roots(kind)}/{name}"
        c.log.line(f"{kind} {name}: build.py --root {root} image (gpu-runs/{kind}s/{name}.patch in the real "
                   "patch's place)")
        if c.shell.act([s.python, "gpu-runs/mutants.py", "root", name, root], into(s.log_path)) != 0:
            raise c.log.die(f"mutants.py root {name} failed")
        build_image(c, "", image_argv(s, f"{s.repo}:{TAG}-{kind}-{name}", root),
                    f"build.py image of {kind} {name} failed", f"{kind} {name} done")
        if kind == "mutant" and name in s.record_mutants:
            build_image(c, "", image_argv(s, f"{s.repo}:{TAG}-{kind}-{name}-assembled", root, assemble=True),
                        f"build.py image --builder assemble of {kind} {name} failed",
                        f"{kind} {name} (assemble builder) done")


def step_model(c: Campaign, m: Model) -> None:
    if Path(m.folder, "model.safetensors").is_file():
        return
    c.log.line(f"model {m.name}: tiny_minimax_m3.py --seed {m.seed} --layers {m.layers}")
    if c.shell.act([c.settings.python, "gpu-runs/tiny_minimax_m3.py", m.folder, "--seed", m.seed, "--layers",
                    m.layers], tee(c.settings.log_path)) != 0:
        raise c.log.die(f"model {m.name} failed")
    m.inputs.unlink(missing_ok=True)


def check_inputs(c: Campaign, m: Model) -> None:
    """Inputs kept on the host are reused only when their hashes are the ones written when they were made."""
    s = c.settings
    if m.inputs.is_file():
        if c.shell.act([s.python, "gpu-runs/gpu_host.py", "inputs", "--model", m.folder, "--base", s.base,
                        "--check", str(m.inputs)], QUIET) != 0:
            raise c.log.die(f"an input changed since {m.inputs} was written (see the line above); remove it to "
                            "start again")
        return
    if c.shell.act([s.python, "gpu-runs/gpu_host.py", "inputs", "--model", m.folder, "--base", s.base, "--write",
                    str(m.inputs)], QUIET) != 0:
        raise c.log.die("cannot hash the inputs")
    c.log.line(f"inputs of {m.name} hashed into {m.inputs}")


def step_topk(c: Campaign) -> None:
    s = c.settings
    c.log.line("topk: gpu_topk_layout.py against the base, the real patch, every variant and every mutant")
    if c.shell.act([s.python, "gpu-runs/topk_table.py", "prepare", f"{s.work}/src", f"{s.work}/topk"],
                   into(s.log_path)) != 0:
        raise c.log.die("topk_table.py prepare failed (see run.log)")
    rc = c.shell.act([s.python, "gpu-runs/topk_table.py", "run", f"{s.work}/topk", "--vllm-src", f"{s.work}/src",
                      "--wheels", f"{s.payload}/wheels/deps", "--out", str(s.outdir / "topk-table")],
                     tee(s.log_path, both=True))
    c.log.line(f"topk: exit code {rc} ({s.outdir}/topk-table/table.md)")


# Run by the host's Python in the base with the GPU (the docker SDK is the tool's, in WORK/site).
IMPORTS_IN_BASE = '''
import sys, docker
image, python = sys.argv[1], sys.argv[2]
code = (
    "import importlib, time\\n"
    "for m in ['vllm.entrypoints.openai.api_server', 'vllm.v1.engine.core', 'vllm.v1.worker.gpu_model_runner',\\n"
    "          'vllm.models.minimax_m3.nvidia.model', 'flashinfer.norm']:\\n"
    "    t = time.monotonic()\\n"
    "    try:\\n"
    "        importlib.import_module(m); print(f'  ok   {m} ({time.monotonic() - t:.1f} s)')\\n"
    "    except Exception as e:\\n"
    "        print(f'  FAIL {m}: {type(e).__name__}: {e}')\\n"
    "import torch; print('  torch', torch.__version__, 'cuda', torch.cuda.is_available())\\n"
)
client = docker.from_env(timeout=600)
gpus = [docker.types.DeviceRequest(driver="cdi", device_ids=["nvidia.com/gpu=all"])]
out = client.containers.run(image, entrypoint=[python, "-c", code], remove=True, stderr=True, device_requests=gpus)
print(out.decode(errors="replace")[-4000:])
'''


def step_check(c: Campaign) -> None:
    s = c.settings
    c.log.line(f"check: imports in {s.base} with the GPU")
    c.shell.act([s.python, "-", s.base, s.python], tee(s.log_path, both=True), stdin=IMPORTS_IN_BASE)


# ---------------------------------------------------------------------------------------------------------------
# Smokes: the signing key, the serve arguments, one smoke, make smoke, the queue.


class Signer:
    """The signing key: made once on this host; only its public half leaves it."""

    def __init__(self, c: Campaign) -> None:
        self.c = c
        self._lock = threading.Lock()

    def ensure(self) -> None:
        with self._lock:
            self._ensure()

    def _ensure(self) -> None:
        s, shell = self.c.settings, self.c.shell
        key, pub = Path(s.key), s.pubkey
        openssl = shell.which("openssl")
        if not key.is_file():
            tmp = Path(f"{s.key}.tmp")
            old = os.umask(0o077)
            try:
                if openssl:
                    ok = shell.run([openssl, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out",
                                    str(tmp)], QUIET) == 0
                else:
                    ok = shell.run([s.python, "-c", MAKE_KEY, str(tmp)], QUIET) == 0
            finally:
                os.umask(old)
            if not ok:
                raise self.c.log.die("cannot make a signing key")
            tmp.replace(key)
            self.c.log.line(f"signing key made: {key}")
        if pub.is_file() and pub.stat().st_size and pub.stat().st_mtime_ns <= key.stat().st_mtime_ns:
            pub.unlink()  # older than the key: another key's
        if pub.is_file() and pub.stat().st_size:
            return  # written already
        if openssl:
            ok = shell.run([openssl, "ec", "-in", str(key), "-pubout", "-out", str(pub)], QUIET_ALL) == 0
        else:
            ok = shell.run([s.python, "-c", PUBLIC_KEY, str(key), str(pub)], QUIET) == 0
        if not ok:
            raise self.c.log.die("cannot write the public key")


MAKE_KEY = """
import sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
key = ec.generate_private_key(ec.SECP256R1())
open(sys.argv[1], 'wb').write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))"""
PUBLIC_KEY = """
import sys
from cryptography.hazmat.primitives import serialization
key = serialization.load_pem_private_key(open(sys.argv[1], 'rb').read(), None)
open(sys.argv[2], 'wb').write(key.public_key().public_bytes(serialization.Encoding.PEM,
                              serialization.PublicFormat.SubjectPublicKeyInfo))"""


def serve_flags(c: Campaign) -> list[str]:
    """The sweep's flags. --enforce-eager: no torch.compile and no CUDA graph capture at start-up (the bug is in
    the kernels' buffer layout, which eager mode runs the same way). --kv-cache-memory-bytes: vLLM sizes the KV
    cache from it instead of measuring the GPU's free memory, so the GPU checks' processes may come and go while
    it starts (the smoke then overlaps the two). No --min-tokens: every reply is judged by the oracle, as a site
    judges its own model, which can stop early. TP=N: every server (the sweep's and the fixed-batch engine) on N
    GPUs, the patch set's GPU checks on each of them; the reference is recorded at N too (a reference of another
    size is refused), so give each TP an OUTDIR."""
    s = c.settings
    flags = ["--concurrency", s.get("CONCURRENCY", "1,2,4,8,16"), "--requests", s.get("REQUESTS", "32")]
    tp = s.get("TP", "1")
    if tp.strip("0123456789") or tp == "0":
        raise c.log.die(f"TP={tp}: a whole number of GPUs, 1 or more")
    if tp != "1":
        flags += ["--serve-arg=--tensor-parallel-size", f"--serve-arg={tp}"]
    kv = s.env.get("KV_BYTES", "2147483648")  # set but empty: vLLM sizes the KV cache itself
    args = ["--max-model-len", "8192", "--enforce-eager", "--gpu-memory-utilization", s.get("SERVE_MEM", "0.05"),
            *(["--kv-cache-memory-bytes", kv] if kv else []), *s.get("SERVE_ARGS", "").split()]
    return flags + [f"--serve-arg={a}" for a in args]


def fitting_parallel(total_mib: int, serve_mem: float, engine_gib: float) -> int:
    """How many smokes fit one GPU side by side. Each vLLM engine still refuses to start unless the GPU's free
    memory is at least SERVE_MEM of its total (vLLM's worker checks it at start-up, KV size given or not), and a
    smoke starts two engines (the server and the fixed-batch probe). With ENGINE_GIB GiB held by each engine
    already running, the last of N smokes' 2N engines starts only where (2N - 1) x ENGINE_GIB + SERVE_MEM x total
    fits the GPU (reasoned from vLLM's check and the tiny model's size, not measured)."""
    return max(1, int(((total_mib / 1024) * (1 - serve_mem) / engine_gib + 1) / 2))


def phases_line(path: Path) -> str:
    """The smoke log's last `==> phases` line (its phase times), or nothing."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    found = [ln for ln in lines if ln.startswith("==> phases")]
    return found[-1] if found else ""


@dataclass(frozen=True)
class Smoke:
    """One `build.py smoke` of an image for a model: its report OUTDIR/NAME/WHICH.json, unless that is there."""

    which: str
    image: str
    limit: str
    args: tuple[str, ...] = ()
    serve: bool = True  # False: the GPU checks alone (the gpuonly step)


def run_smoke(c: Campaign, m: Model, smoke: Smoke, estimate: int) -> None:
    s = c.settings
    report = m.out / f"{smoke.which}.json"
    if report.is_file():
        c.log.line(f"smoke {m.name}/{smoke.which}: done already ({report})")
        return
    # CALL_BUDGET: a smoke this call has no time for is not started (the same STEPS again go on from it); the
    # steps after it still run, the record included, from the reports there are.
    budget = s.env.get("CALL_BUDGET")
    if budget and c.seconds() + estimate > int(budget):
        c.log.line(f"smoke {m.name}/{smoke.which}: not started, {c.seconds()} s into a call of {budget} s; run "
                   "this step again")
        return
    check_inputs(c, m)
    c.signer.ensure()
    served = ["--serve-model", m.folder, *c.serve] if smoke.serve else []
    shown = " (no server)" if not smoke.serve else f" --serve-model {m.folder} {' '.join(c.serve)}"
    c.log.line(f"smoke {m.name}/{smoke.which}: {smoke.image} --gpu require --keep-going --base-repo {s.repo} "
               f"{' '.join(smoke.args)}{shown}")
    start = c.seconds()
    # --base-repo: the definition's base is REPO:v0.25.1 here (the unpatched base's smoke has no build record).
    rc = c.shell.act(["timeout", smoke.limit, s.python, "build.py", "smoke", smoke.image, "--gpu", "require",
                      "--keep-going", "--base-repo", s.repo, *smoke.args, *served, "--sign-key", s.key,
                      "--attestation", str(m.out / f"{smoke.which}.dsse.json"), "--report", str(report)],
                     into(m.out / f"smoke-{smoke.which}.log", append=False))
    c.log.line(f"smoke {m.name}/{smoke.which}: exit code {rc} after {c.seconds() - start} s "
               f"({phases_line(m.out / f'smoke-{smoke.which}.log')})")
    if rc == 124:
        c.log.line(f"smoke {m.name}/{smoke.which}: cut short at {smoke.limit} s; run this step again")


def make_smoke(c: Campaign, m: Model, limit: str) -> None:
    """The first model's third start of the patched image as the runbook runs it: `make smoke` with the
    definition's [smoke] table for gpu, concurrency, requests and the server's arguments, the model, reference
    and key as make's variables. Its verdict is held to the long command's (patched) in the record."""
    s, which = c.settings, "patched-third"
    if (m.out / f"{which}.json").is_file():
        c.log.line(f"smoke {m.name}/{which}: done already ({m.out / f'{which}.json'})")
        return
    c.need_answers(m)
    check_inputs(c, m)
    c.signer.ensure()
    start = c.seconds()
    make = c.shell.which("make") or str(HERE / ".gpucarry" / "make")
    c.log.line(f"smoke {m.name}/{which}: make smoke IMAGE={s.patched} MODEL={m.folder} REFERENCE={m.answers} "
               f"(images/{TAG}.toml [smoke])")
    rc = c.shell.act(["timeout", limit, make, "-C", str(HERE), "smoke", f"PYTHON={s.python}", f"IMAGE={s.patched}",
                      f"MODEL={m.folder}", f"REFERENCE={m.answers}", f"SIGN_KEY={s.key}",
                      f"ARGS=--keep-going --base-repo {s.repo} --attestation {m.out / f'{which}.dsse.json'} "
                      f"--report {m.out / f'{which}.json'}"],
                     into(m.out / f"smoke-{which}.log", append=False))
    c.log.line(f"smoke {m.name}/{which}: exit code {rc} after {c.seconds() - start} s "
               f"({phases_line(m.out / f'smoke-{which}.log')})")


class Queue:
    """At most PARALLEL jobs at once, a new one started as soon as one ends (not in batches that wait for their
    slowest), in the order they are queued. The golden forward is one of the jobs while it runs."""

    def __init__(self, parallel: int) -> None:
        self.parallel = parallel
        self._jobs: list[threading.Thread] = []
        self._ended = threading.Condition()

    def running(self) -> int:
        return sum(t.is_alive() for t in self._jobs)

    def wait_for_a_slot(self) -> None:
        with self._ended:
            while self.running() >= self.parallel:
                self._ended.wait()

    def start(self, job: Callable[[], None]) -> None:
        def body() -> None:
            try:
                job()
            except Refused:
                pass  # said in run.log; that job alone ends, as a queued smoke's shell did
            finally:
                with self._ended:
                    self._ended.notify_all()

        thread = threading.Thread(target=body, daemon=True)
        self._jobs.append(thread)
        thread.start()

    def flush(self) -> None:
        for thread in self._jobs:
            thread.join()
        self._jobs = []


# ---------------------------------------------------------------------------------------------------------------
# The record: each model's record.json from its reports alone.


def record_argv(c: Campaign, m: Model, first: bool) -> list[str]:
    s = c.settings
    more: list[str] = []
    signed: list[str] = []
    # The first model's patched smoke and its make smoke ran alone: theirs are the warm verdicts. The others'
    # ran side by side with the rest (their times are shown, not held to the target).
    more += ["--warm", "patched", "--warm", "patched-third", "--make-smoke", "patched_third"] if first \
        else ["--side-by-side"]
    for name in s.record_mutants:
        if (m.out / f"badrecord-{name}.json").is_file():
            more += ["--bad-recording", f"{name}={m.out / f'badrecord-{name}.json'}"]
    uptime = Path("/proc/uptime")
    if os.access(uptime, os.R_OK):
        (m.out / "host-uptime.txt").write_text(uptime.read_text())
        more += ["--host-uptime", str(m.out / "host-uptime.txt")]
    for which in ("reference", "patched", "patched-again", "patched-third", "unpatched-first", "unpatched"):
        if (m.out / f"{which}.dsse.json").is_file():
            signed += ["--attestation", f"{which.replace('-', '_', 1)}={m.out / f'{which}.dsse.json'}"]
    for which in ("unpatched-first", "patched-again", "patched-third"):
        if (m.out / f"{which}.json").is_file():
            more += [f"--{which}", str(m.out / f"{which}.json")]
    for kind, names in (("mutant", s.mutants), ("variant", s.variants)):
        for name in names:
            if (m.out / f"{kind}-{name}.json").is_file():
                more += [f"--{kind}", f"{name}={m.out / f'{kind}-{name}.json'}"]
            if (m.out / f"{kind}-{name}.dsse.json").is_file():
                signed += ["--attestation", f"{kind}_{name}={m.out / f'{kind}-{name}.dsse.json'}"]
    calls = [a for f in sorted(s.outdir.glob("source-*.json")) for a in ("--source-call", str(f))]
    if (m.out / "golden.json").is_file():
        more += ["--golden-run", str(m.out / "golden.json")]
    return [s.python, "gpu-runs/gpu_host.py", "record", str(m.out / "record.json"),
            "--reference-run", str(m.out / "reference.json"), "--patched", str(m.out / "patched.json"),
            "--unpatched", str(m.out / "unpatched.json"), *more, "--timings", str(s.log_path),
            "--model", m.folder, "--model-made", f"gpu-runs/tiny_minimax_m3.py --seed {m.seed} --layers {m.layers}",
            "--base", s.base, "--reference", str(m.answers), "--inputs-from", str(m.inputs),
            "--public-key", str(s.pubkey), "--target-seconds", s.get("TARGET_SECONDS", "60"),
            "--source-manifest", s.source_manifest, "--source-root", str(HERE), *calls, *signed]


def record_model(c: Campaign, m: Model, first: bool) -> bool:
    """OUTDIR/NAME/record.json; False where a report it needs is missing or gpu_host.py record refused it (said,
    and the next model's is still written: what came back is kept either way)."""
    s = c.settings
    # The record needs these; the other starts, the variants and the mutants are recorded where their reports
    # are (its findings say what is missing).
    for which in ("reference", "patched", "unpatched"):
        if not (m.out / f"{which}.json").is_file() and not s.dry_run:
            c.log.line(f"record {m.name}: no {m.out / f'{which}.json'} yet: run its smoke first")
            return False
    argv = record_argv(c, m, first)
    # The inputs the smokes ran with, kept beside the record (REFERENCE_FROM reads them).
    if m.inputs.is_file():
        shutil.copyfile(m.inputs, m.out / "inputs.json")
    summary = Path(f"{s.log_path}.summary")
    rc = c.shell.act(argv, tee(summary))
    if summary.is_file():
        c.log.raw(summary.read_text(encoding="utf-8", errors="replace"), s.log_path, None)
        summary.unlink()
    if rc != 0:
        c.log.line(f"error: gpu_host.py record of {m.name} refused (exit {rc})")
        return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# The campaign: the steps in their order.


@dataclass
class Campaign:
    settings: Settings
    log: Log
    env: dict[str, str]
    shell: Shell = field(init=False)
    signer: Signer = field(init=False)
    queue: Queue = field(init=False)
    serve: list[str] = field(default_factory=list)
    parts_sum: str = ""
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.shell = Shell(self.settings, self.log, self.env)
        self.signer = Signer(self)
        self.queue = Queue(1)

    def seconds(self) -> int:
        """Seconds since the campaign started (the call's clock CALL_BUDGET counts on)."""
        return int(time.monotonic() - self.started)

    def models(self) -> Iterator[Model]:
        for spec in self.settings.models_text.split():
            yield self.model(spec)

    def model(self, spec: str) -> Model:
        try:
            m = Model.parse(spec, self.settings)
        except ValueError as exc:
            raise self.log.die(str(exc)) from None
        m.out.mkdir(parents=True, exist_ok=True)
        return m

    def first(self) -> Model:
        return self.model(self.settings.models_text.split()[0])

    def is_first(self, m: Model) -> bool:
        return m.name == Model.parse(self.settings.models_text.split()[0], self.settings).name

    def need_answers(self, m: Model) -> None:
        if not m.answers.is_file() and not self.settings.dry_run:
            raise self.log.die(f"no {m.answers}: run the reference step for {m.name} first")

    def queued(self, m: Model, smoke: Smoke) -> None:
        """A smoke in the queue (PARALLEL at once), or now where PARALLEL is 1."""
        if self.queue.parallel <= 1:
            run_smoke(self, m, smoke, int(self.settings.get("SMOKE_ESTIMATE", "110")))
            return
        check_inputs(self, m)
        self.signer.ensure()
        self.queue.wait_for_a_slot()
        estimate = int(self.settings.get("BATCH_ESTIMATE", "200"))
        self.queue.start(lambda: run_smoke(self, m, smoke, estimate))

    def smoke_now(self, m: Model, smoke: Smoke) -> None:
        run_smoke(self, m, smoke, int(self.settings.get("SMOKE_ESTIMATE", "110")))

    def lower_parallel(self) -> None:
        """PARALLEL lowered to what the GPU's memory lets vLLM start (:func:`fitting_parallel`)."""
        s = self.settings
        parallel = int(s.get("PARALLEL", "1"))
        smi = self.shell.which("nvidia-smi")
        if parallel > 1 and smi:
            out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, env=self.env).stdout
            total = "".join(ch for ch in (out.splitlines() or [""])[0] if ch.isdigit())
            if total:
                most = fitting_parallel(int(total), float(s.get("SERVE_MEM", "0.05")),
                                        float(s.get("ENGINE_GIB", "10")))
                if parallel > most:
                    self.log.line(f"PARALLEL={parallel} lowered to {most}: {int(total) // 1024} GiB GPU, SERVE_MEM "
                                  f"{s.get('SERVE_MEM', '0.05')}, {s.get('ENGINE_GIB', '10')} GiB per engine")
                    parallel = most
        self.queue = Queue(parallel)

    def reference_from(self, m: Model) -> None:
        """REFERENCE_FROM=DIR: judge with the reference answers an earlier run recorded (its OUTDIR, kept in
        gpu-runs/: DIR/NAME/answers.json per model), on a model whose hash must equal the one that run's
        DIR/NAME/inputs.json names."""
        earlier = self.settings.env.get("REFERENCE_FROM")
        if not earlier or self.settings.dry_run:
            return
        try:
            want = json.loads(Path(earlier, m.name, "inputs.json").read_text())["inputs"]["model"]["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            raise self.log.die(f"cannot read {earlier}/{m.name}/inputs.json") from None
        try:
            have = json.loads(m.inputs.read_text())["inputs"]["model"]["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            raise self.log.die(f"cannot read {m.inputs} (run the inputs step)") from None
        if want != have:
            raise self.log.die(f"model {m.name} here ({have}) is not the one {earlier} answered with ({want})")
        if not m.answers.is_file():
            try:
                shutil.copyfile(Path(earlier, m.name, "answers.json"), m.answers)
            except OSError:
                raise self.log.die(f"no {earlier}/{m.name}/answers.json") from None
        self.log.line(f"reference answers of {m.name} from {earlier} (model {have}): {sha256_file(m.answers)}")


def setup(c: Campaign) -> None:
    """The steps before any smoke: parts, engine, base, images, backports, models, inputs, topk, check."""
    s = c.settings
    if s.step("unpack"):
        step_unpack(c)
    if s.step("engine"):
        step_engine(c)
    c.env["PYTHONPATH"] = f"{s.work}/site"
    ensure_cryptography(c)
    if s.step("base"):
        step_base(c)
    if s.step("image"):
        step_image(c)
    if s.step("refimage"):
        step_refimage(c)
    if s.step("mutants"):
        step_backports(c, "mutant", s.mutants)
    if s.step("variants"):
        step_backports(c, "variant", s.variants)
    if s.step("model"):
        for m in c.models():
            step_model(c, m)
    if s.step("inputs"):
        for m in c.models():
            check_inputs(c, m)
    if s.step("topk"):
        step_topk(c)
    if s.step("check"):
        step_check(c)


def smokes(c: Campaign) -> None:
    """The campaign's order (one GPU, PARALLEL smokes at once):
      1. every model's reference recorded side by side, cold (the compile caches emptied once, before the first;
         a recording's cache is a folder of its own anyway), and beside them the first model's base without a
         reference (unpatched-first): the base writes the shared compile cache in place, so that
      2. the first model's patched image, alone, is the first smoke of a new image on a host whose base is warm
         and the campaign's warm verdict with every judge; then alone its third start through `make smoke` and
         the definition's [smoke] table (patched-third);
      3. side by side, in this order (a run cut short loses the later models' backports first): the recordings
         of broken backports' second builds (badrecord, which the golden must refuse), the first model's base
         and second start, every model's variants and mutants, the later models' base and three starts; the
         golden forward of each model (golden_run.py, the host's torch) beside them."""
    s = c.settings
    warm, cold = s.get("TIMEOUT_WARM", "240"), s.get("TIMEOUT_REFERENCE", "540")
    if s.step("gpuonly"):
        # The GPU checks alone: the layer identity check, the isolated runner and the patch set's GPU checks on
        # this GPU, in minutes. They do not depend on the model: the first model's folder holds them.
        first = c.first()
        c.smoke_now(first, Smoke("gpuonly-patched", s.patched, warm, serve=False))
        c.smoke_now(first, Smoke("gpuonly-unpatched", s.base, warm, ("--definition", TAG), serve=False))

    # 1. The recordings, cold, and the first model's base beside them.
    if s.step("reference"):
        if not (c.first().out / "reference.json").is_file():
            c.shell.act(["rm", "-rf", f"{s.cache}/compile"])
        for m in c.models():
            if not (m.out / "reference.json").is_file():
                m.answers.unlink(missing_ok=True)
            c.queued(m, Smoke("reference", s.refimage, cold, ("--record-reference", str(m.answers))))
    if s.step("unpatched1"):
        # No reference yet (its answers are being recorded beside it): judged by form; its report says how the
        # base ran.
        c.queued(c.first(), Smoke("unpatched-first", s.base, cold, ("--definition", TAG)))
    c.queue.flush()
    if any(s.step(n) for n in ("patched", "patched2", "patched3", "makesmoke", "unpatched", "golden",
                               "variantsmoke", "mutantsmoke")):
        for m in c.models():
            c.reference_from(m)

    # 2. Alone: the first model's patched image (the long command), then its third start through make smoke.
    for m in c.models():
        if not c.is_first(m):
            continue
        if s.step("patched"):
            c.need_answers(m)
            c.smoke_now(m, Smoke("patched", s.patched, warm, ("--reference", str(m.answers))))
        if s.step("makesmoke") or s.step("patched3"):
            make_smoke(c, m, warm)

    # 3. Side by side. The broken backports' second builds (the assemble builder) as recording images: the golden
    # must refuse each recording (nothing written), where the recording of a backport that is wrong without
    # crashing would otherwise judge every later run against itself.
    for m in c.models():
        if c.is_first(m) and s.step("badrecord"):
            for name in s.record_mutants:
                answers = m.out / f"badrecord-{name}.answers.json"
                answers.unlink(missing_ok=True)
                c.queued(m, Smoke(f"badrecord-{name}", f"{s.repo}:{TAG}-mutant-{name}-assembled", cold,
                                  ("--root", f"{s.roots('mutant')}/{name}", "--record-reference", str(answers))))
    if s.step("golden"):
        c.queue.start(lambda: golden(c))
    first = c.first()
    side_by_side(c, first)
    for m in c.models():
        if not c.is_first(m):
            side_by_side(c, m)
    c.queue.flush()


def golden(c: Campaign) -> None:
    """The golden forward of each model against its reference answers (host's torch; no engine, no vLLM)."""
    for m in c.models():
        if (m.out / "golden.json").is_file():
            c.log.line(f"golden {m.name}: done already ({m.out / 'golden.json'})")
            continue
        c.need_answers(m)
        c.log.line(f"golden {m.name}: golden_run.py {m.folder} --reference {m.answers}")
        rc = c.shell.act([c.settings.python, "gpu-runs/golden_run.py", m.folder, "--reference", str(m.answers),
                          "--out", str(m.out / "golden.json")], into(m.out / "golden.log", append=False))
        if rc != 0:
            c.log.line(f"golden {m.name}: exit code {rc} (see {m.out / 'golden.log'})")


def side_by_side(c: Campaign, m: Model) -> None:
    """A model's queued smokes: the base, the patched image's later starts (the first model's first and third
    ran alone), every variant, its broken backports (every one for the first model, MUTANTS_OTHERS for the
    others)."""
    s = c.settings
    warm = s.get("TIMEOUT_WARM", "240")
    first = c.is_first(m)
    judged = ("--reference", str(m.answers))
    # The base carries no labels: --definition judges it by the patch set it lacks.
    if s.step("unpatched"):
        c.need_answers(m)
        c.queued(m, Smoke("unpatched", s.base, warm, ("--definition", TAG, *judged)))
    if not first and s.step("patched"):
        c.need_answers(m)
        c.queued(m, Smoke("patched", s.patched, warm, judged))
    if s.step("patched2"):
        c.need_answers(m)
        c.queued(m, Smoke("patched-again", s.patched, warm, judged))
    if not first and (s.step("patched3") or s.step("makesmoke")):
        c.need_answers(m)
        c.queued(m, Smoke("patched-third", s.patched, warm, judged))
    if s.step("variantsmoke"):
        c.need_answers(m)
        for name in s.variants:
            c.queued(m, Smoke(f"variant-{name}", f"{s.repo}:{TAG}-variant-{name}", warm,
                              ("--root", f"{s.roots('variant')}/{name}", *judged)))
    if s.step("mutantsmoke"):
        c.need_answers(m)
        for name in (s.mutants if first else s.mutants_others or s.mutants):
            c.queued(m, Smoke(f"mutant-{name}", f"{s.repo}:{TAG}-mutant-{name}", warm,
                              ("--root", f"{s.roots('mutant')}/{name}", *judged)))


def records(c: Campaign) -> None:
    missing = False
    for m in c.models():
        missing |= not record_model(c, m, c.is_first(m))
    if missing:
        raise c.log.die("a model's record is missing a report (see above): run its smokes, then record")


def run(c: Campaign) -> None:
    check_source(c.settings, c.log)
    c.parts_sum = parts_sum(c.settings)
    setup(c)
    c.serve = serve_flags(c)
    c.lower_parallel()
    smokes(c)
    if c.settings.step("record"):
        records(c)
    c.log.line("done")


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None,
         stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", metavar="PARTS_DIR", help="part-NN and SHA256SUMS from gpu-runs/bundle-serve.sh")
    ap.add_argument("outdir", metavar="OUTDIR", help="where run.log, the reports and the records go (outside the "
                                                     "checkout)")
    args = ap.parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    out, err = stdout or sys.stdout, stderr or sys.stderr
    settings = Settings.read(args.parts, args.outdir, env)
    # Refused before anything is made: an OUTDIR inside the checkout would be files beside the commit's.
    if f"{settings.outdir}/".startswith(f"{HERE}/"):
        out.write(f"error: OUTDIR {settings.outdir} lies inside the checkout {HERE}: put it outside (the source "
                  "check would count its files)\n")
        return 1
    settings.outdir.mkdir(parents=True, exist_ok=True)
    Path(settings.work).mkdir(parents=True, exist_ok=True)
    env.update({"VLLM_HOTFIX_CACHE": settings.cache, "DOCKER_HOST": f"unix://{settings.work}/docker.sock",
                "PYTHONUNBUFFERED": "1"})
    campaign = Campaign(settings, Log(settings.log_path, out, err), env)
    try:
        run(campaign)
    except Refused:
        campaign.queue.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
