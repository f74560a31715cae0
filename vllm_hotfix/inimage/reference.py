"""Reference answers: what a trusted image replied, and the settings it replied under.

A server that survives a bug can still answer garbage with HTTP 200, and a
real model may stop early, so neither the status nor the reply's length tells
a wrong answer from a right one. What does is the answer itself, compared
with the answer a trusted image (the site's running image, another build of
the same definition, or an earlier verified hotfix) gave to the same prompt
on the same model. The reference must never come from the code under test:
an unpatched MiniMax-M3 with four index heads on one GPU is wrong even at
concurrency 1, and answers recorded from the judged image itself only show
that it repeats itself. So the file names the image it was recorded from
(``image_id``, its config digest, written by the host that recorded it), and
``smoke`` refuses a reference recorded from the judged image or from its
definition's base (:func:`vllm_hotfix.trust.reference_fit.refuse_judged_image`). What agreement with it
proves is that the judged image reproduces that image's answers; a wrong
backport built twice would agree with itself, which is why the reference
must be another image the site trusts, signed with the site key
(:mod:`vllm_hotfix.trust.references`).

How replies are judged against it is :mod:`vllm_hotfix.judges.oracle`: bit for bit
at concurrency 1 (and under fixed batches at every level,
:mod:`vllm_hotfix.judges.fixed_batches`). So the file
names what decides the numerics (``settings``: the server's arguments and
environment, the GPU model, the vLLM and torch versions, the base image and
the model), and a run under other settings is refused, naming the
difference (:func:`vllm_hotfix.trust.reference_fit.refuse_other_settings`). It also keeps what
recording measured: ``repeat`` (the prompt set
asked again at concurrency 1 on the same server, which must be bitwise
equal), ``noise`` (the same image at concurrency
:data:`~vllm_hotfix.inimage.oracle.NOISE_CONCURRENCY` against its own answers: how
far its replies moved, a measurement shown beside the runs judged against it,
never a tolerance) and
``prompt_sensitivity`` (distinct replies, and the median gap between the
first token's two best candidates: a model that hardly reads its prompt
makes a weak oracle).
A recording on a host that can run the golden forward (:mod:`vllm_hotfix.golden`)
also keeps ``golden``: the golden's own envelope at the serving dtype (measured
on the golden alone, beside the model's fingerprint in ``settings``), whose
thresholds the ``golden`` check judges at, and the trusted image's noise
against the golden, held to it when it was recorded.

The file is JSON and carries the sha256 of its own canonical content, so a
file changed after it was recorded is refused instead of quietly judging
against other answers.

This module is the file format and the reply types both sides read, pure (no network):
:mod:`vllm_hotfix.inimage.sweep` sends the requests; whether a reference may judge a run, and whether
a recording may be kept, is decided on the host (:mod:`vllm_hotfix.trust.reference_fit`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import NotRegular, UsageError
from ..journal.atomic import opened_regular, write_atomic

log = logging.getLogger(__name__)

FORMAT = "vllm-hotfix-reference/2"
OLD_FORMATS = ("vllm-hotfix-reference/1",)
TOP_LOGPROBS = 5  # top-k the completions API is asked for (vLLM allows up to 20 by default)

# The prompt set. Fixed text, chosen by a hash of (seed, prompt, sentence) rather
# than a random generator, so every version of the tool and of Python makes the
# same prompts. Lengths are mixed as in production: the MiniMax-M3 bug needed
# sequences with different numbers of KV blocks in one batch. 80 sentences are
# about 5,600 characters; the tiny test model's tokenizer makes a token of each
# byte. Every prompt has at least two sentences of context (200 characters and
# more), so it spans more than one 128-token KV block: in
# gpu-runs/h200-2026-12-04-oracle the unpatched base answered the three prompts
# that fitted in one block (no context) exactly as the patched image did, while
# every longer prompt it answered was a wrong answer or an error. A reply that
# never reaches the sparse top-k path tells a broken image from a good one no
# better than its HTTP status does.
SEED = 20261203
PROMPT_COUNT = 24
CONTEXT_SENTENCES = (3, 39, 7, 79, 2, 20, 60, 12)
SENTENCES = (
    "The quick brown fox jumps over the lazy dog while the band plays on. ",
    "A ship in the harbour is safe, but that is not what ships are built for. ",
    "Seven lighthouse keepers counted the waves that broke on the northern rocks. ",
    "The library opens at nine and closes when the last reader leaves the hall. ",
    "Rain fell on the orchard all night, and by morning the river had risen. ",
    "An old clock in the station ran four minutes fast for eleven years. ",
    "The baker sold bread to the miners before the sun came over the hill. ",
    "Two trains left the city at noon, one going east and one going south. ",
    "The committee met on Tuesday and agreed on nothing but the next meeting. ",
    "A map of the coast hung above the desk, its edges brown with age. ",
    "The children built a bridge of sticks across the stream behind the school. ",
    "Every winter the geese flew over the valley in a long uneven line. ",
)
QUESTIONS = (
    "Count from one to ten in words, separated by commas.",
    "Name the days of the week in order.",
    "Write the alphabet from A to M with spaces between the letters.",
    "List five colours of the rainbow.",
)


def _pick(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "big")


def make_prompts(count: int = PROMPT_COUNT, seed: int = SEED) -> tuple[str, ...]:
    """The fixed prompt set: a context of 2 to 79 sentences, then a short question."""
    out = []
    for i in range(count):
        n = CONTEXT_SENTENCES[i % len(CONTEXT_SENTENCES)]
        context = "".join(SENTENCES[_pick(seed, i, j) % len(SENTENCES)] for j in range(n))
        out.append(context + QUESTIONS[_pick(seed, i, -1) % len(QUESTIONS)])
    return tuple(out)


PROMPTS = make_prompts()


@dataclass(frozen=True, slots=True)
class Reply:
    """One completion as the server returned it (tokens None: it returned no logprobs)."""

    text: str
    finish_reason: str
    prompt_tokens: int | None
    completion_tokens: int
    tokens: tuple[str, ...] | None
    logprobs: tuple[float | None, ...]
    top: tuple[dict[str, float], ...]
    model: str = ""  # the model name the answer carried

    @property
    def sha256(self) -> str:
        """Of the reply's tokens where the server named them, else of its text."""
        if self.tokens is not None:
            return tokens_sha256(self.tokens)
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def tokens_sha256(tokens: Sequence[str]) -> str:
    """The sha256 a reply's tokens are named by (the reply's, and a fixed-batch probe reply's)."""
    return hashlib.sha256(json.dumps(list(tokens), separators=(",", ":")).encode("utf-8")).hexdigest()


def _lp(value: Any) -> float | None:
    return None if value is None else float(value)


def parse_reply(body: Any) -> Reply:
    """A completions API answer as a Reply; ValueError when it has no usable choice."""
    try:
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        lp = choice.get("logprobs") or None
        tokens = None
        logprobs: tuple[float | None, ...] = ()
        top: tuple[dict[str, float], ...] = ()
        if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
            tokens = tuple(str(t) for t in lp["tokens"])
            logprobs = tuple(_lp(x) for x in lp.get("token_logprobs") or [])
            top = tuple({str(k): float(v) for k, v in (entry or {}).items()} for entry in lp.get("top_logprobs") or [])
        count = usage.get("completion_tokens")
        prompt_tokens = usage.get("prompt_tokens")
        return Reply(
            text=str(choice.get("text") or ""),
            finish_reason=str(choice.get("finish_reason")),
            prompt_tokens=int(prompt_tokens) if prompt_tokens is not None else None,
            completion_tokens=int(count) if count is not None else len(tokens or ()),
            tokens=tokens, logprobs=logprobs, top=top, model=str(body.get("model") or ""),
        )
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"not a completions answer ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True, slots=True)
class Answer:
    """The reference reply to one prompt."""

    prompt: str
    prompt_tokens: int | None
    tokens: tuple[str, ...]
    logprobs: tuple[float | None, ...]
    top: tuple[dict[str, float], ...]
    finish_reason: str
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "prompt_tokens": self.prompt_tokens, "tokens": list(self.tokens),
                "logprobs": list(self.logprobs), "top_logprobs": [dict(t) for t in self.top],
                "finish_reason": self.finish_reason, "reply_sha256": self.sha256}


def answer_of(prompt: str, reply: Reply) -> Answer:
    assert reply.tokens is not None
    return Answer(prompt, reply.prompt_tokens, reply.tokens, reply.logprobs, reply.top, reply.finish_reason,
                  reply.sha256)


@dataclass(frozen=True, slots=True)
class Reference:
    """Reference answers to a fixed prompt set, recorded at concurrency 1, temperature 0."""

    model: str  # the name the requests asked for
    served_model: str  # the name the server's replies carried
    max_tokens: int
    top_logprobs: int
    answers: tuple[Answer, ...]
    tool_version: str
    recorded: str
    recorded_from: str  # the server's URL (smoke: the image it served)
    sha256: str = ""  # of the canonical content; set by :func:`load` and :func:`write`
    path: str = ""
    settings: dict[str, Any] = field(default_factory=dict)  # what decides the numerics (oracle.SETTING_KEYS)
    noise: dict[str, Any] = field(default_factory=dict)  # oracle.noise: the movement measured at concurrency 16
    repeat: dict[str, Any] = field(default_factory=dict)  # the prompt set asked again at concurrency 1
    prompt_sensitivity: dict[str, Any] = field(default_factory=dict)  # oracle.prompt_sensitivity
    # fixed_batches.record: every level's answers under fixed batches, and the schedule they were recorded under
    levels: dict[str, Any] = field(default_factory=dict)
    # golden.judge.recorded: the golden's envelope at the serving dtype (its thresholds) and the served noise
    golden: dict[str, Any] = field(default_factory=dict)
    image_id: str = ""  # the config digest of the image recorded, as the host knew it ("": not known, serve-check)

    @property
    def prompts(self) -> tuple[str, ...]:
        return tuple(a.prompt for a in self.answers)

    def content(self) -> dict[str, Any]:
        """What the file holds, without its own sha256."""
        return {"format": FORMAT, "model": self.model, "served_model": self.served_model,
                "max_tokens": self.max_tokens, "top_logprobs": self.top_logprobs, "temperature": 0,
                "concurrency": 1, "tool_version": self.tool_version, "recorded": self.recorded,
                "recorded_from": self.recorded_from, "settings": self.settings, "noise": self.noise,
                "repeat": self.repeat, "prompt_sensitivity": self.prompt_sensitivity,
                "answers": [a.to_dict() for a in self.answers],
                # Absent, not empty, where none were recorded: a file written before keeps its sha256.
                **({"levels": self.levels} if self.levels else {}),
                **({"golden": self.golden} if self.golden else {}),
                **({"image_id": self.image_id} if self.image_id else {})}

    def summary(self) -> dict[str, Any]:
        """What a sweep report says about the reference it judged against."""
        return {"file": self.path, "sha256": self.sha256, "model": self.model, "served_model": self.served_model,
                "prompts": len(self.answers), "max_tokens": self.max_tokens, "top_logprobs": self.top_logprobs,
                "recorded": self.recorded, "recorded_from": self.recorded_from, "image_id": self.image_id,
                "tool_version": self.tool_version,
                "settings": self.settings, "noise": self.noise, "repeat": self.repeat,
                "prompt_sensitivity": self.prompt_sensitivity,
                "levels": {k: v for k, v in self.levels.items() if k != "answers"},
                "golden": {k: v for k, v in self.golden.items() if k in ("envelope", "noise", "recorded")}}


def digest(content: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def write(ref: Reference, path: Path) -> Reference:
    """Write ``ref`` to ``path`` with its sha256 inside; the reference as it now stands on disk."""
    content = ref.content()
    sha = digest(content)
    write_atomic(path, json.dumps({**content, "sha256": sha}, indent=1, sort_keys=True) + "\n")
    return replace(ref, sha256=sha, path=str(path))


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, found {type(value).__name__}")
    return value


def load(path: Path, option: str = "--reference") -> Reference:
    """The reference in ``path``; UsageError (one line naming the file) if it is unusable or was changed."""
    where = f"{option} {path}"
    try:
        with opened_regular(path) as (fh, _st):
            data = json.loads(fh.read().decode("utf-8"))
    except NotRegular:
        # A FIFO would be read until its writer closes it.
        raise UsageError(f"{where}: not a regular file") from None
    except OSError as exc:
        raise UsageError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise UsageError(f"{where}: not JSON ({exc})") from None
    if isinstance(data, dict) and data.get("format") in OLD_FORMATS:
        raise UsageError(f"{where}: recorded by an earlier version ({data.get('format')}), without the settings it "
                         "was recorded under or its noise; record it again from a trusted image")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"{where}: not a reference answers file (format {FORMAT!r} expected)")
    sha = data.pop("sha256", None)
    if not isinstance(sha, str) or digest(data) != sha:
        raise UsageError(f"{where}: its content does not match the sha256 it carries (changed after it was "
                         "recorded); record it again from a trusted image")
    try:
        answers = tuple(
            Answer(str(a["prompt"]), None if a["prompt_tokens"] is None else int(a["prompt_tokens"]),
                   tuple(str(t) for t in a["tokens"]), tuple(_lp(x) for x in a["logprobs"]),
                   tuple({str(k): float(v) for k, v in t.items()} for t in a["top_logprobs"]),
                   str(a["finish_reason"]), str(a["reply_sha256"]))
            for a in data["answers"])
        ref = Reference(str(data["model"]), str(data["served_model"]), int(data["max_tokens"]),
                        int(data["top_logprobs"]), answers, str(data["tool_version"]), str(data["recorded"]),
                        str(data["recorded_from"]), sha, str(path), _dict(data["settings"]), _dict(data["noise"]),
                        _dict(data["repeat"]), _dict(data["prompt_sensitivity"]), _dict(data.get("levels") or {}),
                        _dict(data.get("golden") or {}), str(data.get("image_id") or ""))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None
    if not answers or ref.max_tokens < 1:
        raise UsageError(f"{where}: holds no answers")
    return ref


@dataclass(frozen=True, slots=True)
class AnswerOptions:
    """How a sweep judges answers: against a loaded reference, one to record first, or neither."""

    reference: Reference | None
    record: Path | None


def answer_options(reference: Path | None, record: Path | None) -> AnswerOptions:
    """--reference and --record-reference, checked (and the reference loaded) up front.

    A reference that cannot be used, or a recording that would replace one,
    fails here, before a server starts.
    """
    if reference is not None and record is not None:
        raise UsageError("--reference and --record-reference: give one (record once from a trusted image, "
                         "then check against it)")
    if record is not None and record.exists():
        raise UsageError(f"--record-reference {record}: already exists; a reference is recorded once "
                         "(remove it first to record it again)")
    return AnswerOptions(load(reference) if reference is not None else None, record)
