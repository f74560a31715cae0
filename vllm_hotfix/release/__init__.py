"""Release: a checked image leaves this host, and a tag can go back.

The ``push`` step is :mod:`.push`: it pushes only an image whose verdict passed, attaches the signed verdict
and proves the image landed. :mod:`.lifecycle` lists what was built, judged and pushed, and rolls a tag back.
"""
