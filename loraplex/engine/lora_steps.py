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
from loraplex.engine.fetch_placement import AHEAD, ALL, SHRINKS, Ways
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
    lora: StepLoRA, layer: int, modules: Modules, rows: int, projection: Linear, shrinks: bool
) -> ProjectionStep:
    """The step of the projection of `modules` in `layer` on a 2-D input of `rows` rows: the
    adapter rows brought into cache during the projection where it fetches (own_fetch; the A
    rows alone with `shrinks`, where it can), and the LoRA call made in its native call where it
    takes it."""
    plan = lora.plan(layer, modules)
    if plan is None:
        return NO_LORA
    fused = plan.fused if plan.fused is not None and projection.native_rows(rows) else None
    own = own_fetch(projection, rows, fused is not None, shrinks)
    fetch = None
    if own is not None:
        fetch = lora.fetch(layer, modules, projection.in_features, shrinks_only=own)
    return ProjectionStep(plan, fetch, fused)


def own_fetch(projection: Linear, rows: int, fused: bool, shrinks: bool) -> bool | None:
    """Which of its LoRA call's rows the projection brings into cache on `rows` rows: the A rows
    alone (True), with `shrinks` where it makes the call itself (`fused`) and can fetch those
    alone; else all of them where it fetches (False: not the shrinks' alone), or none (None)."""
    if shrinks and fused and projection.fetches_shrink_rows(rows):
        return True
    if projection.fetches_rows(rows):
        return False
    return None


@dataclass
class BatchSteps:
    """A batch's LoRA steps (CausalLM._lora_steps), kept while its LoRA metadata (`lora`, None
    for a batch without adapters) is unchanged, for each content its projections may fetch
    (`contents`, ALL or SHRINKS, the CPU's first): a step a layer (`layers_for`, made at the first
    use by `make_layers`, with whether cpu/layers.c can make every LoRA call of theirs) or, where
    each projection's LoRA is the same in every layer but for where its tables are, strided steps
    for all of them (`make_strided`); and, once asked, them as cpu/layers.c takes them, for each
    way a step may fetch (`ways`, fetch_placement.py)."""

    lora: StepLoRA | None
    make_layers: Callable[[bool], tuple[list[LayerLoRA], bool]]  # (shrinks) -> ...
    make_strided: Callable[[bool], StridedSteps | None] = lambda shrinks: None
    contents: Ways = (ALL,)
    # the content to make first (the way the step before took), whose steps tell what holds for
    # every content (native, ways, key): a batch changing at every step makes one content alone
    # until the ways are timed anew
    likely: bool | None = None
    _layers: dict[bool, tuple[list[LayerLoRA], bool]] = field(default_factory=dict)
    _strided: dict[bool, StridedSteps | None] = field(default_factory=dict)
    _calls: dict[str, tuple[ctypes.Array | cpu_lora.StridedLoRA, list]] = field(
        default_factory=dict
    )

    def shrinks(self, way: str) -> bool:
        """Whether the projections fetch their A rows alone in a step of `way`."""
        return (way if way != AHEAD else self.contents[0]) == SHRINKS

    def layers_for(self, way: str) -> list[LayerLoRA]:
        return self._layers_of(self.shrinks(way))[0]

    def strided_for(self, way: str) -> StridedSteps | None:
        return self._strided_of(self.shrinks(way))

    def _layers_of(self, shrinks: bool) -> tuple[list[LayerLoRA], bool]:
        if shrinks not in self._layers:
            self._layers[shrinks] = self.make_layers(shrinks)
        return self._layers[shrinks]

    def _strided_of(self, shrinks: bool) -> StridedSteps | None:
        if shrinks not in self._strided:
            self._strided[shrinks] = self.make_strided(shrinks)
        return self._strided[shrinks]

    @property
    def _sample(self) -> bool:
        """The content whose steps are looked at for what holds for every content."""
        if self.likely is not None and len(self.contents) > 1:
            return self.likely
        return self.contents[0] == SHRINKS

    @functools.cached_property
    def native(self) -> bool:
        """Whether cpu/layers.c can make every LoRA call of the batch."""
        return self._strided_of(self._sample) is not None or self._layers_of(self._sample)[1]

    @functools.cached_property
    def ways(self) -> Ways:
        """The ways a step of the batch may fetch, the one it took before they were timed first:
        AHEAD where each layer's gate_up may fetch the next layer's q,k,v rows, and the
        contents."""
        strided = self._strided_of(self._sample)
        if strided is not None:
            ahead = strided.ahead is not None
        else:
            ahead = self._layers_of(self._sample)[0][0].ahead is not None
        first, *rest = self.contents
        if not ahead:
            return self.contents
        return (first, AHEAD, *rest) if first == SHRINKS else (AHEAD, first, *rest)

    @functools.cached_property
    def key(self) -> tuple:
        """What the way a step fetches is timed apart for (fetch_placement.py): the ways and
        which of the first layer's projections have a LoRA call."""
        strided = self._strided_of(self._sample)
        if strided is not None:
            calls = tuple(call.call is not None for call, _ in strided.projections)
        else:
            step = self._layers_of(self._sample)[0][0]
            calls = tuple(p.plan is not None for p in (step.qkv, step.o, step.gate_up, step.down))
        return self.ways, calls

    def native_calls(self, way: str) -> ctypes.Array | cpu_lora.StridedLoRA | None:
        """The steps as cpu/layers.c takes them in a step of `way` (None without adapters)."""
        if self.lora is None:
            return None
        if way not in self._calls:
            strided = self.strided_for(way)
            if strided is not None:
                self._calls[way] = (strided.native(way == AHEAD), [])
            else:
                self._calls[way] = _native_lora(self.layers_for(way), way == AHEAD)
        return self._calls[way][0]


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
