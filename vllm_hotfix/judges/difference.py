"""What a judge answers when an image is not what it must be: where, in which field, what was expected, what was found.

A judge returns a :class:`Difference` or None, never a sentence: a caller
(the verdict, the push gate, a test) reads the fields, and the words a
verdict shows are the difference's own (``str()``). A fault of the host
(a base it could not read, a layer it could not fetch) is an exception of
:mod:`vllm_hotfix.errors`, never a difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Difference:
    path: str  # where: a file's path, "config", "label", "platform", "layers"
    field: str  # what of it: "entry" (there or not), "kind", "sha256", "mode", "target", "opaque", a config key
    expected: str  # what the builder, the base or the wheel gives ("": nothing)
    found: str  # what the image holds ("": nothing)
    words: str  # the sentence a verdict shows

    def __str__(self) -> str:
        return self.words

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "field": self.field, "expected": self.expected, "found": self.found}
