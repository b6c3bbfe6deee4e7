"""What each layer's projections take from a step's LoRA metadata (lora_batch), decided once
for a batch's adapters and kept for every step of an unchanged batch (CausalLM._lora_steps), and
its form for the decoder layers' one native call (cpu/layers.c):

* a ProjectionStep a projection and a LayerLoRA a layer, in the layers' order; as cpu/layers.c
  takes them, an array of cpu_lora.LayerLoRA;
* or, where each projection's LoRA is one native call the same in every layer but for where its
  tables are (the usual batch: adapters of one shape on every layer), StridedSteps for all the
  layers at once, made without a step a layer (cpu_lora.StridedLoRA).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.engine.adapters.lora_batch import (
    KernelLoRA,
    LayerCall,
    Modules,
    ProjectionLoRA,
    TorchLoRA,
)
from loraplex.engine.device import Linear
from loraplex.kernels import cpu_lora

StepLoRA = TorchLoRA | KernelLoRA  # a step's LoRA metadata (lora_batch.build_lora_batch)


@dataclass(frozen=True)
class ProjectionStep:
    """What one projection of one layer takes from a step's LoRA metadata: its plan (None where
    no adapter changes it), the adapter rows it brings into cache itself where it fetches, and
    the LoRA call its native call makes, where it makes it."""

    plan: ProjectionLoRA | None
    fetch: cpu_lora.Fetch | None = None
    fused: cpu_lora.BoundLoRA | None = None


NO_LORA = ProjectionStep(None)


@dataclass(frozen=True)
class LayerLoRA:
    """A layer's projection steps, and the next layer's q,k,v rows its gate_up may fetch."""

    qkv: ProjectionStep
    o: ProjectionStep
    gate_up: ProjectionStep
    down: ProjectionStep
    ahead: cpu_lora.Fetch | None


def projection_step(
    lora: StepLoRA, layer: int, modules: Modules, rows: int, projection: Linear
) -> ProjectionStep:
    """The step of the projection of `modules` in `layer` on a 2-D input of `rows` rows: the
    adapter rows brought into cache during the projection where it fetches (bfloat16 on
    AVX512-BF16 without AMX, float32 on Zen 4 and 5; float32 on Intel with AVX512-FP16, the A
    rows of the LoRA call it makes itself), and the LoRA call made in its native call where it
    takes it."""
    plan = lora.plan(layer, modules)
    if plan is None:
        return NO_LORA
    fused = plan.fused if plan.fused is not None and projection.native_rows(rows) else None
    own = own_fetch(projection, rows, fused is not None)
    fetch = None
    if own is not None:
        fetch = lora.fetch(layer, modules, projection.in_features, shrinks_only=own)
    return ProjectionStep(plan, fetch, fused)


def own_fetch(projection: Linear, rows: int, fused: bool) -> bool | None:
    """Which of its LoRA call's rows the projection brings into cache on `rows` rows: all
    (False: not the shrinks' alone), the A rows alone where it makes the call itself (`fused`)
    and fetches those alone (True), or none (None)."""
    if projection.fetches_rows(rows):
        return False
    if fused and projection.fetches_shrink_rows(rows):
        return True
    return None


@dataclass
class BatchSteps:
    """A batch's LoRA steps (CausalLM._lora_steps), kept while its LoRA metadata (`lora`, None
    for a batch without adapters) is unchanged: a step a layer (`layers`, made at the first use
    by `make_layers`, with whether cpu/layers.c can make every LoRA call of theirs) or, where
    each projection's LoRA is the same in every layer but for where its tables are, `strided`
    for all of them; and, once asked, them as cpu/layers.c takes them, by fetch placement."""

    lora: StepLoRA | None
    make_layers: Callable[[], tuple[list[LayerLoRA], bool]]
    strided: StridedSteps | None = None
    _calls: dict[bool, tuple[ctypes.Array | cpu_lora.StridedLoRA, list]] = field(
        default_factory=dict
    )

    @functools.cached_property
    def _layers(self) -> tuple[list[LayerLoRA], bool]:
        return self.make_layers()

    @property
    def layers(self) -> list[LayerLoRA]:
        return self._layers[0]

    @property
    def native(self) -> bool:
        """Whether cpu/layers.c can make every LoRA call of the batch."""
        return self.strided is not None or self._layers[1]

    @property
    def fetches_ahead(self) -> bool:
        """Whether each layer's gate_up may fetch the next layer's q,k,v rows."""
        if self.strided is not None:
            return self.strided.ahead is not None
        return self.layers[0].ahead is not None

    def native_calls(self, fetch_ahead: bool) -> ctypes.Array | cpu_lora.StridedLoRA | None:
        """The steps as cpu/layers.c takes them (None without adapters)."""
        if self.lora is None:
            return None
        if fetch_ahead not in self._calls:
            if self.strided is not None:
                self._calls[fetch_ahead] = (self.strided.native(fetch_ahead), [])
            else:
                self._calls[fetch_ahead] = _native_lora(self.layers, fetch_ahead)
        return self._calls[fetch_ahead][0]


@dataclass(frozen=True)
class StridedSteps:
    """A batch's LoRA where each projection's (q,k,v, o, gate_up, down) is one native call,
    the same in every layer but for where its tables are (TorchLoRA.layer_call), with the
    ranges the projection fetches meanwhile; and the q,k,v rows each layer's gate_up may fetch
    for the next layer (`ahead`, CausalLM._next_qkv_rows)."""

    projections: tuple[tuple[LayerCall, cpu_lora.LayerFetch | None], ...]
    ahead: cpu_lora.LayerFetch | None

    def native(self, fetch_ahead: bool) -> cpu_lora.StridedLoRA:
        """As cpu/layers.c takes it, the gate_up projections fetching ahead or not."""
        parts = [
            cpu_lora.StridedProjection(
                call.call.binding if call.call is not None else None,
                call.stride,
                cpu_lora.StridedFetch.of(fetch),
            )
            for call, fetch in self.projections
        ]
        ahead = cpu_lora.StridedFetch.of(self.ahead if fetch_ahead else None)
        return cpu_lora.StridedLoRA(*parts, ahead)


def _native_lora(steps: list[LayerLoRA], fetch_ahead: bool) -> tuple[ctypes.Array, list]:
    """A batch's LoRA steps as cpu/layers.c takes them, each projection's LoRA calls and fetch
    as CausalLM._layer_by_layer and model._project make them -> them, and the arrays they point
    to (the steps hold the rest)."""
    layers, held, fetched = [], [], False
    for step in steps:
        ahead = step.ahead if fetch_ahead else None
        layers.append(
            cpu_lora.LayerLoRA(
                _native_projection(step.qkv, held, fetched=fetched),
                _native_projection(step.o, held),
                _native_projection(step.gate_up, held, ahead),
                _native_projection(step.down, held),
            )
        )
        fetched = ahead is not None
    return (cpu_lora.LayerLoRA * len(layers))(*layers), held


_NO_STEP = cpu_lora.StepProjection.of(None, None, None)  # copied into each LayerLoRA it is in


def _native_projection(
    step: ProjectionStep,
    held: list,
    ahead: cpu_lora.Fetch | None = None,
    fetched: bool = False,
) -> cpu_lora.StepProjection:
    """What model._project does with a step, as cpu/layers.c takes it (arrays it makes put in
    `held`)."""
    if step.plan is None:
        return _NO_STEP if ahead is None else cpu_lora.StepProjection.of(None, None, ahead)
    fetch = None if fetched else step.fetch
    if step.fused is not None:
        return cpu_lora.StepProjection.of(step.fused, None, fetch)
    held.append(cpu_lora.after_calls(step.plan.calls))
    return cpu_lora.StepProjection.of(None, held[-1], fetch)
