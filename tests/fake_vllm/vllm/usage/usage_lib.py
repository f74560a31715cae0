from __future__ import annotations

import enum


class UsageContext(enum.Enum):
    ENGINE_CONTEXT = "ENGINE_CONTEXT"
