"""Integration tier: a real Docker engine, real registries, real PyPI wheels."""
