"""The registry: image references, pulls and what the engine alone cannot do with a registry.

:mod:`.refs` checks image references and registry locations before any work; :mod:`.pulling` holds the pull
policy for bases; :mod:`.client` is a small registry v2 client (read a base's index, put the hotfix index);
:mod:`.blobs` reads an image's files from its layer blobs, for a host the Docker engine never sees. For
``image --in-registry``: :mod:`.remote` reads a base's manifest and config, :mod:`.layerscan` finds where the
package lives and the files a patch set touches in its layers (newest first, left once known), and
:mod:`.write` puts blobs, manifests and tags (mounted or copied, the tags last); :mod:`.pulling` also pulls
such an image by digest for smoke and push.
"""
