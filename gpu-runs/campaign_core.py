"""What every step of the GPU campaign (campaign.py) is given: the environment read once, the models, run.log and
the console, the engine-touching commands (run, or printed under DRY_RUN), and the run's own clock."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

HERE = Path(os.path.abspath(Path(__file__).parent.parent))
TAG = "v0.25.1"
DEFAULT_STEPS = ("unpack engine base image refimage mutants variants model inputs reference unpatched1 patched "
                 "makesmoke badrecord golden unpatched patched2 variantsmoke mutantsmoke record")


class Refused(Exception):
    """The campaign (or, inside a queued smoke, that smoke) stops here; its run.log line is written already."""


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
QUIET_ALL = Output(console=False, both=True)


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

    def run(self, argv: list[str], out: Output = CONSOLE, stdin: str | None = None, umask: int = -1) -> int:
        """One command now, whatever DRY_RUN says (the steps that touch no engine): its exit code (127 where it
        cannot be started). ``umask``: the command's own (this process's stays, whatever its threads write)."""
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
                                          cwd=self.cwd, check=False, umask=umask).returncode
            stdout = None if out.console else subprocess.DEVNULL
            return subprocess.run(argv, input=data, stdin=given, stdout=stdout, stderr=stderr, env=self.env,
                                  cwd=self.cwd, check=False, umask=umask).returncode
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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Context:
    """The run: its settings, log, commands and clock, the models of MODELS and the inputs kept on the host."""

    settings: Settings
    log: Log
    env: dict[str, str]
    shell: Shell = field(init=False)
    parts_sum: str = ""  # the hash of the parts' SHA256SUMS: what the payload and the base were made from
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.shell = Shell(self.settings, self.log, self.env)

    def seconds(self) -> int:
        """Seconds since the campaign started (the call's clock CALL_BUDGET counts on)."""
        return int(time.monotonic() - self.started)

    def models(self) -> Iterator[Model]:
        """Each model of MODELS in order, each entry checked as it comes (a bad one stops the step there)."""
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

    def need_answers(self, m: Model, what: str) -> bool:
        """Whether ``m`` has reference answers to judge its ``what`` against. A model whose recording wrote none
        (refused, or cut short) has nothing to be judged against: its smokes are not run, said in run.log, and the
        campaign goes on with the other models (the record says what is missing). A dry run records nothing: it
        goes on as if its recordings had written answers, unless a recording was done already (its report there)
        without them."""
        if m.answers.is_file() or (self.settings.dry_run and not (m.out / "reference.json").is_file()):
            return True
        self.log.line(f"no {m.answers} (its recording wrote none: see {m.out}/smoke-reference.log): {m.name}'s "
                      f"{what} not run")
        return False

    def check_inputs(self, m: Model) -> None:
        """Inputs kept on the host are reused only when their hashes are the ones written when they were made."""
        s = self.settings
        if m.inputs.is_file():
            if self.shell.act([s.python, "gpu-runs/gpu_host.py", "inputs", "--model", m.folder, "--base", s.base,
                            "--check", str(m.inputs)], QUIET) != 0:
                raise self.log.die(f"an input changed since {m.inputs} was written (see the line above); remove it to "
                                "start again")
            return
        if self.shell.act([s.python, "gpu-runs/gpu_host.py", "inputs", "--model", m.folder, "--base", s.base, "--write",
                        str(m.inputs)], QUIET) != 0:
            raise self.log.die("cannot hash the inputs")
        self.log.line(f"inputs of {m.name} hashed into {m.inputs}")
