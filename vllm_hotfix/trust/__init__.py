"""Trust: signed verdicts that travel with an image and are checked wherever it is pulled.

:mod:`.signing` makes and opens the in-toto statement in its DSSE envelope and handles keys;
:mod:`.referrers` stores envelopes beside the image in the registry; :mod:`.attest` signs what smoke found,
attaches it at push and checks it for ``verify``.
"""
