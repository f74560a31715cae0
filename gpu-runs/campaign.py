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
  makesmoke the first model's third start, first in the queue: `make smoke` with images/v0.25.1.toml's
            [smoke] table (patched-third.json); the later models' third start by the long command
  badrecord the first model's recordings from the second builds (assemble builder) of the broken
            backports RECORD_MUTANTS: the golden must refuse each (nothing written)
  worlds    (not in the default) per model, beside the smokes that follow the first model's patched image alone:
            gpu-runs/golden_worlds.py scores the replies
            the recording's golden check scored (kept or refused) again in several computations of the golden
            (OUTDIR/NAME/worlds.json): which rule of ambiguity and which margin would judge them rightly
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
host's start). Seconds the H100 campaign of 2026-12-07 (gpu-runs/
h100-2026-12-07-worlds/) took: setup (unpack, engine, base, images,
backports, models, inputs) 163; the three recordings cold side by side
357-393, of which the golden's envelope 30-43 (now measured while each
runs); a warm smoke alone 73-84 (issue 61); smokes eight side by side
100-170 each. Planned for the record's steps (gpu-runs/README.md: no bad
recordings, no worlds): setup about 170 + the recordings beside the first
base's run about 360 + the first model's patched image alone about 80 + 35
smokes eight at a time, make smoke first, about 575 + records 20: about
1,200 s, with the host's start and the parts' transfer about 1,300 s. The
queue starts a smoke as soon as one ends (not in batches). With

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

REFERENCE_FROM (an earlier run's OUTDIR: its NAME/answers.json, with its signature and its recording's
signed verdict beside it, for a model of the same hash; the smokes check them with the site key, so the
earlier run's key must be this one's: SIGN_KEY_FROM, a PEM the calls carry, never committed). Only over the
same base: a reference names the base image it was recorded over, and a GPU host's base is made from its own
filesystem, so another host's answers never serve (:func:`reference_from` says so, and the model is recorded
again where the reference step runs).
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
SERVE_ARGS (extra `vllm serve` arguments), FIRST_ALONE (1; 0: the first model's patched image in the
queue, not alone), TIMEOUT_REFERENCE (540),
TIMEOUT_WARM (240) seconds per smoke (the tool cleans up on TERM),
TARGET_SECONDS (60, the record's smoke time target for the warm runs),
SOURCE_MANIFEST, DRY_RUN (1: print each engine-touching command as one
shell-quoted `+ ...` line into run.log instead of running it, and say where a
source check would refuse; a self-test of the steps' logic without a GPU or an
engine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from campaign_core import HERE, TAG, Context, Log, Model, Refused, Settings, into, sha256_file  # noqa: E402
from campaign_record import records  # noqa: E402
from campaign_setup import check_source, parts_sum, setup  # noqa: E402
from campaign_smoke import Smoke, Smokes, parallel, serve_flags  # noqa: E402


def reference_from(c: Context, m: Model) -> bool:
    """REFERENCE_FROM=DIR: judge with the reference answers an earlier run recorded (its OUTDIR, kept in
    gpu-runs/: DIR/NAME/answers.json per model), on a model whose hash must equal the one that run's
    DIR/NAME/inputs.json names. Whether ``m`` has them here now (False: none asked for, or they cannot serve).

    A reference is judged only over the base it was recorded on (its ``base_image_id``, one of the settings a
    smoke refuses a reference under others of): a GPU host makes its base from its own filesystem, so another
    host's base, or this one's made again, is another image and the earlier answers cannot serve here. That is
    said, nothing is copied, and the model is recorded again where the reference step runs."""
    earlier = c.settings.env.get("REFERENCE_FROM")
    if not earlier or c.settings.dry_run:
        return False
    try:
        want = json.loads(Path(earlier, m.name, "inputs.json").read_text())["inputs"]["model"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise c.log.die(f"cannot read {earlier}/{m.name}/inputs.json") from None
    try:
        inputs = json.loads(m.inputs.read_text())["inputs"]
        have, base = inputs["model"]["sha256"], inputs["base"]["id"]
    except (OSError, ValueError, KeyError, TypeError):
        raise c.log.die(f"cannot read {m.inputs} (run the inputs step)") from None
    if want != have:
        raise c.log.die(f"model {m.name} here ({have}) is not the one {earlier} answered with ({want})")
    source = Path(earlier, m.name, "answers.json")
    try:
        recorded_over = json.loads(source.read_text())["settings"]["base_image_id"]
    except (OSError, ValueError, KeyError, TypeError):
        raise c.log.die(f"cannot read the base {source} was recorded over") from None
    if recorded_over != base:
        c.log.line(f"reference answers of {m.name} from {earlier}: recorded over base {recorded_over}, this host's "
                   f"base is {base}; a reference is judged only over the base it was recorded on, so {m.name}'s is "
                   "recorded again here" + ("" if c.settings.step("reference") else
                                            " (not this call: STEPS has no reference step)"))
        return False
    if not m.answers.is_file():
        copy_reference(source, m.answers)
    c.log.line(f"reference answers of {m.name} from {earlier} (model {have}, base {base}): {sha256_file(m.answers)}")
    return True


def copy_reference(source: Path, dest: Path) -> None:
    """A recorded reference and, where they lie beside it, its signature and its recording's signed verdict
    (``NAME.dsse.json``, ``NAME.verdict.dsse.json``): a smoke judged by it checks both with the site key
    (SIGN_KEY_FROM, where the key that signed them is to be the one here too)."""
    for suffix in (".dsse.json", ".verdict.dsse.json"):
        beside = source.with_name(source.stem + suffix)
        if beside.is_file():
            shutil.copyfile(beside, dest.with_name(dest.stem + suffix))
    shutil.copyfile(source, dest)


def in_order(c: Context, smokes: Smokes) -> None:
    """The campaign's order (one GPU, PARALLEL smokes at once):
      1. every model's reference recorded side by side, cold (the compile caches emptied once, before the first;
         a recording's cache is a folder of its own anyway), and beside them the first model's base without a
         reference (unpatched-first): the base writes the shared compile cache in place, so that
      2. the first model's patched image, alone, is the first smoke of a new image on a host whose base is warm
         and the campaign's warm verdict with every judge; then, first in the queue, its third start through
         `make smoke` and the definition's [smoke] table (patched-third);
      3. side by side, in this order (a run cut short by CALL_BUDGET loses the extras, not a model): every
         model's base and the later models' patched image, the recordings of broken backports' second builds
         (badrecord, which the golden must refuse), the other starts, every model's variants, the broken
         backports every model is judged with (MUTANTS_OTHERS), the first model's others; the golden forward of
         each model (golden_run.py, the host's torch) beside them."""
    s = c.settings
    if s.step("gpuonly"):
        gpu_only(c, smokes)
    reused = {m.name for m in c.models() if reference_from(c, m)}
    recordings(c, smokes, reused)
    smokes.queue.flush()
    alone(c, smokes)
    if s.step("golden"):
        smokes.queue.start(lambda: golden(c))
    if s.step("worlds"):
        for m in c.models():
            smokes.queue.start(lambda m=m: worlds(c, m))
    for m in c.models():
        essentials(c, smokes, m)
    bad_recordings(c, smokes)
    for m in c.models():
        more_starts(c, smokes, m)
    for m in c.models():
        variant_smokes(c, smokes, m)
    common = s.mutants_others or s.mutants
    for m in c.models():
        mutant_smokes(c, smokes, m, common)
    mutant_smokes(c, smokes, c.first(), [n for n in s.mutants if n not in common])
    smokes.queue.flush()


def gpu_only(c: Context, smokes: Smokes) -> None:
    """The patched image and the base with their GPU checks alone (no server, no reference): the layer identity
    check, the isolated runner and the patch set's GPU checks on this GPU, in minutes. They do not depend on the
    model: the first model's folder holds them."""
    s, first, warm = c.settings, c.first(), c.settings.get("TIMEOUT_WARM", "240")
    smokes.now(first, Smoke("gpuonly-patched", s.patched, warm, serve=False))
    smokes.now(first, Smoke("gpuonly-unpatched", s.base, warm, ("--definition", TAG), serve=False))


def recordings(c: Context, smokes: Smokes, reused: set[str]) -> None:
    """1. Every model's reference answers, cold, but those an earlier run's serve here (``reused``), and the first
    model's base beside them."""
    s, cold = c.settings, c.settings.get("TIMEOUT_REFERENCE", "540")
    todo = [m for m in c.models() if m.name not in reused]
    if s.step("reference") and todo:
        if not (todo[0].out / "reference.json").is_file():
            c.shell.act(["rm", "-rf", f"{s.cache}/compile"])
        for m in todo:
            if not (m.out / "reference.json").is_file():
                m.answers.unlink(missing_ok=True)
            smokes.queued(m, Smoke("reference", s.refimage, cold, ("--record-reference", str(m.answers))))
    if s.step("unpatched1"):
        # No reference yet (its answers are being recorded beside it): judged by form; its report says how the
        # base ran.
        smokes.queued(c.first(), Smoke("unpatched-first", s.base, cold, ("--definition", TAG)))


def alone(c: Context, smokes: Smokes) -> None:
    """2. Alone: the first model's patched image (the long command); then, first in the queue, its third start
    through make smoke."""
    s, warm = c.settings, c.settings.get("TIMEOUT_WARM", "240")
    # FIRST_ALONE=0: the first model's patched image joins the queue instead (a campaign short of GPU time gives
    # up the warm measurement, not a verdict).
    start = smokes.now if s.get("FIRST_ALONE", "1") != "0" else smokes.queued
    for m in c.models():
        if not c.is_first(m):
            continue
        if s.step("patched") and c.need_answers(m, "patched smoke"):
            start(m, Smoke("patched", s.patched, warm, ("--reference", str(m.answers))))
        elif s.step("patched"):
            # Its warm time all the same, without answers to judge (the report says which checks did not run).
            start(m, Smoke("patched-unjudged", s.patched, warm))
        if s.step("makesmoke") or s.step("patched3"):
            smokes.make_smoke_queued(m, warm)


def bad_recordings(c: Context, smokes: Smokes) -> None:
    """3. begins: the broken backports' second builds (the assemble builder) as recording images. The golden must
    refuse each recording (nothing written), where the recording of a backport that is wrong without crashing
    would otherwise judge every later run against itself."""
    s, cold = c.settings, c.settings.get("TIMEOUT_REFERENCE", "540")
    for m in c.models():
        if not (c.is_first(m) and s.step("badrecord")):
            continue
        for name in s.record_mutants:
            answers = m.out / f"badrecord-{name}.answers.json"
            answers.unlink(missing_ok=True)
            smokes.queued(m, Smoke(f"badrecord-{name}", f"{s.repo}:{TAG}-mutant-{name}-assembled", cold,
                                   ("--root", f"{s.roots('mutant')}/{name}", "--record-reference", str(answers))))


def worlds(c: Context, m: Model) -> None:
    """The replies the model's recording scored, scored again in several computations of the golden
    (gpu-runs/golden_worlds.py; host's torch, no engine): OUTDIR/NAME/worlds.json, whether the recording was kept or
    refused. A measurement for the record."""
    report, out = m.out / "reference.json", m.out / "worlds.json"
    if out.is_file():
        c.log.line(f"worlds {m.name}: done already ({out})")
        return
    if not report.is_file():
        c.log.line(f"worlds {m.name}: no recording report ({report}); skipped")
        return
    c.log.line(f"worlds {m.name}: golden_worlds.py {m.folder} {report}")
    start = time.monotonic()
    rc = c.shell.act([c.settings.python, "gpu-runs/golden_worlds.py", str(m.folder), str(report), "--out", str(out)],
                     into(m.out / "worlds.log", append=False))
    c.log.line(f"worlds {m.name}: exit code {rc} after {time.monotonic() - start:.0f} s")


def golden(c: Context) -> None:
    """The golden forward of each model against its reference answers (host's torch; no engine, no vLLM)."""
    for m in c.models():
        if (m.out / "golden.json").is_file():
            c.log.line(f"golden {m.name}: done already ({m.out / 'golden.json'})")
            continue
        if not c.need_answers(m, "golden"):
            continue
        c.log.line(f"golden {m.name}: golden_run.py {m.folder} --reference {m.answers}")
        rc = c.shell.act([c.settings.python, "gpu-runs/golden_run.py", m.folder, "--reference", str(m.answers),
                          "--out", str(m.out / "golden.json")], into(m.out / "golden.log", append=False))
        if rc != 0:
            c.log.line(f"golden {m.name}: exit code {rc} (see {m.out / 'golden.log'})")


def essentials(c: Context, smokes: Smokes, m: Model) -> None:
    """What a model's record needs first: its base and (for a later model; the first one's ran alone) its
    patched image; the first without answers ends them."""
    s, warm, judged = c.settings, c.settings.get("TIMEOUT_WARM", "240"), ("--reference", str(m.answers))
    # The base carries no labels: --definition judges it by the patch set it lacks.
    wanted = [("unpatched", "base", s.base, ("--definition", TAG), s.step("unpatched")),
              ("patched", "patched smoke", s.patched, (), not c.is_first(m) and s.step("patched"))]
    queue_while_answered(c, smokes, m, wanted, warm, judged)


def more_starts(c: Context, smokes: Smokes, m: Model) -> None:
    """The patched image's other starts: its second, and (for a later model) its third."""
    s, warm, judged = c.settings, c.settings.get("TIMEOUT_WARM", "240"), ("--reference", str(m.answers))
    wanted = [("patched-again", "second start", s.patched, (), s.step("patched2")),
              ("patched-third", "third start", s.patched, (), not c.is_first(m) and (s.step("patched3") or
                                                                                   s.step("makesmoke")))]
    queue_while_answered(c, smokes, m, wanted, warm, judged)


def queue_while_answered(c: Context, smokes: Smokes, m: Model,
                         wanted: list[tuple[str, str, str, tuple[str, ...], bool]], warm: str,
                         judged: tuple[str, ...]) -> None:
    for which, what, image, args, asked in wanted:
        if not asked:
            continue
        if not c.need_answers(m, what):
            return
        smokes.queued(m, Smoke(which, image, warm, (*args, *judged)))


def variant_smokes(c: Context, smokes: Smokes, m: Model) -> None:
    """Every correct backport written another way, judged as the patched image is: each must pass."""
    s, warm, judged = c.settings, c.settings.get("TIMEOUT_WARM", "240"), ("--reference", str(m.answers))
    if s.step("variantsmoke") and c.need_answers(m, "variants"):
        for name in s.variants:
            smokes.queued(m, Smoke(f"variant-{name}", f"{s.repo}:{TAG}-variant-{name}", warm,
                                   ("--root", f"{s.roots('variant')}/{name}", *judged)))


def mutant_smokes(c: Context, smokes: Smokes, m: Model, names: list[str]) -> None:
    """These broken backports of this model, each judged by its own root's patch set: each must fail."""
    s, warm, judged = c.settings, c.settings.get("TIMEOUT_WARM", "240"), ("--reference", str(m.answers))
    if names and s.step("mutantsmoke") and c.need_answers(m, "mutants"):
        for name in names:
            smokes.queued(m, Smoke(f"mutant-{name}", f"{s.repo}:{TAG}-mutant-{name}", warm,
                                   ("--root", f"{s.roots('mutant')}/{name}", *judged)))


def run(c: Context) -> None:
    check_source(c)
    c.parts_sum = parts_sum(c.settings)
    setup(c)
    smokes = Smokes(c, serve_flags(c), parallel(c))
    try:
        in_order(c, smokes)
    finally:
        smokes.queue.flush()  # a refusal still waits for the smokes already started: their lines come
    if c.settings.step("record"):
        records(c)
    c.log.line("done")


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None,
         stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
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
    try:
        run(Context(settings, Log(settings.log_path, out, err), env))
    except Refused:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
