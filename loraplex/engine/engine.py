"""The synchronous engine: requests in, one step at a time, deltas out. Not thread-safe; the async
engine drives it from a single thread."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import torch

from loraplex.engine.adapters.manager import (
    AdapterCatalog,
    AdapterManager,
    AdapterRef,
    PoolSnapshot,
)
from loraplex.engine.config import EngineConfig, ModelConfig, parse_size
from loraplex.engine.default_model import resolve_model
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.kv_cache import KVCacheManager, kv_page_numel
from loraplex.engine.model import CausalLM
from loraplex.engine.outputs import Request, RequestDelta, take_delta
from loraplex.engine.pool import PagePool
from loraplex.engine.runner import ModelRunner, Sampled
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence, Status
from loraplex.engine.tokenizer import TokenizerWrapper

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRARequest:
    """Serve a request with this adapter. `adapter_id` names one version of an adapter: the
    engine reads `path` once per id (and again only if the path changes)."""

    adapter_id: str
    path: str


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.tokenizer = TokenizerWrapper(model_dir)
        self.model = CausalLM(
            self.model_config, model_dir, self.max_model_len, config.torch_dtype, config.device
        )
        self.pool = self._make_pool()
        self.kv = KVCacheManager(self.pool, self.model_config, config.page_size)
        self.catalog = AdapterCatalog(
            self.model_config,
            config.torch_dtype,
            config.max_lora_rank,
            config.adapter_roots,
            parse_size(config.adapter_host_cache),
        )
        self.adapters = AdapterManager(self.pool, self.model_config)
        self.scheduler = Scheduler(
            self.kv, self.adapters, config.max_num_batched_tokens, config.max_num_seqs
        )
        self.runner = ModelRunner(self.model, self.kv, Sampler(config.seed), config)
        self.requests: dict[str, Request] = {}
        logger.info(
            "engine ready: %s, %d pages of %d tokens (%.1f MiB each)",
            model_dir,
            self.pool.num_pages,
            config.page_size,
            self.pool.page_bytes / 2**20,
        )

    def _make_pool(self) -> PagePool:
        page_numel = kv_page_numel(self.model_config, self.config.page_size)
        page_bytes = page_numel * torch.empty((), dtype=self.config.torch_dtype).element_size()
        num_pages = self.config.num_pages or self.config.memory_budget_bytes // page_bytes
        return PagePool(num_pages, page_numel, self.config.torch_dtype, self.config.device)

    # -- requests ---------------------------------------------------------------------------

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: LoRARequest | None = None,
    ) -> Request:
        """Tokenize, read the adapter (from the host cache or disk) and validate; raises
        ValueError naming the problem. Touches no engine-thread state, so any thread may call
        it."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
        adapter = self.catalog.get(lora.adapter_id, lora.path) if lora else None
        max_tokens = self._check_lengths(token_ids, params, adapter)
        request_id = request_id or uuid.uuid4().hex
        seqs = [
            self._make_sequence(request_id, i, token_ids, params, max_tokens, adapter)
            for i in range(params.n)
        ]
        return Request(request_id, text, token_ids, seqs)

    def _check_lengths(
        self, token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> int:
        num_prompt, context = len(token_ids), self.max_model_len
        if num_prompt == 0:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if num_prompt >= context:
            raise ValueError(
                f"prompt has {num_prompt} tokens; the model's context is {context} tokens, "
                "which must leave room for at least one generated token"
            )
        max_tokens = params.max_tokens or context - num_prompt
        if num_prompt + max_tokens > context:
            raise ValueError(
                f"max_tokens must be in [1, {context - num_prompt}] for this prompt "
                f"({num_prompt} tokens, context {context}), got {max_tokens}"
            )
        needed = self.kv.pages_for(num_prompt + max_tokens)
        adapter_pages = self.adapters.plan_pages(adapter.weights) if adapter else 0
        pinned = self.adapters.pinned_pages(besides=adapter)
        if needed + adapter_pages > self.pool.num_pages - pinned:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {needed} KV "
                f"pages{f' and the adapter {adapter_pages}' if adapter else ''}; "
                f"the pool has {self.pool.num_pages}"
                f"{f', {pinned} of them held by pinned adapters' if pinned else ''}"
            )
        return max_tokens

    def _make_sequence(
        self,
        request_id: str,
        index: int,
        token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        adapter: AdapterRef | None,
    ) -> Sequence:
        generator = None
        if params.seed is not None:
            # each of the n completions draws its own, reproducible numbers
            generator = torch.Generator().manual_seed(hash((params.seed, index)) & (2**63 - 1))
        detokenizer = IncrementalDetokenizer(
            self.tokenizer.backend, token_ids, params.stop, params.skip_special_tokens
        )
        return Sequence(
            request_id=request_id,
            index=index,
            params=params,
            token_ids=list(token_ids),
            num_prompt_tokens=len(token_ids),
            max_tokens=max_tokens,
            detokenizer=detokenizer,
            generator=generator,
            adapter=adapter,
        )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestDelta | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        live = [seq for seq in request.seqs if not seq.is_finished]
        self.scheduler.abort(live)
        for seq in live:
            seq.finish_reason = "abort"
        return take_delta(request, live)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        sampled = self.runner.execute(out)
        deltas = self._process(sampled)
        self.scheduler.update(out)
        return deltas

    def _process(self, sampled: Sampled) -> list[RequestDelta]:
        now = time.monotonic()
        touched: dict[str, list[Sequence]] = {}
        for seq, token, logprob in sampled:
            seq.token_ids.append(token)
            seq.first_token_time = seq.first_token_time or now
            if logprob is not None:
                seq.logprobs.append(logprob)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason:
                seq.status = Status.FINISHED
            touched.setdefault(seq.request_id, []).append(seq)
        deltas = []
        for request_id, seqs in touched.items():
            request = self.requests[request_id]
            deltas.append(take_delta(request, seqs))
            if request.is_finished:
                del self.requests[request_id]
        return deltas

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.model_config.eos_token_ids
        ):
            return "stop"
        seq.detokenizer.add_token(token)
        if seq.detokenizer.stopped:
            return "stop"
        if seq.num_output_tokens >= seq.max_tokens:
            return "length"
        return None

    # -- adapters ---------------------------------------------------------------------------

    def load_adapter(self, lora: LoRARequest, pin: bool = False) -> None:
        """Read and validate the adapter, and bring it into the pool now if there is room (or
        always, when pinned). Raises AdapterError (a ValueError) naming the problem."""
        ref = self.catalog.get(lora.adapter_id, lora.path)
        if pin:
            self.adapters.pin(ref)
        else:
            self.adapters.preload(ref)

    def pin_adapter(self, lora: LoRARequest) -> None:
        self.load_adapter(lora, pin=True)

    def unpin_adapter(self, adapter_id: str) -> None:
        self.adapters.unpin(adapter_id)

    def unload_adapter(self, adapter_id: str) -> None:
        """Forget the adapter. Requests already in flight with it still finish."""
        self.catalog.forget(adapter_id)
        self.adapters.unload(adapter_id)

    def pool_snapshot(self) -> PoolSnapshot:
        return self.adapters.snapshot(kv_pages=self.pool.num_used - self.adapters.num_pages)

    # -- introspection ----------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
