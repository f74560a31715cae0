"""Platforms tier: a Docker 26.1 engine that keeps images' platforms, qemu for the other one."""
