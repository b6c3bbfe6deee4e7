"""Per-step LoRA metadata: built once from the step's token order, applied by every layer.

The flat batch is ordered so that tokens of one adapter are contiguous (the forward batch sorts
decodes by adapter; a prefill span is one sequence, hence one adapter):

    tokens:   base base | a a | b | c c c c c | a a a a
    segments:             (2,2,a) (4,1,b) (5,5,c) (10,4,a)

Two ways to apply them, with the same result:

* `TorchLoRA` (CPU): the native kernel (kernels/cpu/lora.c) reads every decode token's and every
  short prefill span's rows in place; without it, decode tokens whose adapters share rank and
  modules gather all their rows from the pool in one index_select and apply them with two
  batched matmuls. Long prefill spans use plain matmuls on views of the adapter's pool pages.
* `KernelLoRA` (CUDA: Triton; or the torch reference): the shrink/expand kernels over all segments
  in one launch each, adapters addressed through per-row pool offsets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.engine.adapters.manager import ResidentAdapter, changed_modules
from loraplex.engine.adapters.peft_format import MODULES
from loraplex.engine.workspace import Workspace
from loraplex.kernels import cpu_lora
from loraplex.kernels.lora import (
    Segments,
    lora_expand_reference,
    lora_expand_triton,
    lora_shrink_reference,
    lora_shrink_triton,
)

TokenRun = tuple[int, int, ResidentAdapter]  # (start, end, adapter)
# the modules whose outputs are side by side in one projection's output (q, k, v; gate, up), as
# (module, first column, width); they share an input
Modules = tuple[tuple[str, int, int], ...]
# torch path: decode tokens of one adapter at least this many are applied in place from the
# adapter's pages, once for all of them; fewer are gathered with the other decode tokens
# (benchmarks/lora_floor.py)
GROUP_MIN_TOKENS = 2
# with the native kernel: prefill spans up to this long go through it too (per token, the rows in
# cache after the first), longer ones through two matmuls a module. Prefills of 32 prompts on 32
# all-module rank-16 adapters (SmolLM2, Zen 4, 256 tokens a step, alternated in one process),
# kernel against matmuls: 64-token prompts 1.26x faster in bfloat16; 128 tokens 1.10x bfloat16,
# 1.08x float32; 256 tokens 1.04x bfloat16, level in float32
KERNEL_MAX_SPAN = 256
MODULE_INDEX = {module: i for i, module in enumerate(MODULES)}


def adapter_runs(token_adapters: list[ResidentAdapter | None]) -> list[TokenRun]:
    """Maximal runs of consecutive tokens that use the same adapter (base tokens skipped)."""
    runs: list[TokenRun] = []
    for i, adapter in enumerate(token_adapters):
        if adapter is None:
            continue
        if runs and runs[-1][2] is adapter and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1, adapter)
        else:
            runs.append((i, i + 1, adapter))
    return runs


def build_lora_batch(
    backend: str,
    token_adapters: list[ResidentAdapter | None],
    num_decodes: int,
    pool: torch.Tensor,
    workspace: Workspace,
) -> TorchLoRA | KernelLoRA | None:
    """The step's LoRA metadata; the previous step's when its tokens had the same adapters in the
    same order (steady decoding), which saves stacking every adapter's row offsets again."""
    if all(adapter is None for adapter in token_adapters):
        return None
    key = (backend, num_decodes, [id(adapter) for adapter in token_adapters])
    if workspace.last_lora is not None and workspace.last_lora[0] == key:
        return workspace.last_lora[1]
    if backend in ("torch", "native"):
        kernel = cpu_lora.load() if backend == "native" else None
        lora = TorchLoRA(token_adapters, num_decodes, pool, workspace, kernel)
    else:
        lora = KernelLoRA(token_adapters, pool, use_triton=backend == "triton")
    # holding the adapters keeps their ids theirs while the key names them; a resident adapter's
    # rows never move, and one a running sequence uses is never unloaded
    workspace.last_lora = (key, lora, token_adapters)
    return lora


@dataclass(frozen=True)
class RunGroup:
    """Consecutive runs, tokens start..end, whose adapters share rank and targets (decode tokens
    are runs of one token)."""

    start: int
    end: int
    rank: int
    targets: frozenset[tuple[int, str]]
    scales: torch.Tensor  # [runs] float32
    # [num_layers, modules changed, runs * rank] pool offsets of lora_A rows and of lora_B^T
    # rows, a row for each module the group's adapters change (_table_rows)
    a_rows: torch.Tensor
    b_rows: torch.Tensor
    slots: torch.Tensor  # [end - start] int64: each token's run
    adapters: tuple[ResidentAdapter, ...]  # each run's

    @classmethod
    def of(cls, runs: list[TokenRun]) -> RunGroup:
        """The group of these runs, in few tensor ops: a step whose batch changes makes it anew
        after native work that left none of its inputs in cache, where the stack of 32
        all-module adapters' tables (1.7 MB) took 0.34 ms against 42 us in a loop (2-core
        Zen 4)."""
        adapters = [adapter for _, _, adapter in runs]
        layers, modules, _, rank = adapters[0].changed_rows.shape
        # [layers, modules, 2, runs, rank]: A and B^T rows side by side, each [.., runs * rank]
        rows = torch.stack([ad.changed_rows for ad in adapters], 3)
        slots = [run for run, (start, end, _) in enumerate(runs) for _ in range(start, end)]
        return cls(
            start=runs[0][0],
            end=runs[-1][1],
            rank=rank,
            targets=adapters[0].targets,
            scales=torch.tensor([ad.scale for ad in adapters], dtype=torch.float32),
            a_rows=rows[:, :, 0].view(layers, modules, -1),
            b_rows=rows[:, :, 1].view(layers, modules, -1),
            slots=torch.tensor(slots),
            adapters=tuple(adapters),
        )


@dataclass(frozen=True)
class ProjectionLoRA:
    """What one projection of one layer takes from a step's LoRA batch: the calls of (x, y)
    that add its modules' deltas to its output, and, where that is one native kernel call, the
    call itself, which the native projection can make in its own call (`fused`)."""

    calls: tuple[Callable, ...]
    fused: cpu_lora.BoundLoRA | None

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for call in self.calls:
            call(x, y)


@dataclass(frozen=True)
class LayerCall:
    """A projection's LoRA in every layer of a batch as one native call: `call` bound for
    layer 0, every other layer's the same with its row tables `stride` bytes on a layer
    (cpu_lora.StridedProjection); call None: no adapter of the batch changes the projection
    in any layer."""

    call: cpu_lora.BoundLoRA | None
    stride: int = 0


def _projection_lora(calls: list[Callable]) -> ProjectionLoRA | None:
    """None for no calls (no token's adapter changes the projection)."""
    if not calls:
        return None
    single = len(calls) == 1 and isinstance(calls[0], cpu_lora.BoundLoRA)
    return ProjectionLoRA(tuple(calls), calls[0] if single else None)


class TorchLoRA:
    """Per group of runs: the native kernel reads the adapters' rows in place (decode tokens and
    prefill spans up to KERNEL_MAX_SPAN); without it, decode tokens' rows are gathered from the
    pool in one index_select (through an overlapping-window view, so rows may start anywhere) and
    applied with batched matmuls. Longer prefill spans (and, without the kernel, decode runs of
    GROUP_MIN_TOKENS or more): plain matmuls on views of the pages."""

    def __init__(
        self,
        token_adapters: list[ResidentAdapter | None],
        num_decodes: int,
        pool: torch.Tensor,
        workspace: Workspace,
        kernel: cpu_lora.CpuLoRAKernel | None = None,
    ) -> None:
        self.workspace = workspace
        self.pool = pool.view(-1)
        self.kernel = kernel
        self._windows: dict[int, torch.Tensor] = {}
        self._fetches: dict[tuple[Modules, bool], list[cpu_lora.Fetch | None]] = {}
        self._layer_fetches: dict[tuple[Modules, bool], cpu_lora.LayerFetch | None] = {}
        self._plans: dict[tuple[int, Modules], ProjectionLoRA | None] = {}
        self._bound: dict[tuple[int, Modules], list[cpu_lora.BoundLoRA | None]] = {}
        self.spans: list[TokenRun] = []
        grouped: list[TokenRun] = []
        for start, end, adapter in _split_at(adapter_runs(token_adapters), num_decodes):
            decode = start < num_decodes
            native = self._in_kernel(adapter.rank)
            if native and not decode and end - start <= KERNEL_MAX_SPAN:
                grouped.append((start, end, adapter))  # a prefill span: one run
            elif decode and (kernel is not None or end - start < GROUP_MIN_TOKENS):
                grouped += [(i, i + 1, adapter) for i in range(start, end)]  # one per sequence
            else:
                self.spans.append((start, end, adapter))
        self.groups = [RunGroup.of(g) for g in _split_by_shape(grouped)]

    def _in_kernel(self, rank: int) -> bool:
        """Whether the native kernel applies adapters of this rank."""
        return self.kernel is not None and rank <= cpu_lora.MAX_RANK

    def plan(self, layer: int, modules: Modules) -> ProjectionLoRA | None:
        """What the projection of `modules` in `layer` takes from this batch (made at its first
        use, kept for every step of an unchanged batch); None where no adapter changes it."""
        key = (layer, modules)
        if key not in self._plans:
            self._plans[key] = _projection_lora(self._bind(layer, modules))
        return self._plans[key]

    def _bind(self, layer: int, modules: Modules) -> list[Callable]:
        """The calls of (x, y) that add `modules`' deltas in `layer`: one a group, native
        kernel calls with their arguments converted once (a step makes four a layer, and the
        same ones again every step of an unchanged batch), and one for the long spans."""
        calls: list[Callable] = []
        for index, g in enumerate(self.groups):
            outputs = _kernel_outputs(g.targets, layer, modules)
            if outputs is None:
                continue
            if self._in_kernel(g.rank):
                calls.append(self._kernel_calls(index, modules)[layer])
            else:
                calls.append(functools.partial(self._gathered, g, layer, modules))
        if any(
            (layer, module) in adapter.targets
            for *_, adapter in self.spans
            for module, *_ in modules
        ):
            calls.append(functools.partial(self._spans, layer, modules))
        return calls

    def layer_call(self, modules: Modules) -> LayerCall | None:
        """The LoRA of the projection of `modules` in every layer as one native call moved by a
        stride (LayerCall); None where it is not that: without the kernel, beside long prompt
        spans, with adapters of more than one shape changing the projection, or changing it in
        some layers alone. Then each layer takes its own plan."""
        if self.kernel is None or self.spans:
            return None
        changing = None
        for g in self.groups:
            same, outputs = _every_layer(g.targets, len(g.a_rows), modules)
            if not same or (outputs is not None and not self._in_kernel(g.rank)):
                return None
            if outputs is not None:
                if changing is not None:
                    return None  # two groups' calls
                changing = (g, outputs)
        if changing is None:
            return LayerCall(None)
        g, outputs = changing
        tables = (self.pool, g.a_rows, g.b_rows, g.slots, g.rank, g.scales)
        (call,) = self.kernel.bind_layers(*tables, [outputs], g.start, g.end)
        return LayerCall(call, cpu_lora.layer_stride(g.a_rows))

    def layer_fetch(
        self, modules: Modules, in_features: int, shrinks_only: bool = False
    ) -> cpu_lora.LayerFetch | None:
        """Every layer's ranges of `fetch` for a batch whose projection of `modules` takes
        layer_call's call (one group's rows in every layer); None where it has none."""
        key = (modules, shrinks_only)
        if key not in self._layer_fetches:
            self._layer_fetches[key] = None
            for g in self.groups:
                same, outputs = _every_layer(g.targets, len(g.a_rows), modules)
                if same and outputs is not None:
                    size = self.pool.element_size()
                    ranges = _group_ranges(g, outputs, in_features, size, shrinks_only)
                    self._layer_fetches[key] = cpu_lora.LayerFetch(*ranges)
        return self._layer_fetches[key]

    def _kernel_calls(self, index: int, modules: Modules) -> list[cpu_lora.BoundLoRA | None]:
        """Group `index`'s native calls for `modules` in every layer (None where its adapters
        change none of them), bound together at the first use."""
        key = (index, modules)
        if key not in self._bound:
            g = self.groups[index]
            outputs = [_kernel_outputs(g.targets, layer, modules) for layer in range(len(g.a_rows))]
            tables = (self.pool, g.a_rows, g.b_rows, g.slots, g.rank, g.scales)
            self._bound[key] = self.kernel.bind_layers(*tables, outputs, g.start, g.end)
        return self._bound[key]

    def _gathered(
        self, g: RunGroup, layer: int, modules: Modules, x: torch.Tensor, y: torch.Tensor
    ) -> None:
        """Decode tokens, one a run: every token's rows gathered, two batched matmuls."""
        n = g.end - g.start
        for module, first, width in modules:
            if (layer, module) not in g.targets:
                continue
            m = _table_rows(g.targets)[module]
            a = self._gather("lora_a", g.a_rows[layer, m], x.shape[1]).view(n, g.rank, -1)
            v = torch.bmm(x[g.start : g.end].unsqueeze(1), a.transpose(1, 2))
            v.mul_(g.scales.view(-1, 1, 1))
            b = self._gather("lora_b", g.b_rows[layer, m], width).view(n, g.rank, -1)
            y[g.start : g.end, first : first + width].add_(torch.bmm(v, b).squeeze(1))

    def _spans(self, layer: int, modules: Modules, x: torch.Tensor, y: torch.Tensor) -> None:
        """Long prefill spans: two matmuls a module on views of the adapter's pages."""
        for start, end, adapter in self.spans:
            for module, first, width in modules:
                if (layer, module) not in adapter.targets:
                    continue
                v = x[start:end] @ adapter.a_matrix(layer, module).T  # [len, rank]
                out = y[start:end, first : first + width]
                out.addmm_(v, adapter.b_matrix(layer, module), alpha=adapter.scale)

    def fetch(
        self, layer: int, modules: Modules, in_features: int, shrinks_only: bool = False
    ) -> cpu_lora.Fetch | None:
        """The pool rows the native kernel reads for `modules` of `layer` (every run's A and B^T
        rows, run after run, in the kernel's order; with `shrinks_only`, its A rows alone), for
        the projection before it to bring into cache; None without the kernel or rows. Made for
        every layer at the first use."""
        if self.kernel is None:
            return None
        key = (modules, shrinks_only)
        if key not in self._fetches:
            self._fetches[key] = self._fetch_ranges(modules, in_features, shrinks_only)
        ranges = self._fetches[key]
        return ranges[layer] if ranges else None  # none: a batch of long prompt spans alone

    def _fetch_ranges(
        self, modules: Modules, in_features: int, shrinks_only: bool
    ) -> list[cpu_lora.Fetch | None]:
        """Every layer's ranges for `modules`: a group's for all the layers where it changes the
        same modules in one set of tensor ops. A layer at a time, they cost 1.8 ms for a batch
        on 32 q,v adapters and 6.5 ms on 32 all-module ones (2-core Xeon), again at every change
        of the batch's adapters."""
        size = self.pool.element_size()
        layers = self.groups[0].a_rows.shape[0] if self.groups else 0
        at: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        nbytes: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        for g in self.groups:
            if not self._in_kernel(g.rank):
                continue
            alike: dict[tuple[int, ...], tuple[cpu_lora.Outputs, list[int]]] = {}
            for layer in range(layers):
                outputs = _kernel_outputs(g.targets, layer, modules)
                if outputs is not None:
                    alike.setdefault(outputs.table_key, (outputs, []))[1].append(layer)
            for outputs, same in alike.values():
                addresses, lengths = _group_ranges(g, outputs, in_features, size, shrinks_only)
                if len(same) < layers:
                    addresses = addresses.index_select(0, torch.tensor(same))
                for layer, row in zip(same, addresses.unbind(0), strict=True):
                    at[layer].append(row)
                    nbytes[layer].append(lengths)
        # a layer's ranges are most often one group's, a row of its addresses: no copy then
        return [
            None if not a else cpu_lora.Fetch(*(a + b) if len(a) == 1 else map(torch.cat, (a, b)))
            for a, b in zip(at, nbytes, strict=True)
        ]

    def _gather(self, name: str, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[len(rows), width]: pool rows starting at the given offsets, in a reused buffer."""
        window = self._windows.get(width)
        if window is None:
            # row i of this view is pool[i : i + width]: any offset is a row
            window = self.pool.as_strided((self.pool.numel() - width + 1, width), (1, 1))
            self._windows[width] = window
        out = self.workspace.take(name, (rows.shape[0], width), self.pool.dtype)
        return torch.index_select(window, 0, rows, out=out)


@functools.lru_cache(maxsize=4096)
def _kernel_outputs(
    targets: frozenset[tuple[int, str]], layer: int, modules: Modules
) -> cpu_lora.Outputs | None:
    """Which of `modules` an adapter with these targets changes in `layer`, as the native
    kernel takes them (rows of the group's offset tables: _table_rows); None if none.
    Cached: the same few shapes come back every layer of every step."""
    rows = _table_rows(targets)
    parts = [
        (rows[module], first, width)
        for module, first, width in modules
        if (layer, module) in targets
    ]
    return cpu_lora.Outputs(parts) if parts else None


@functools.lru_cache(maxsize=256)
def _every_layer(
    targets: frozenset[tuple[int, str]], num_layers: int, modules: Modules
) -> tuple[bool, cpu_lora.Outputs | None]:
    """(whether adapters with these targets change the same of `modules` in every layer, and
    layer 0's kernel outputs for them: None where they change none)"""
    changed = [
        frozenset(module for module, *_ in modules if (layer, module) in targets)
        for layer in range(num_layers)
    ]
    return all(c == changed[0] for c in changed), _kernel_outputs(targets, 0, modules)


def _group_ranges(
    g: RunGroup, outputs: cpu_lora.Outputs, in_features: int, size: int, shrinks_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranges of the rows a native call with these outputs reads from the group's adapters
    in the kernel's order, run after run (A rows, and B^T rows unless shrinks_only), in every
    layer: addresses [layers, ranges] and their lengths in bytes [ranges], pool elements of
    `size` bytes."""
    # [layers, runs, modules, kind, rank]: a run's rows of every module together
    rows = [_row_addresses(adapter, outputs, shrinks_only) for adapter in g.adapters]
    addresses = torch.stack(rows, 1)
    addresses = addresses.view(addresses.shape[0], -1)
    widths = tuple(width for *_, width in outputs.parts)
    lengths = _range_lengths(widths, in_features, size, shrinks_only, g.rank)
    return addresses, lengths.repeat(len(g.adapters))


@functools.lru_cache(maxsize=256)
def _range_lengths(
    widths: tuple[int, ...], in_features: int, size: int, shrinks_only: bool, rank: int
) -> torch.Tensor:
    """[modules * kinds * rank]: the lengths in bytes of a run's ranges, module by module: its
    A rows (the input's width each), then, unless shrinks_only, its B^T rows (the module's
    output's width each)."""
    lengths = []
    for width in widths:
        lengths += [in_features * size] * rank
        if not shrinks_only:
            lengths += [width * size] * rank
    return torch.tensor(lengths)


def _row_addresses(
    adapter: ResidentAdapter, outputs: cpu_lora.Outputs, shrinks_only: bool
) -> torch.Tensor:
    """[layers, modules, kind, rank]: the addresses of the adapter's rows a native LoRA call
    with these outputs reads (A; B^T too unless shrinks_only), kept with the adapter, whose
    rows never move while it is resident. A step's fetch ranges stack them: worked out from
    its tables every time, they took three times as long. The pool the adapter's rows are in
    is the one the step's calls are bound to (the engine has one, settings.pool)."""
    key = (outputs.table_key, shrinks_only)
    if key not in adapter.row_addresses:
        rows = adapter.changed_rows.index_select(1, outputs.rows)
        if shrinks_only:
            rows = rows[:, :, :1]
        base, size = adapter.pool.data_ptr(), adapter.pool.element_size()
        adapter.row_addresses[key] = rows * size + base
    return adapter.row_addresses[key]


@functools.lru_cache(maxsize=4096)
def _table_rows(targets: frozenset[tuple[int, str]]) -> dict[str, int]:
    """Each module adapters with these targets change -> its row in a group's offset tables
    (RunGroup), which hold those modules' rows alone."""
    return {module: row for row, module in enumerate(changed_modules(targets))}


def _split_at(runs: list[TokenRun], boundary: int) -> list[TokenRun]:
    """The runs, a run across the last decode and first prefill token cut in two."""
    out: list[TokenRun] = []
    for start, end, adapter in runs:
        if start < boundary < end:
            out += [(start, boundary, adapter), (boundary, end, adapter)]
        else:
            out.append((start, end, adapter))
    return out


def _split_by_shape(runs: list[TokenRun]) -> list[list[TokenRun]]:
    """Consecutive runs whose adapters have equal rank and targets, grouped."""
    groups: list[list[TokenRun]] = []
    for run in runs:
        last = groups[-1][-1] if groups else None
        if last and run[0] == last[1] and _shape(run[2]) == _shape(last[2]):
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def _shape(adapter: ResidentAdapter):
    return adapter.rank, adapter.targets


class KernelLoRA:
    """Segments and per-(layer, module) row-offset tables for the batched kernels."""

    def __init__(
        self, token_adapters: list[ResidentAdapter | None], pool: torch.Tensor, use_triton: bool
    ) -> None:
        runs = adapter_runs(token_adapters)
        slots: dict[int, int] = {}
        adapters: list[ResidentAdapter] = []
        for _, _, adapter in runs:
            if id(adapter) not in slots:
                slots[id(adapter)] = len(adapters)
                adapters.append(adapter)
        device = pool.device
        self.segments = Segments.from_lists(
            [(start, end - start, slots[id(ad)]) for start, end, ad in runs], device
        )
        self.pool = pool.view(-1)
        self.shrink = lora_shrink_triton if use_triton else lora_shrink_reference
        self.expand = lora_expand_triton if use_triton else lora_expand_reference
        self._build_tables(adapters, device)

    def plan(self, layer: int, modules: Modules) -> ProjectionLoRA | None:
        """One call of the kernels for the projection's modules (none to fuse: the Triton
        kernels run on their own); None where no adapter changes them."""
        if not self.active or not any(self.active[layer][MODULE_INDEX[m]] for m, *_ in modules):
            return None
        return ProjectionLoRA((functools.partial(self.add, layer, modules),), None)

    def fetch(
        self, layer: int, modules: Modules, in_features: int, shrinks_only: bool = False
    ) -> None:
        """Nothing to bring into cache ahead: the kernels run on a GPU."""
        return None

    def _build_tables(self, adapters: list[ResidentAdapter], device) -> None:
        num_layers, num_modules = adapters[0].has_module.shape if adapters else (0, 0)
        max_rank = max((ad.rank for ad in adapters), default=0)
        shape = (num_layers, num_modules, len(adapters), max_rank)
        self.a_offsets = torch.zeros(shape, dtype=torch.long)
        self.b_offsets = torch.zeros(shape, dtype=torch.long)
        self.ranks = torch.zeros(shape[:3], dtype=torch.int32)
        for slot, ad in enumerate(adapters):
            self.a_offsets[:, :, slot, : ad.rank] = ad.a_offsets
            self.b_offsets[:, :, slot, : ad.rank] = ad.b_offsets
            self.ranks[:, :, slot] = ad.has_module.int() * ad.rank
        self.active = (self.ranks > 0).any(dim=-1).tolist()  # [layer][module] host-side
        self.scales = torch.tensor(
            [ad.scale for ad in adapters], dtype=torch.float32, device=device
        )
        self.a_offsets, self.b_offsets, self.ranks = (
            t.to(device) for t in (self.a_offsets, self.b_offsets, self.ranks)
        )

    def add(self, layer: int, modules: Modules, x: torch.Tensor, y: torch.Tensor) -> None:
        for module, first, width in modules:
            m = MODULE_INDEX[module]
            if not self.active or not self.active[layer][m]:
                continue
            ranks, b_offsets = self.ranks[layer, m], self.b_offsets[layer, m]
            v = self.shrink(x, self.pool, self.a_offsets[layer, m], ranks, self.segments)
            out = y[:, first : first + width]
            self.expand(out, v, self.pool, b_offsets, ranks, self.scales, self.segments)
