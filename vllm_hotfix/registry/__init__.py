"""The registry: image references, pulls and what the engine alone cannot do with a registry.

:mod:`.refs` checks image references and registry locations before any work; :mod:`.pulling` holds the pull
policy for bases; :mod:`.client` is a small registry v2 client (read a base's index, put the hotfix index);
:mod:`.blobs` reads an image's files from its layer blobs, for a host the Docker engine never sees.
"""
