"""The journal: what this host did, kept on disk so that later runs can trust and undo it.

:mod:`.records` appends builds, verdicts, pushes and tag moves; :mod:`.atomic` writes each file whole or not at
all; :mod:`.cache` stores what bases said of themselves, checked at every read; :mod:`.leftovers` finds and
removes what a run that died left in the engine.
"""
