from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass
class EngineArgs:
    model: str = ""
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    async_scheduling: bool | None = None
    disable_log_stats: bool = False
    wrong_at_concurrency: int = 0
    die_at_concurrency: int = 0
    unrepeatable: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--model")
        parser.add_argument("--max-num-seqs", type=int)
        parser.add_argument("--max-num-batched-tokens", type=int)
        parser.add_argument("--max-model-len", type=int)
        parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
        parser.add_argument("--wrong-at-concurrency", type=int, default=0)
        parser.add_argument("--die-at-concurrency", type=int, default=0)
        parser.add_argument("--unrepeatable", action="store_true")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
