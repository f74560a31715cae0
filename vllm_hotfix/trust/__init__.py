"""Trust: signed verdicts that travel with an image and are checked wherever it is pulled.

:mod:`.signing` is the one place that builds what is signed (predicate, subjects, statement, PAE), signs
and opens the DSSE envelope, and handles keys; :mod:`.referrers` stores envelopes beside the image in the
registry; :mod:`.attest` signs the verdict the host judged (on the host that started the runner, never in
the image), attaches it at push, and judges every envelope found by one rule: the newest signed verdict
that verifies with a trusted key decides.
"""
