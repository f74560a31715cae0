"""The GPU campaign's steps before any smoke (campaign.py): what ran (the source check), the parts, the engine,
the GPU base, the images, the backports, the models, their inputs, and the steps outside the default (topk,
check)."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from campaign_core import HERE, QUIET_ALL, TAG, Context, Model, Settings, into, sha256_file, tee

sys.path.insert(0, str(Path(__file__).resolve().parent))

import source_manifest  # noqa: E402


def check_source(c: Context) -> None:
    """The checkout against SOURCE_MANIFEST (source_manifest.py check); refused unless it is that clean commit,
    where DRY_RUN only says so. OUTDIR/source-<time>-<pid>.json keeps this call's check for the record."""
    settings, log = c.settings, c.log
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


def step_unpack(c: Context) -> None:
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


def step_engine(c: Context) -> None:
    """Docker 26.1 with CDI: gpu-host-engine.sh starts it (shell: the host has nothing else to start dockerd)."""
    if c.shell.act(["env", "STEPS=engine", "bash", str(HERE / "gpu-runs" / "gpu-host-engine.sh"),
                    c.settings.payload, str(c.settings.outdir)]) != 0:
        raise c.log.die("engine step failed")


def ensure_cryptography(c: Context) -> None:
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



def have_image(c: Context, ref: str) -> bool:
    code = f"import docker; docker.DockerClient(base_url='{c.env['DOCKER_HOST']}').images.get('{ref}')"
    return c.shell.run([c.settings.python, "-c", code], QUIET_ALL) == 0


def step_base(c: Context) -> None:
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


def build_image(c: Context, said: str, argv: list[str], failed: str, done: str) -> None:
    """One `build.py image`: said, built (its output into run.log), and its last line said with ``done``."""
    if said:
        c.log.line(said)
    if c.shell.act([c.settings.python, *argv], into(c.settings.log_path)) != 0:
        raise c.log.die(f"{failed} (see run.log)")
    c.log.line(f"{done}: {c.log.last()}")


def image_argv(s: Settings, tag: str, root: str | None = None, assemble: bool = False) -> list[str]:
    return ["build.py", *(["--root", root] if root else []), "image", "--definition", TAG, "--base-repo", s.repo,
            "--pull", "never", "--no-smoke", *(["--builder", "assemble"] if assemble else []), "--tag", tag]


def step_image(c: Context) -> None:
    s = c.settings
    argv = ["build.py", "image", "--definition", TAG, "--base-repo", s.repo, "--pull", "never", "--no-smoke",
            "--tag", s.patched]
    build_image(c, f"build.py image --definition {TAG} --base-repo {s.repo} --pull never", argv,
                "build.py image failed", "image done")


def step_refimage(c: Context) -> None:
    # Another image of the same definition: the reference answers must not come from the image judged.
    s = c.settings
    build_image(c, f"build.py image --builder assemble --tag {s.refimage} (the reference image)",
                image_argv(s, s.refimage, assemble=True), "build.py image --builder assemble failed",
                "reference image done")


def step_backports(c: Context, kind: str, names: list[str]) -> None:
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


def step_model(c: Context, m: Model) -> None:
    if Path(m.folder, "model.safetensors").is_file():
        return
    c.log.line(f"model {m.name}: tiny_minimax_m3.py --seed {m.seed} --layers {m.layers}")
    if c.shell.act([c.settings.python, "gpu-runs/tiny_minimax_m3.py", m.folder, "--seed", m.seed, "--layers",
                    m.layers], tee(c.settings.log_path)) != 0:
        raise c.log.die(f"model {m.name} failed")
    m.inputs.unlink(missing_ok=True)


def step_topk(c: Context) -> None:
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


def step_check(c: Context) -> None:
    s = c.settings
    c.log.line(f"check: imports in {s.base} with the GPU")
    c.shell.act([s.python, "-", s.base, s.python], tee(s.log_path, both=True), stdin=IMPORTS_IN_BASE)


def setup(c: Context) -> None:
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
            c.check_inputs(m)
    if s.step("topk"):
        step_topk(c)
    if s.step("check"):
        step_check(c)


