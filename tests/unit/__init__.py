"""Unit tier: pure logic and the CLI's refusals; no engine, no registry, no network."""
