"""Where loraplex keeps its data: prepared models, the embedded database, caches."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """`$LORAPLEX_HOME`, else `~/.cache/loraplex`. Created on first use."""
    path = Path(os.environ.get("LORAPLEX_HOME") or Path.home() / ".cache" / "loraplex")
    path.mkdir(parents=True, exist_ok=True)
    return path
