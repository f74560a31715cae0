"""The golden: a forward pass of the served model made without vLLM, and the judge of replies against it.

An answer that two builds of the same patch set agree on proves only that
they agree. The golden says what the model computes, from its definition:
:mod:`.config` reads the model folder's ``config.json`` (and refuses what the
forward does not implement), :mod:`.forward` is the MiniMax-M3 text backbone
in plain PyTorch (at float32, and at the serving dtype with the engine's
rounding points; torch is imported there and in :mod:`.envelope` only), :mod:`.envelope` the golden's
own numerical envelope at the serving dtype, :mod:`.coverage` how much a
check judged and its floors, :mod:`.judge`
decides, without torch, whether served replies agree with it where it is
confident, and :mod:`.scoring` runs the forward over the replies a smoke
brought back and hands the judge what it needs. It runs on the host, never in
the image it judges.
"""
