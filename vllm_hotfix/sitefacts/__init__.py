"""What an image's site folders hold, read from its layers on the host, never by running the image.

The files (:mod:`.site`: one pass over every site folder a judge needs),
kept per layer chain (:mod:`.layer_facts`), and the distributions their
dist-infos describe (:mod:`.dists`). Reading only: the judges of these
facts live in :mod:`vllm_hotfix.judges`.
"""
