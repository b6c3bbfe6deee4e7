"""adapter_config.json, read strictly: every field loraplex relies on has the type PEFT writes, and
anything that would make loraplex serve the adapter differently from PEFT is refused.

Which modules carry LoRA follows PEFT's own rules (`check_target_module_exists` in PEFT 0.21):
`target_modules` as a list matches a module's name or its dotted suffix, as a string it is a
regular expression over the module's full path (or "all-linear"), null means the architecture's
defaults (q_proj and v_proj for every model loraplex runs); `exclude_modules` removes modules the
same way; `layers_to_transform` keeps only those layers (an empty list keeps all). Patterns come
from tenants, so they run with the `regex` package under a time limit, never unbounded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import regex

from loraplex.engine.errors import AdapterError, ErrorCode, shown

CONFIG_FILE = "adapter_config.json"
# An adapter's scale (lora_alpha / r, or / sqrt(r) with rsLoRA) above this is refused: published
# adapters stay below a few hundred, and a scale like 1e30 only serves to overflow activations.
MAX_LORA_SCALE = 1e4
MAX_RANK_IN_CONFIG = 1 << 16  # far above any servable rank; bounds the arithmetic below
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's default when the file leaves lora_alpha out
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's defaults for Llama, Mistral and Qwen2
PATTERN_SECONDS = 0.01  # per module path: a pattern slower than this is refused

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

Modules = tuple[str, ...] | str  # names, or one regular expression


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: Modules
    exclude_modules: Modules | None
    layers: frozenset[int] | None  # layers_to_transform; None = every layer
    _decisions: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def targets(self, layer: int, module_path: str) -> bool:
        """Whether PEFT puts LoRA on `module_path` (e.g. model.layers.3.self_attn.q_proj)."""
        if self.layers is not None and layer not in self.layers:
            return False
        decision = self._decisions.get(module_path)
        if decision is None:
            excluded = self.exclude_modules is not None and _matches(
                self.exclude_modules, module_path, "exclude_modules"
            )
            decision = not excluded and (
                self.target_modules == "all-linear"
                or _matches(self.target_modules, module_path, "target_modules")
            )
            self._decisions[module_path] = decision
        return decision

    def meaning(self) -> dict:
        """The fields that change the served output (part of the content hash)."""
        return {"r": self.rank, "lora_alpha": self.alpha, "use_rslora": self.use_rslora}


def _matches(modules: Modules, path: str, name: str) -> bool:
    if not isinstance(modules, str):
        return any(path == m or path.endswith(f".{m}") for m in modules)
    try:
        return regex.fullmatch(modules, path, timeout=PATTERN_SECONDS, concurrent=True) is not None
    except TimeoutError:
        raise AdapterError(
            f"{CONFIG_FILE}: the {name} pattern takes too long to match a module name",
            code=ErrorCode.ADAPTER_UNSUPPORTED,
        ) from None


def read_config(directory: Path, modules: tuple[str, ...]) -> AdapterConfig:
    raw = _load_json(directory / CONFIG_FILE)
    _refuse_unsupported(raw, modules)
    rank = raw.get("r")
    if not _is_int(rank) or not 1 <= rank <= MAX_RANK_IN_CONFIG:
        raise _invalid(f"r must be a positive integer, got {shown(rank)}")
    alpha = raw.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if _finite(alpha) is None:
        raise _invalid(f"lora_alpha must be a finite number, got {shown(alpha)}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _invalid(f"use_rslora must be true or false, got {shown(use_rslora)}")
    targets = _modules(raw.get("target_modules"), "target_modules") or PEFT_DEFAULT_TARGETS
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = "all-linear"
    layers = _layers(raw.get("layers_to_transform"))
    if isinstance(targets, str) and targets != "all-linear" and layers is not None:
        raise _invalid("layers_to_transform cannot be used with a target_modules pattern (PEFT)")
    config = AdapterConfig(
        rank=rank,
        alpha=_finite(alpha),
        use_rslora=use_rslora,
        target_modules=targets,
        exclude_modules=_modules(raw.get("exclude_modules"), "exclude_modules"),
        layers=layers,
    )
    if abs(config.scale) > MAX_LORA_SCALE:
        raise _invalid(
            f"the adapter's scale (lora_alpha {config.alpha:g} / "
            f"{'sqrt(r)' if use_rslora else 'r'}, r={rank}) is {config.scale:.3g}; loraplex "
            f"serves scales up to {MAX_LORA_SCALE:g}"
        )
    return config


def _invalid(message: str) -> AdapterError:
    return AdapterError(f"{CONFIG_FILE}: {message}", code=ErrorCode.ADAPTER_CORRUPT)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object) -> float | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _load_json(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise AdapterError(
            f"{path.parent} has no {CONFIG_FILE}", code=ErrorCode.ADAPTER_CORRUPT
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise AdapterError(f"{path} cannot be read: {error}", ErrorCode.ADAPTER_CORRUPT) from None
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as error:  # bad JSON, absurd numbers or nesting
        raise AdapterError(
            f"{path} is not valid JSON: {str(error)[:200]}", code=ErrorCode.ADAPTER_CORRUPT
        ) from None
    if not isinstance(raw, dict):
        raise _invalid(f"must hold a JSON object, got {type(raw).__name__}")
    return raw


def _refuse_unsupported(raw: dict, modules: tuple[str, ...]) -> None:
    def unsupported(message: str) -> AdapterError:
        return AdapterError(message, code=ErrorCode.ADAPTER_UNSUPPORTED)

    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise unsupported(f"adapter type {shown(peft_type)} is not supported (LORA only)")
    for option, label in _UNSUPPORTED_OPTIONS.items():
        if raw.get(option):
            raise unsupported(f"{label} is not supported")
    if raw.get("bias", "none") != "none":
        raise unsupported(f"bias={shown(raw['bias'])} is not supported (bias='none' only)")
    if raw.get("layers_pattern") not in (None, "layers", ["layers"]):
        raise unsupported(f"layers_pattern {shown(raw['layers_pattern'])} is not supported")
    targets = _modules(raw.get("target_modules"), "target_modules")
    for module in [targets] if isinstance(targets, str) else targets or ():
        if module in ("embed_tokens", "lm_head"):
            raise unsupported(f"LoRA on {module} is not supported; supported: {', '.join(modules)}")


def _modules(value: object, name: str) -> Modules | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            regex.compile(value)
        except regex.error as error:
            raise _invalid(f"{name} {shown(value)} is not a valid pattern: {error}") from None
        return value
    if isinstance(value, list) and all(isinstance(m, str) for m in value):
        return tuple(value)
    raise _invalid(f"{name} must be a list of module names or a pattern, got {shown(value)}")


def _layers(value: object) -> frozenset[int] | None:
    if value is None:
        return None
    items = [value] if _is_int(value) else value
    if not isinstance(items, list) or not all(_is_int(i) and i >= 0 for i in items):
        raise _invalid(f"layers_to_transform must be layer indices, got {shown(value)}")
    return frozenset(items) or None  # PEFT: an empty list means every layer
