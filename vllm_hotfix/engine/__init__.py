"""The one seam to the container engine.

Nothing else in the package imports ``docker`` or talks to the engine. The
package's parts:

- :mod:`.facade`: :class:`Engine`, the typed operations the pipeline uses;
- :mod:`.containers`: the containers it starts, each removed before the call returns;
- :mod:`.files`: files of an image read from its layers (a container created, never started), hashed as they stream;
- :mod:`.streams`: the streamed work (pull, build, push), progress handed on as it comes;
- :mod:`.pending_load`: a load opened before its archive exists, so the engine starts on it meanwhile;
- :mod:`.mapping`: every SDK, HTTP and socket error as one PipelineError naming the operation;
- :mod:`.registry_errors`: a registry's failure told apart: transient (tried again), unreachable, or final;
- :mod:`.dockerconfig`: references, stored logins, registries the engine trusts without TLS;
- :mod:`.labels`: every label key the tool uses, and the labels its containers get;
- :mod:`.volumes`: overlay volumes, a host folder a container reads whole but writes only to a private layer;
- :mod:`.model`: the data the engine's answers become.

Every engine call goes through the Docker SDK. Importing this package does
not import the SDK (about 85 ms): a command that never calls the engine
(``--help``, a refused argument) does not pay for it; the first engine call does.
"""

from __future__ import annotations

from .containers import Box
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
    "Tree",
    "owner",
    "registry_credentials",
    "registry_of",
    "split_reference",
]
