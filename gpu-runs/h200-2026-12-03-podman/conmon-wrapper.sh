#!/bin/sh
# podman starts conmon (and conmon runc) with an environment of its own: the libraries are named here.
LD_LIBRARY_PATH=/var/lib/vllm-hotfix-gpu/podman/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec /var/lib/vllm-hotfix-gpu/podman/libexec/conmon.bin "$@"
