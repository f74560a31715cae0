"""What runs inside the image under test: everything the runner folder carries into it.

The runner (:mod:`.runner`, with the probes' output format :mod:`.runner.probe_output`) and the probes
(:mod:`.probes`), and what the runner carries in beside them: the sweep's sender (:mod:`.sweep`), its recording
(:mod:`.recording`), the reference file format and reply types (:mod:`.reference`) and the oracle's measures
(:mod:`.oracle`). The launchers copy these files (``checking/launchers/base.py`` ``PACKAGE_FILES``) and nothing
else of the package. They import only the verdict types, the error tree and the atomic writer; nothing here
decides a verdict: the host's judges (:mod:`vllm_hotfix.judges`, :mod:`vllm_hotfix.trust.reference_fit`) do,
from the raw replies and the facts the host read itself. A host module imports from here only these shared
formats, the sender and the recording (``tests/unit/test_inimage_boundary.py``).
"""
