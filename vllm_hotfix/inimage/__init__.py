"""What runs inside the image under test: everything the runner folder carries into it.

The runner (:mod:`.runner`) and the probes (:mod:`.probes`), and the host's own sweep code it carries in
(:mod:`.sweep`, :mod:`.recording`, the reference file format :mod:`.reference`, the reply measures of
:mod:`.oracle`): the launchers copy these files (``checking/launchers/base.py`` ``PACKAGE_FILES``) and nothing
else of the package. They import only the verdict types, the error tree and the atomic writer; nothing here
decides a verdict: the host's judges (:mod:`vllm_hotfix.judges`) do, from the raw replies and the facts the host
read itself.
"""
