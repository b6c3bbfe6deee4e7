"""Runs one scheduled step: flatten, forward, sample."""

from __future__ import annotations

from loraplex.engine.config import EngineConfig
from loraplex.engine.device import choose_lora_backend
from loraplex.engine.forward_batch import BatchSettings, build_forward_batch
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.model import CausalLM
from loraplex.engine.sampler import Sampler
from loraplex.engine.scheduler import SchedulerOutput
from loraplex.engine.sequence import Sequence, TokenLogprob
from loraplex.engine.workspace import Workspace

Sampled = list[tuple[Sequence, int, TokenLogprob | None]]


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv: KVCacheManager, sampler: Sampler, config: EngineConfig
    ) -> None:
        self.model = model
        self.kv = kv
        self.sampler = sampler
        self.settings = BatchSettings(
            page_size=kv.page_size,
            dtype=config.torch_dtype,
            device=config.device,
            lora_backend=choose_lora_backend(config.device, config.lora_backend),
            pool=kv.pool.data,
            workspace=Workspace(config.device),
        )

    def execute(self, out: SchedulerOutput) -> Sampled:
        """-> (sequence, new token, its logprobs) for each sequence that completed its tokens."""
        batch, sampling = build_forward_batch(out.scheduled, self.settings)
        hidden = self.model.forward(batch, self.kv)
        if not sampling:
            return []
        picked = self.sampler(self.model.logits(hidden), sampling)
        return [
            (seq, token, logprob) for seq, (token, logprob) in zip(sampling, picked, strict=True)
        ]
