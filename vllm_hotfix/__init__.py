"""Turn a published vLLM image into a patched, tested, pushed image."""

from __future__ import annotations

__version__ = "0.2.0"
