"""Building: from an image definition and its patch set to a patched image on the engine.

The ``image`` and ``render`` steps are :mod:`.pipeline`. It loads the definition (:mod:`.definitions`) and the
patch set (:mod:`.patches`, with its pins in :mod:`.pinfile` and what they do to an image in :mod:`.pins`),
picks one base image or one per platform (:mod:`.platforms`), and runs one prepare step for both: read and
patch the base's files (:mod:`.base`, from the sources and scratch folders of :mod:`.sources`) and fetch the
pinned wheels (:mod:`.wheels`). ``render`` then prints the Dockerfile of :mod:`.render`, a pure function;
``image`` states what the patched files must be (:mod:`.expected`) and has one of :mod:`.builders` make the
image: the engine builds the Dockerfile, with the wheels served by :mod:`.wheelserver`, or :mod:`.assemble`
writes the layer and the engine loads it. ``image --in-registry`` is :mod:`.inregistry`: the same patching
(:mod:`.base`) and the assemble builder's layer and config, with the base read from its registry and the image written
there, no engine; its bytecode from :mod:`.bytecode`. Beside them stand the tools for patch sets and bases:
:mod:`.upstream` (does a newer release still need each patch), :mod:`.newpatch` (a patch from an upstream
change) and :mod:`.standin` (a stand-in base for a machine that cannot pull the real one).
"""
