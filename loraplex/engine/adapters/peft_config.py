"""adapter_config.json, read strictly: every field loraplex relies on has the type PEFT writes, and
anything that would make loraplex serve the adapter differently from PEFT is refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from loraplex.engine.errors import AdapterError, ErrorCode

CONFIG_FILE = "adapter_config.json"
# An adapter's scale (lora_alpha / r, or / sqrt(r) with rsLoRA) above this is refused: published
# adapters stay below a few hundred, and a scale like 1e30 only serves to overflow activations.
MAX_LORA_SCALE = 1e4
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's default when the file leaves lora_alpha out

# PEFT options that change what the weights mean: served wrongly if ignored, so refused.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save",
    "lora_bias": "lora_bias",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication",
    "use_qalora": "QALoRA (use_qalora)",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "use_bdlora",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "kasa_config",
    "velora_config": "velora_config",
    "monteclora_config": "monteclora_config",
}


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str | None  # names, or PEFT's regex / "all-linear"
    layers: frozenset[int] | None  # layers_to_transform; None = every layer

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def targets(self, layer: int, module_path: str) -> bool:
        """Whether PEFT puts LoRA on `module_path` (e.g. model.layers.3.self_attn.q_proj)."""
        if self.layers is not None and layer not in self.layers:
            return False
        targets = self.target_modules
        if targets is None or targets == "all-linear":
            return True
        if isinstance(targets, str):
            return re.fullmatch(targets, module_path) is not None
        return any(module_path == t or module_path.endswith(f".{t}") for t in targets)

    def meaning(self) -> dict:
        """The fields that change the served output (part of the content hash)."""
        return {"r": self.rank, "lora_alpha": self.alpha, "use_rslora": self.use_rslora}


def read_config(directory: Path, modules: tuple[str, ...]) -> AdapterConfig:
    raw = _load_json(directory / CONFIG_FILE)
    _refuse_unsupported(raw, modules)
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _invalid(f"r must be a positive integer, got {rank!r}")
    alpha = raw.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _invalid(f"lora_alpha must be a finite number, got {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _invalid(f"use_rslora must be true or false, got {use_rslora!r}")
    config = AdapterConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=_target_modules(raw.get("target_modules")),
        layers=_layers(raw.get("layers_to_transform")),
    )
    if abs(config.scale) > MAX_LORA_SCALE:
        raise _invalid(
            f"the adapter's scale (lora_alpha {alpha} / {'sqrt(r)' if use_rslora else 'r'}, "
            f"r={rank}) is {config.scale:.3g}; loraplex serves scales up to {MAX_LORA_SCALE:g}"
        )
    return config


def _invalid(message: str) -> AdapterError:
    return AdapterError(f"{CONFIG_FILE}: {message}", code=ErrorCode.ADAPTER_CORRUPT)


def _load_json(path: Path) -> dict:
    if not path.is_file():
        raise AdapterError(f"{path.parent} has no {CONFIG_FILE}", code=ErrorCode.ADAPTER_CORRUPT)
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterError(
            f"{path} is not valid JSON: {error}", code=ErrorCode.ADAPTER_CORRUPT
        ) from None
    if not isinstance(raw, dict):
        raise _invalid(f"must hold a JSON object, got {type(raw).__name__}")
    return raw


def _refuse_unsupported(raw: dict, modules: tuple[str, ...]) -> None:
    def unsupported(message: str) -> AdapterError:
        return AdapterError(message, code=ErrorCode.ADAPTER_UNSUPPORTED)

    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise unsupported(f"adapter type {peft_type!r} is not supported (LORA only)")
    for option, label in _UNSUPPORTED_OPTIONS.items():
        if raw.get(option):
            raise unsupported(f"{label} is not supported")
    if raw.get("bias", "none") != "none":
        raise unsupported(f"bias={raw['bias']!r} is not supported (bias='none' only)")
    targets = _target_modules(raw.get("target_modules"))
    for module in [targets] if isinstance(targets, str) else targets or ():
        if module in ("embed_tokens", "lm_head"):
            raise unsupported(f"LoRA on {module} is not supported; supported: {', '.join(modules)}")


def _target_modules(value: object) -> tuple[str, ...] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as error:
            raise _invalid(f"target_modules {value!r} is not a valid pattern: {error}") from None
        return value
    if isinstance(value, list) and all(isinstance(m, str) for m in value):
        return tuple(value)
    raise _invalid(f"target_modules must be a list of module names or a pattern, got {value!r}")


def _layers(value: object) -> frozenset[int] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, int) else value
    ok = isinstance(items, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items
    )
    if not ok:
        raise _invalid(f"layers_to_transform must be layer indices, got {value!r}")
    return frozenset(items)
