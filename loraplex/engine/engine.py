"""The synchronous engine: requests in, one step at a time, deltas out. Not thread-safe; the async
engine drives it from a single thread. `make_request` and `validate_adapter` are the exceptions:
they touch no engine-thread state, so any thread may call them (and they may read from disk)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from loraplex.engine.adapters.catalog import AdapterCatalog, AdapterRef
from loraplex.engine.adapters.manager import AdapterManager, PoolSnapshot
from loraplex.engine.config import EngineConfig, ModelConfig, parse_size
from loraplex.engine.default_model import resolve_model
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.device import choose_argmax
from loraplex.engine.errors import (
    AdapterError,
    EngineError,
    ErrorCode,
    InvalidRequestError,
    RequestFailedError,
)
from loraplex.engine.fairness import DEFAULT_FAIRNESS, Fairness, Tier, make_policy
from loraplex.engine.info import AdapterInfo, EngineStats, ModelInfo
from loraplex.engine.kv_cache import KVCacheManager, kv_page_numel
from loraplex.engine.model import CausalLM
from loraplex.engine.outputs import Request, RequestDelta, take_delta
from loraplex.engine.pool import PagePool
from loraplex.engine.prompts import prompt_token_ids
from loraplex.engine.runner import ModelRunner, StepResult
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.sequence import Sequence, Status
from loraplex.engine.stats import StepCounters
from loraplex.engine.structured import Grammars, StructuredOutput
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
        self.model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.tokenizer = TokenizerWrapper(self.model_dir)
        self.model = CausalLM(
            self.model_config, self.model_dir, self.max_model_len, config.torch_dtype, config.device
        )
        self.pool = self._make_pool()
        self.kv = KVCacheManager(
            self.pool, self.model_config, config.page_size, config.enable_prefix_caching
        )
        self.catalog = AdapterCatalog(
            self.model_config,
            config.torch_dtype,
            config.max_lora_rank,
            config.adapter_roots,
            parse_size(config.adapter_host_cache),
            self.pool.page_numel,
        )
        self.adapters = AdapterManager(self.pool, self.model_config)
        self.scheduler = Scheduler(
            self.kv,
            self.adapters,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            make_policy(config.scheduling_policy, config.max_num_seqs),
        )
        self.runner = ModelRunner(
            self.model, self.kv, Sampler(config.seed, choose_argmax(config.device)), config
        )
        self.requests: dict[str, Request] = {}
        self.counters = StepCounters()
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        logger.info(
            "engine ready: %s, %d pages of %d tokens (%.1f MiB each)",
            self.model_dir,
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
        tag: object = None,
        adapter: AdapterRef | None = None,
        fairness: Fairness | None = None,
    ) -> Request:
        """Tokenize, read the adapter (from the host cache or disk, unless `adapter` is the
        host copy already at hand) and validate. Raises InvalidRequestError (AdapterError for the
        adapter) naming the problem."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)
        self._check_token_params(params)
        if adapter is None and lora is not None:
            adapter = self.catalog.get(lora.adapter_id, lora.path)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        # laid out for the pool here, off the engine thread, which then loads it in one copy
        adapter_pages = self.adapters.pack(adapter.weights).num_pages if adapter else 0
        max_tokens = self._check_lengths(len(token_ids), params, adapter, adapter_pages)
        num_pages_needed = self.kv.pages_for(len(token_ids) + max_tokens) + adapter_pages
        self._check_fits_pool(num_pages_needed, adapter, len(token_ids), max_tokens)
        request_id = request_id or uuid.uuid4().hex
        seqs = [
            self._make_sequence(request_id, i, token_ids, params, max_tokens, adapter, grammar)
            for i in range(params.n)
        ]
        for seq in seqs:
            seq.fairness = fairness or DEFAULT_FAIRNESS
        return Request(request_id, text, token_ids, seqs, num_pages_needed, tag)

    def _check_token_params(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias or ())),
        ):
            if any(t >= vocab for t in ids):
                raise InvalidRequestError(
                    f"{name} must hold token ids in [0, {vocab}), got {max(ids)}", param=name
                )

    def _check_lengths(
        self,
        num_prompt: int,
        params: SamplingParams,
        adapter: AdapterRef | None,
        adapter_pages: int,
    ) -> int:
        """-> max_tokens for this prompt. Without one, it runs to the end of the context or of
        what the pool can hold for one sequence, whichever comes first."""
        context = self.max_model_len
        if num_prompt >= context:
            raise InvalidRequestError(
                f"prompt has {num_prompt} tokens; the model's context is {context} tokens, "
                "which must leave room for at least one generated token",
                code=ErrorCode.PROMPT_TOO_LONG,
                param="prompt",
            )
        if params.max_tokens is None:
            free = self.pool.num_pages - self.adapters.pinned_pages(besides=adapter)
            room = (free - adapter_pages) * self.config.page_size
            return max(1, min(context, room) - num_prompt)  # too little room: refused below
        max_tokens = params.max_tokens
        if num_prompt + max_tokens > context:
            raise InvalidRequestError(
                f"max_tokens must be in [1, {context - num_prompt}] for this prompt "
                f"({num_prompt} tokens, context {context}), got {max_tokens}",
                code=ErrorCode.PROMPT_TOO_LONG,
                param="max_tokens",
            )
        return max_tokens

    def _check_fits_pool(
        self,
        num_pages_needed: int,
        adapter: AdapterRef | None,
        num_prompt: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        """A sequence must fit the pool with every other sequence preempted and every idle
        adapter evicted: the pool minus the pinned adapters (its own adapter aside)."""
        pinned = self.adapters.pinned_pages(besides=adapter)
        if num_pages_needed <= self.pool.num_pages - pinned:
            return
        what = (
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens})"
            if num_prompt is not None
            else "the request"
        )
        raise InvalidRequestError(
            f"{what} needs {num_pages_needed} pages of KV{' and adapter' if adapter else ''}; "
            f"the pool has {self.pool.num_pages}"
            f"{f', {pinned} of them held by pinned adapters' if pinned else ''}",
            code=ErrorCode.EXCEEDS_POOL,
            param="max_tokens",
        )

    def _make_sequence(
        self,
        request_id: str,
        index: int,
        token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        adapter: AdapterRef | None,
        grammar: object = None,
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
            matcher=self.grammars.matcher(grammar) if grammar is not None else None,
        )

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler, made on first use (xgrammar loads then). Any thread."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(
                    self.tokenizer.hf,
                    self.model_config.vocab_size,
                    list(self.model_config.eos_token_ids),
                )
            return self._grammars

    def is_compiled(self, constraint: StructuredOutput) -> bool:
        """Whether `constraint` is compiled already (a request with it is quick to make)."""
        with self._grammars_lock:
            grammars = self._grammars
        return grammars is not None and grammars.is_cached(constraint)

    def add_request(self, request: Request) -> None:
        """Queue a request made by `make_request`. Raises InvalidRequestError if its id is in
        flight, or if adapters pinned since it was made leave the pool too small for it."""
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in flight", param="request_id"
            )
        self._check_fits_pool(request.num_pages_needed, request.seqs[0].adapter)
        for seq in request.seqs:  # made before its adapter was unloaded: serve, do not name
            if seq.adapter is not None and not self.catalog.is_current(seq.adapter):
                seq.adapter = seq.adapter.retired()
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestDelta | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        return self._end(request, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def only_background(self) -> bool:
        """Every unfinished request is below the interactive tier (a batch job's)."""
        return all(r.seqs[0].fairness.tier > Tier.INTERACTIVE for r in self.requests.values())

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        started = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        result = self.runner.execute(out)
        deltas = self._process(result)
        self.scheduler.update(out)
        self._count(out, result, time.perf_counter() - started)
        return deltas

    def _process(self, result: StepResult) -> list[RequestDelta]:
        now = time.monotonic()
        touched: dict[str, list[Sequence]] = {}
        for seq, token, logprob in result.sampled:
            seq.token_ids.append(token)
            if seq.matcher is not None and not seq.matcher.accept(token):
                # the mask allowed only tokens the grammar takes: this cannot happen
                logger.error("request %s: a masked token was sampled", seq.request_id)
            seq.first_token_time = seq.first_token_time or now
            if logprob is not None:
                seq.logprobs.append(logprob)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason:
                seq.status = Status.FINISHED
            touched.setdefault(seq.request_id, []).append(seq)
        deltas = [self._fail(seq) for seq in result.failed if seq.request_id in self.requests]
        finished = []
        for request_id, seqs in touched.items():
            request = self.requests.get(request_id)
            if request is None:  # failed in this very step
                continue
            deltas.append(take_delta(request, seqs))
            if request.is_finished:
                finished.append(request_id)
        # only once every delta exists: should anything above raise, every request of the step
        # is still here for the caller to fail
        for request_id in finished:
            del self.requests[request_id]
        return deltas

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.model_config.eos_token_ids
        ):
            return "stop"
        seq.detokenizer.add_token(token)
        if seq.detokenizer.stopped or (seq.matcher is not None and seq.matcher.finished):
            return "stop"
        if seq.num_output_tokens >= seq.max_tokens:
            return "length"
        return None

    def _fail(self, seq: Sequence) -> RequestDelta:
        """The request of `seq` fails, alone; its pages go back to the pool wiped."""
        request = self.requests.pop(seq.request_id)
        adapter = f" with adapter {seq.adapter.adapter_id}" if seq.adapter else ""
        request.error = RequestFailedError(
            f"the model's output for this request{adapter} became NaN or infinite after "
            f"{seq.num_output_tokens} tokens; nothing else was affected"
        )
        logger.warning("request %s failed: non-finite logits%s", request.request_id, adapter)
        self.counters.num_failed_requests += 1
        return self._end(request, "error")

    def _end(self, request: Request, reason: str) -> RequestDelta:
        live = [seq for seq in request.seqs if not seq.is_finished]
        self.scheduler.abort(request.seqs)  # finished ones too, if a failed step left them
        for seq in live:
            seq.finish_reason = reason
        return take_delta(request, live)

    def _count(self, out: SchedulerOutput, result: StepResult, seconds: float) -> None:
        c = self.counters
        c.num_steps += 1
        c.step_seconds += seconds
        c.last_step_seconds = seconds
        c.last_batch_size = len(out.scheduled)
        c.last_batch_tokens = sum(item.num_new for item in out.scheduled)
        c.num_computed_tokens += c.last_batch_tokens
        c.num_generated_tokens += len(result.sampled)

    # -- adapters ---------------------------------------------------------------------------

    def load_adapter(self, lora: LoRARequest, pin: bool = False) -> None:
        """Read and validate the adapter, and bring it into the pool now if there is room (or
        always, when pinned). Raises AdapterError naming the problem."""
        self.load_adapter_ref(self.catalog.get(lora.adapter_id, lora.path), pin)

    def load_adapter_ref(self, ref: AdapterRef, pin: bool = False) -> None:
        """`load_adapter` for an adapter already read (no disk access: the engine thread's)."""
        if pin:
            self._check_pin_leaves_room(ref)
            self.adapters.pin(ref)
        else:
            self.adapters.preload(ref)

    def _check_pin_leaves_room(self, ref: AdapterRef) -> None:
        """Pinning must not shrink the pool below what a request in flight was promised."""
        pinned_after = self.adapters.pinned_pages(besides=ref) + self.adapters.plan_pages(
            ref.weights
        )
        for request in self.requests.values():
            own = request.seqs[0].adapter
            if own is not None and own.content_hash == ref.content_hash:
                continue  # pinning its own adapter takes nothing from it
            needed = request.num_pages_needed
            if own is not None and self.adapters.is_pinned(own):
                needed -= self.adapters.plan_pages(own.weights)  # in pinned_after already
            if needed + pinned_after > self.pool.num_pages:
                raise AdapterError(
                    f"pinning adapter {ref.adapter_id} ({self.adapters.plan_pages(ref.weights)} "
                    f"pages) would leave {self.pool.num_pages - pinned_after} unpinned pages; "
                    f"a request in flight needs {request.num_pages_needed}",
                    code=ErrorCode.ADAPTER_TOO_LARGE,
                )

    def pin_adapter(self, lora: LoRARequest) -> None:
        self.load_adapter(lora, pin=True)

    def unpin_adapter(self, adapter_id: str) -> None:
        self.adapters.unpin(adapter_id)

    def unload_adapter(self, adapter_id: str) -> None:
        """Forget the adapter. Requests already in flight with it still finish, and then its
        pages go: they no longer name it."""
        self.catalog.forget(adapter_id)
        self.adapters.unload(adapter_id)
        for seq in self.scheduler.sequences():
            if seq.adapter is not None and seq.adapter.adapter_id == adapter_id:
                seq.adapter = seq.adapter.retired()

    def validate_adapter(self, lora: LoRARequest) -> AdapterInfo:
        """Read and check the adapter, changing nothing (not the pool, not the host cache).
        Raises AdapterError. Any thread."""
        weights = self.catalog.read(lora.path)
        num_pages = self.adapters.plan_pages(weights)
        pinned = self.adapters.pinned_pages(besides=AdapterRef(None, weights))
        if num_pages > self.pool.num_pages - pinned:
            raise AdapterError(
                f"adapter {lora.adapter_id} needs {num_pages} pages; the pool has "
                f"{self.pool.num_pages}, {pinned} of them pinned",
                code=ErrorCode.ADAPTER_TOO_LARGE,
            )
        return AdapterInfo(
            rank=weights.rank,
            target_modules=tuple(sorted({module for _, module in weights.a})),
            num_layers=len({layer for layer, _ in weights.a}),
            scale=weights.scale,
            nbytes=weights.nbytes,
            num_pages=num_pages,
            content_hash=weights.content_hash,
        )

    def pool_snapshot(self) -> PoolSnapshot:
        return self.adapters.snapshot(self._kv_pages_in_use(), self.kv.num_cached_pages)

    def _kv_pages_in_use(self) -> int:
        return self.pool.num_used - self.adapters.num_pages - self.kv.num_cached_pages

    # -- introspection ----------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model=str(self.model_dir),
            architecture=self.model_config.architecture,
            dtype=self.config.dtype,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
            has_chat_template=bool(self.tokenizer.hf.chat_template),
            max_lora_rank=self.config.max_lora_rank,
            num_pages=self.pool.num_pages,
            page_size=self.config.page_size,
        )

    def stats(self) -> EngineStats:
        running = {seq.request_id for seq in self.scheduler.running}
        return self.counters.snapshot(
            num_running_requests=len(running),
            num_waiting_requests=len(self.requests) - len(running),
            num_preemptions=self.scheduler.num_preemptions,
            adapters=self.adapters,
            catalog=self.catalog,
            pool=self.pool,
            kv=self.kv,
        )

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions


__all__ = ["EngineError", "LLMEngine", "LoRARequest"]
