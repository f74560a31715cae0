"""The GPU campaign's smokes (campaign.py): the host's signing key, the sweep's flags, how many smokes fit the GPU
side by side, one `build.py smoke`, the third start through `make smoke`, and the queue that starts a smoke as
soon as one ends."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from campaign_core import HERE, QUIET, QUIET_ALL, TAG, Context, Model, Refused, into


class Signer:
    """The signing key: made once on this host, or SIGN_KEY_FROM's (a PEM the calls carried, e.g. in gpu-parts/,
    never committed: the same site key across campaigns, so that a later one judges by references an earlier one
    recorded and signed, REFERENCE_FROM); only its public half leaves the host."""

    def __init__(self, c: Context) -> None:
        self.c = c
        self._lock = threading.Lock()

    def ensure(self) -> None:
        with self._lock:
            self._ensure()

    def _ensure(self) -> None:
        s, shell = self.c.settings, self.c.shell
        key, pub = Path(s.key), s.pubkey
        openssl = shell.which("openssl")
        given = s.env.get("SIGN_KEY_FROM")
        if given and key.is_file() and Path(given).is_file() and Path(given).read_bytes() != key.read_bytes():
            raise self.c.log.die(f"SIGN_KEY_FROM={given}: not the key this host signs with already ({key}); a "
                                 "campaign signs with one key")
        if given and not key.is_file():
            tmp = Path(f"{s.key}.tmp")
            try:
                data = Path(given).read_bytes()
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            except OSError as exc:
                raise self.c.log.die(f"SIGN_KEY_FROM={given}: {exc.strerror or exc}") from None
            tmp.replace(key)
            self.c.log.line(f"signing key from {given}: {key}")
        if not key.is_file():
            tmp = Path(f"{s.key}.tmp")
            # Written by its maker only, from the start (0600); no other file of the run is touched by this.
            if openssl:
                ok = shell.run([openssl, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(tmp)],
                               QUIET, umask=0o077) == 0
            else:
                ok = shell.run([s.python, "-c", MAKE_KEY, str(tmp)], QUIET, umask=0o077) == 0
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


def serve_flags(c: Context) -> list[str]:
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


class Queue:
    """At most PARALLEL jobs at once, a new one started as soon as one ends (not in batches that wait for their
    slowest), in the order they are queued. The golden forward is one of the jobs while it runs."""

    def __init__(self, parallel: int) -> None:
        self.parallel = parallel
        self._jobs: list[threading.Thread] = []
        self._running = 0  # counted by the jobs themselves: a thread that has ended may still look alive
        self._ended = threading.Condition()

    def wait_for_a_slot(self) -> None:
        with self._ended:
            while self._running >= self.parallel:
                self._ended.wait()

    def start(self, job: Callable[[], None]) -> None:
        def body() -> None:
            try:
                job()
            except Refused:
                pass  # said in run.log; that job alone ends, as a queued smoke's shell did
            finally:
                with self._ended:
                    self._running -= 1
                    self._ended.notify_all()

        thread = threading.Thread(target=body, daemon=True)
        with self._ended:
            self._running += 1
        self._jobs.append(thread)
        thread.start()

    def flush(self) -> None:
        for thread in self._jobs:
            thread.join()
        self._jobs = []


def parallel(c: Context) -> int:
    """PARALLEL, lowered to what the GPU's memory lets vLLM start (:func:`fitting_parallel`)."""
    s = c.settings
    parallel = int(s.get("PARALLEL", "1"))
    smi = c.shell.which("nvidia-smi")
    if parallel > 1 and smi:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, env=c.env).stdout
        total = "".join(ch for ch in (out.splitlines() or [""])[0] if ch.isdigit())
        if total:
            most = fitting_parallel(int(total), float(s.get("SERVE_MEM", "0.05")),
                                    float(s.get("ENGINE_GIB", "10")))
            if parallel > most:
                c.log.line(f"PARALLEL={parallel} lowered to {most}: {int(total) // 1024} GiB GPU, SERVE_MEM "
                              f"{s.get('SERVE_MEM', '0.05')}, {s.get('ENGINE_GIB', '10')} GiB per engine")
                parallel = most
    return parallel


class Smokes:
    """The smokes of one run: each signed with the host's key, with the sweep's flags, now or in the queue."""

    def __init__(self, c: Context, serve: list[str], parallel: int) -> None:
        self.c = c
        self.serve = serve
        self.signer = Signer(c)
        self.queue = Queue(parallel)

    def now(self, m: Model, smoke: Smoke) -> None:
        """A smoke alone, now."""
        self.run(m, smoke, int(self.c.settings.get("SMOKE_ESTIMATE", "110")))

    def queued(self, m: Model, smoke: Smoke) -> None:
        """A smoke in the queue (PARALLEL at once), or now where PARALLEL is 1. Its inputs and the key are
        settled before it starts, so that smokes side by side never write them at once."""
        if self.queue.parallel <= 1:
            self.now(m, smoke)
            return
        estimate = int(self.c.settings.get("BATCH_ESTIMATE", "200"))
        self._start(m, lambda: self.run(m, smoke, estimate))

    def _start(self, m: Model, job: Callable[[], None]) -> None:
        """``job`` in the queue once a slot is free, ``m``'s inputs and the key settled first."""
        self.c.check_inputs(m)
        self.signer.ensure()
        self.queue.wait_for_a_slot()
        self.queue.start(job)

    def run(self, m: Model, smoke: Smoke, estimate: int) -> None:
        """One smoke, unless its report is there or CALL_BUDGET has no time left for it."""
        c = self.c
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
        c.check_inputs(m)
        self.signer.ensure()
        served = ["--serve-model", m.folder, *self.serve] if smoke.serve else []
        shown = " (no server)" if not smoke.serve else f" --serve-model {m.folder} {' '.join(self.serve)}"
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


    def make_smoke_queued(self, m: Model, limit: str) -> None:
        """:meth:`make_smoke` in the queue (PARALLEL at once), or now where PARALLEL is 1."""
        if self.queue.parallel <= 1:
            self.make_smoke(m, limit)
            return
        self._start(m, lambda: self.make_smoke(m, limit))

    def make_smoke(self, m: Model, limit: str) -> None:
        """The first model's third start of the patched image as the runbook runs it: `make smoke` with the
        definition's [smoke] table for gpu, concurrency, requests and the server's arguments, the model, reference
        and key as make's variables. Its verdict is held to the long command's (patched) in the record."""
        c = self.c
        s, which = c.settings, "patched-third"
        if (m.out / f"{which}.json").is_file():
            c.log.line(f"smoke {m.name}/{which}: done already ({m.out / f'{which}.json'})")
            return
        if not c.need_answers(m, "make smoke"):
            return
        c.check_inputs(m)
        self.signer.ensure()
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
