"""Building: from an image definition and its patch set to a patched image on the engine.

The ``image`` step is :mod:`.pipeline`: it loads the definition (:mod:`.definitions`, on the platforms of
:mod:`.platforms`) and the patch set (:mod:`.patches`, with its pins in :mod:`.pinfile` and what they do to an
image in :mod:`.pins`), reads and patches the base's files (:mod:`.base`, from the sources and scratch folders
of :mod:`.sources`), states what the patched files must be (:mod:`.expected`), and has a builder make the image
(:mod:`.builders`: the Dockerfile of :mod:`.render`, whose pinned wheels come from :mod:`.wheels` through
:mod:`.wheelserver`, or the layer that :mod:`.assemble` writes). Beside it stand the tools for patch sets and
bases: :mod:`.upstream` (does a newer release still need each patch), :mod:`.newpatch` (a patch from an
upstream change) and :mod:`.standin` (a stand-in base for a machine that cannot pull the real one).
"""
