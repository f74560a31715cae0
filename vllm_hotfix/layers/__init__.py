"""An image's layers: one entry type, the readers of each source, and the one flattener (see :mod:`.flatten`)."""

from __future__ import annotations

from .entry import Folder, Layer, LayerEntry, ancestors, in_words, within
from .flatten import apply, flatten, hides, said, squash

__all__ = ["Folder", "Layer", "LayerEntry", "ancestors", "apply", "flatten", "hides", "in_words", "said", "squash",
           "within"]
