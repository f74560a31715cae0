"""The one seam to the container engine.

Nothing else in the package imports ``docker`` or talks to the engine. The
package's parts:

- :mod:`.facade`: :class:`Engine`, the typed operations the pipeline uses;
- :mod:`.containers`: the containers it starts, each removed before the call returns;
- :mod:`.files`: files of an image read from its layers (a container created, never started), hashed as they stream;
- :mod:`.transport`: plain HTTP over the engine's unix socket (``http.client``);
- :mod:`.mapping`: every SDK, HTTP and socket error as one PipelineError naming the operation;
- :mod:`.dockerconfig`: references, stored logins, registries the engine trusts without TLS;
- :mod:`.labels`: every label key the tool uses, and the labels its containers get;
- :mod:`.model`: the data the engine's answers become.

Importing it does not import the Docker SDK (about 150 ms, more than an
unchanged rebuild takes in all): the SDK is imported where it is first used.
"""

from __future__ import annotations

from .containers import Box, Served
from .dockerconfig import registry_credentials, registry_of, split_reference
from .facade import Engine
from .files import FileFact, Tree
from .labels import owner
from .model import EngineFacts, ExecResult, GpuRequest, ImageInfo

__all__ = [
    "Box",
    "Engine",
    "EngineFacts",
    "ExecResult",
    "FileFact",
    "GpuRequest",
    "ImageInfo",
    "Served",
    "Tree",
    "owner",
    "registry_credentials",
    "registry_of",
    "split_reference",
]
