"""Reads a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into host memory,
refusing anything loraplex cannot serve exactly, with a message that names the problem.

PEFT stores lora_A as [rank, in_features] and lora_B as [out_features, rank]. loraplex keeps A as
is and B transposed, so that both are `rank` rows of one contiguous vector each:

    a[(layer, module)]: [rank, in_features]    shrink: v = x @ a.T
    b[(layer, module)]: [rank, out_features]   expand: y += scale * v @ b
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from loraplex.engine.adapters.layout import PackedAdapter, PageLayout, layout_for
from loraplex.engine.adapters.peft_config import CONFIG_FILE, AdapterConfig, read_config
from loraplex.engine.config import ModelConfig
from loraplex.engine.errors import AdapterError, ErrorCode
from loraplex.kernels import cpu_lora

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS_FILE = "adapter_model.safetensors"

# a layer's number as PEFT writes it (no leading zero): "layers.07" names no module
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(0|[1-9]\d*)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
BLOCKS = {module: "self_attn" if i < 4 else "mlp" for i, module in enumerate(MODULES)}


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter in host memory, identified by the hash of its config and weights."""

    content_hash: str
    rank: int
    scale: float
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]
    # its matrices laid out as a pool's pages hold them (AdapterManager.pack), by pool layout
    packed: dict = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def nbytes(self) -> int:
        # once: the host cache sums it over every cached adapter at each insertion
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, config.q_size),
        "k_proj": (hidden, config.kv_size),
        "v_proj": (hidden, config.kv_size),
        "o_proj": (config.q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def resolve_adapter_path(path: str | Path, roots: tuple[str, ...] | None) -> Path:
    """The real path of an adapter directory, which must lie inside one of `roots` (if set)."""
    try:
        real = Path(os.path.realpath(Path(path).expanduser()))
        is_dir = real.is_dir()
    except (OSError, ValueError) as error:  # a NUL byte, a name too long, ...
        raise AdapterError(
            f"adapter path {str(path)[:200]!r} is not a usable path: {error}",
            code=ErrorCode.ADAPTER_NOT_FOUND,
        ) from None
    if roots is not None:
        allowed = [Path(os.path.realpath(Path(r).expanduser())) for r in roots]
        if not any(real == root or root in real.parents for root in allowed):
            raise AdapterError(
                f"adapter path {path} is outside the configured adapter roots",
                code=ErrorCode.ADAPTER_OUTSIDE_ROOTS,
            )
    if not is_dir:
        raise AdapterError(
            f"adapter path {path} is not a directory", code=ErrorCode.ADAPTER_NOT_FOUND
        )
    return real


def load_peft_adapter(
    path: str | Path,
    model: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
    roots: tuple[str, ...] | None = None,
) -> LoRAWeights:
    """Read and validate a PEFT LoRA directory; raises AdapterError naming the problem."""
    return AdapterReader(model, max_rank, dtype, roots).read(path)


@dataclass(frozen=True)
class _Plan:
    """Where the bytes of files with one safetensors header go in an adapter's pool pages."""

    size: int  # the file's length in bytes
    layout: PageLayout
    table: torch.Tensor  # the runs of rows, as cpu_lora.CpuPacker takes them
    names: tuple[str, ...]  # the tensor of each run


class AdapterReader:
    """Reads PEFT LoRA directories for one base model, maximum rank and serving dtype.

    Given the pool's page size (the engine's reader), and where the CPU kernels build, it reads
    a file whose safetensors header passed every check before, with the same adapter_config.json,
    straight into the pages of its pool image: one native call that holds no Python lock, in
    place of a conversion and a copy a matrix (240 torch calls for a q,v adapter of 30 layers),
    and the engine then loads that image in one copy. The header and the config decide every
    check but the values' finiteness, which the call makes. Adapters of one shape saved alike
    share their header, so only the first of them goes through the checks tensor by tensor (and
    is laid out by the manager). Safe from any thread."""

    MAX_PLANS = 64

    def __init__(
        self,
        model: ModelConfig,
        max_rank: int,
        dtype: torch.dtype,
        roots: tuple[str, ...] | None = None,
        page_numel: int | None = None,
    ) -> None:
        self.model, self.max_rank, self.dtype, self.roots = model, max_rank, dtype, roots
        self.page_numel = page_numel
        packer = cpu_lora.load_packer() if page_numel is not None else None
        self._packer = packer if packer is not None and packer.supports(dtype) else None
        self._plans: OrderedDict[tuple[bytes, AdapterConfig], _Plan] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, path: str | Path) -> LoRAWeights:
        """Read and validate a PEFT LoRA directory; raises AdapterError naming the problem."""
        directory = resolve_adapter_path(path, self.roots)
        config = read_config(directory, MODULES)
        weights_path = _weights_file(directory)
        data = _read_bytes(weights_path)  # one read: the weights served are the bytes hashed
        content_hash = _content_hash(config, data)
        header = _header(data) if self._packer is not None else None
        # plans are kept by the header's digest (a header may be large) and the config
        key = (hashlib.sha256(header).digest(), config) if header is not None else None
        plan = self._known_plan(key, len(data))
        if plan is not None:
            return self._unpack(plan, data, content_hash, config)
        a, b = _read_tensors(weights_path, data, self.model, config, self.dtype)
        _check_rank(a, b, config.rank, self.max_rank)
        if key is not None:
            self._remember(key, header, len(data), a, b)
        return LoRAWeights(
            content_hash=content_hash, rank=config.rank, scale=config.scale, a=a, b=b
        )

    def _known_plan(self, key: tuple[bytes, AdapterConfig] | None, size: int) -> _Plan | None:
        if key is None:
            return None
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
        # of another length, the checks say what is wrong with it
        return plan if plan is not None and plan.size == size else None

    def _remember(self, key: tuple, header: bytes, size: int, a: dict, b: dict) -> None:
        """Plan the header of a file of `size` bytes that passed every check, unless a tensor's
        dtype is one the native call does not take, or two entries name one matrix (which one
        safetensors took is then not this parser's to say)."""
        start = 8 + len(header)
        entries = [
            (name, dict(fields))
            for name, fields in json.loads(header, object_pairs_hook=list)
            if name != "__metadata__"
        ]
        tensors = {}
        for name, entry in entries:
            source = cpu_lora.PACK_SOURCES.get(entry["dtype"])
            if source is None:
                return
            layer, _, module, kind = _TENSOR_NAME.match(name).groups()
            tensors[(kind.lower(), (int(layer), module))] = (name, source, entry["data_offsets"])
        if not len(entries) == len(tensors) == 2 * len(a):  # an entry for each matrix served
            return
        layout = layout_for(a, b, self.page_numel, self.model.num_layers, MODULES)
        rows, names, image_numel = [], [], layout.num_pages * self.page_numel
        for matrix, (width, chunks) in layout.matrices.items():
            name, source, (first, end) = tensors[matrix]
            itemsize = 4 if source == cpu_lora.PACK_SOURCES["F32"] else 2
            rank = a[matrix[1]].shape[0]
            # a row of A is a row of the file's; a row of B^T a column of its B [out, rank]
            strides = (width, 1) if matrix[0] == "a" else (1, rank)
            for c in chunks:
                at = start + first + c.first_row * strides[0] * itemsize
                to = c.page * self.page_numel + c.offset
                last = at + ((c.num_rows - 1) * strides[0] + (width - 1) * strides[1]) * itemsize
                # the native call trusts the table: each run inside its tensor and the image
                if last + itemsize > start + end or to + c.num_rows * width > image_numel:
                    return
                rows.append((at, source, *strides, c.num_rows, width, to))
                names.append(name)
        plan = _Plan(size, layout, torch.tensor(rows, dtype=torch.int64), tuple(names))
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.MAX_PLANS:
                self._plans.popitem(last=False)

    def _unpack(
        self, plan: _Plan, data: bytes, content_hash: str, config: AdapterConfig
    ) -> LoRAWeights:
        image = torch.zeros(plan.layout.num_pages, self.page_numel, dtype=self.dtype)
        not_finite = self._packer(data, image, plan.table)
        if not_finite >= 0:
            raise _not_finite(plan.names[not_finite], self.dtype)
        packed = PackedAdapter(image=image, layout=plan.layout)
        a, b = {}, {}
        for (kind, key), matrix in packed.matrices().items():
            (a if kind == "a" else b)[key] = matrix
        return LoRAWeights(
            content_hash=content_hash,
            rank=config.rank,
            scale=config.scale,
            a=a,
            b=b,
            packed={(self.page_numel, self.dtype): packed},
        )


def _header(data: bytes) -> bytes | None:
    """A safetensors file's header (its JSON), or None where its length field does not fit."""
    if len(data) < 8:
        return None
    length = int.from_bytes(data[:8], "little")
    return data[8 : 8 + length] if 8 + length <= len(data) else None


def _weights_file(directory: Path) -> Path:
    weights = directory / WEIGHTS_FILE
    if weights.is_file():
        return weights
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise AdapterError(
            f"{directory} holds pickle weights (.bin/.pt), which loraplex never unpickles: "
            f"save the adapter with safetensors ({WEIGHTS_FILE})",
            code=ErrorCode.ADAPTER_UNSUPPORTED,
        )
    raise AdapterError(f"{directory} has no {WEIGHTS_FILE}", code=ErrorCode.ADAPTER_CORRUPT)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise AdapterError(f"{path} cannot be read: {error}", ErrorCode.ADAPTER_CORRUPT) from None


def _read_tensors(
    path: Path, data: bytes, model: ModelConfig, config: AdapterConfig, dtype: torch.dtype
):
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        raise AdapterError(
            f"{path} is not a readable safetensors file (corrupt or truncated?): {error}",
            code=ErrorCode.ADAPTER_CORRUPT,
        ) from None
    served: list[tuple[str, torch.Tensor]] = []
    for name, raw in sorted(tensors.items()):
        layer, module, kind = _parse_name(name, model, config)
        if not raw.is_floating_point():
            raise AdapterError(
                f"adapter tensor {name} holds {raw.dtype} values; LoRA weights are floats",
                code=ErrorCode.ADAPTER_CORRUPT,
            )
        _check_shape(name, raw, model, module, kind)
        # B transposed and converted in one copy; A converted (no copy if the dtypes match)
        tensor = (raw if kind == "A" else raw.t()).to(dtype, memory_format=torch.contiguous_format)
        (a if kind == "A" else b)[(layer, module)] = tensor
        served.append((name, tensor))
    if not a:
        raise AdapterError(f"{path} holds no LoRA weights", code=ErrorCode.ADAPTER_CORRUPT)
    if a.keys() != b.keys():
        missing = sorted(set(a.keys()) ^ set(b.keys()))[0]
        raise AdapterError(
            f"layer {missing[0]} {missing[1]} has only one of lora_A / lora_B",
            code=ErrorCode.ADAPTER_CORRUPT,
        )
    _check_finite(served, dtype)
    return a, b


def _check_finite(served: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Refuse the adapter unless every value is a finite float in the serving dtype. A NaN or
    infinity makes a tensor's sum so: one reduction a tensor and one check for them all (a check
    a tensor cost 1.3 ms of an adapter's read); a sum that overflows is checked element by
    element."""
    sums = torch.stack([tensor.sum() for _, tensor in served])
    if bool(sums.isfinite().all()):
        return
    for (name, tensor), total in zip(served, sums, strict=True):
        if not torch.isfinite(total) and not torch.isfinite(tensor).all():
            raise _not_finite(name, dtype)


def _not_finite(name: str, dtype: torch.dtype) -> AdapterError:
    return AdapterError(
        f"adapter tensor {name} holds NaN or infinite values "
        f"(in the serving dtype, {str(dtype).removeprefix('torch.')})",
        code=ErrorCode.ADAPTER_CORRUPT,
    )


def _parse_name(name: str, model: ModelConfig, config: AdapterConfig) -> tuple[int, str, str]:
    match = _TENSOR_NAME.match(name)
    if match is None:
        if "lora_magnitude_vector" in name:
            raise AdapterError(
                "DoRA (use_dora) is not supported", code=ErrorCode.ADAPTER_UNSUPPORTED
            )
        if "embed" in name or "lm_head" in name:
            raise AdapterError(
                f"adapter tensor {name}: LoRA on embeddings or lm_head is not "
                f"supported; supported: {', '.join(MODULES)}",
                code=ErrorCode.ADAPTER_UNSUPPORTED,
            )
        raise AdapterError(
            f"adapter tensor {name} is not a LoRA weight of a supported module "
            f"({', '.join(MODULES)})",
            code=ErrorCode.ADAPTER_UNSUPPORTED,
        )
    layer, block, module, kind = (
        int(match.group(1)),
        match.group(2),
        match.group(3),
        match.group(4),
    )
    if module not in MODULES:
        raise AdapterError(
            f"adapter tensor {name}: LoRA on {module} is not supported; "
            f"supported: {', '.join(MODULES)}",
            code=ErrorCode.ADAPTER_UNSUPPORTED,
        )
    if block != BLOCKS[module]:  # a second name for the same matrix otherwise
        raise AdapterError(
            f"adapter tensor {name}: the base model has no {block}.{module}",
            code=ErrorCode.ADAPTER_INCOMPATIBLE,
        )
    if layer >= model.num_layers:
        raise AdapterError(
            f"adapter tensor {name} is for layer {layer}; the base model has "
            f"{model.num_layers} layers",
            code=ErrorCode.ADAPTER_INCOMPATIBLE,
        )
    if not config.targets(layer, f"model.layers.{layer}.{block}.{module}"):
        # PEFT would not load this tensor: applying it would serve something else than PEFT
        raise AdapterError(
            f"adapter tensor {name} is outside what {CONFIG_FILE} targets "
            f"(target_modules, layers_to_transform)",
            code=ErrorCode.ADAPTER_CORRUPT,
        )
    return layer, module, kind


def _check_shape(
    name: str, tensor: torch.Tensor, model: ModelConfig, module: str, kind: str
) -> None:
    in_features, out_features = module_shape(model, module)
    if tensor.dim() != 2:
        raise AdapterError(
            f"adapter tensor {name} has shape {tuple(tensor.shape)}; LoRA weights are matrices",
            code=ErrorCode.ADAPTER_CORRUPT,
        )
    rank = tensor.shape[0] if kind == "A" else tensor.shape[-1]
    expected = (rank, in_features) if kind == "A" else (out_features, rank)
    if tuple(tensor.shape) != expected:
        raise AdapterError(
            f"adapter tensor {name} has shape {tuple(tensor.shape)}; the base model needs "
            f"{expected}: is the adapter for another base model?",
            code=ErrorCode.ADAPTER_INCOMPATIBLE,
        )


def _check_rank(a: dict, b: dict, configured: int, max_rank: int) -> None:
    ranks = {t.shape[0] for t in a.values()} | {t.shape[0] for t in b.values()}
    if len(ranks) != 1:
        raise AdapterError(
            f"adapter mixes ranks {sorted(ranks)}; one rank per adapter",
            code=ErrorCode.ADAPTER_UNSUPPORTED,
        )
    rank = ranks.pop()
    if configured != rank:
        raise AdapterError(
            f"{CONFIG_FILE} says r={configured}, the weights have rank {rank}",
            code=ErrorCode.ADAPTER_CORRUPT,
        )
    if rank > max_rank:
        raise AdapterError(
            f"adapter rank {rank} exceeds the configured maximum {max_rank}",
            code=ErrorCode.ADAPTER_RANK_TOO_HIGH,
        )


def save_peft_adapter(
    out_dir: str | Path,
    lora_a: dict[tuple[int, str], torch.Tensor],
    lora_b: dict[tuple[int, str], torch.Tensor],
    lora_alpha: float,
    use_rslora: bool = False,
) -> Path:
    """Write a PEFT LoRA directory from PEFT-shaped tensors: lora_a[(layer, module)] is
    [rank, in_features], lora_b[(layer, module)] is [out_features, rank]."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, module), a in lora_a.items():
        prefix = f"base_model.model.model.layers.{layer}.{BLOCKS[module]}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = lora_b[(layer, module)].contiguous()
    save_file(tensors, out / WEIGHTS_FILE)
    rank = next(iter(lora_a.values())).shape[0]
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": lora_alpha,
        "use_rslora": use_rslora,
        "target_modules": sorted({m for _, m in lora_a}),
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


def random_peft_adapter(
    out_dir: str | Path,
    model: ModelConfig,
    rank: int,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """A synthetic adapter with random weights (for benchmarks and tests)."""
    generator = torch.Generator().manual_seed(seed)
    lora_a, lora_b = {}, {}
    for layer in range(model.num_layers):
        for module in modules:
            in_features, out_features = module_shape(model, module)
            lora_a[(layer, module)] = torch.randn(rank, in_features, generator=generator) * std
            lora_b[(layer, module)] = torch.randn(out_features, rank, generator=generator) * std
    return save_peft_adapter(out_dir, lora_a, lora_b, lora_alpha=2 * rank)


def _content_hash(config: AdapterConfig, weights: bytes) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(config.meaning(), sort_keys=True).encode())
    digest.update(weights)
    return digest.hexdigest()
