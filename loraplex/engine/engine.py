"""The synchronous engine: requests in, one step at a time, deltas out. Not thread-safe; the async
engine drives it from a single thread."""

from __future__ import annotations

import logging
import time
import uuid

import torch

from loraplex.engine.config import EngineConfig, ModelConfig
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
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(
            self.model, self.kv, Sampler(config.seed), config.torch_dtype, config.device
        )
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
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Tokenize and validate; raises ValueError naming the problem. Touches no engine state,
        so it may run on any thread."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
        max_tokens = self._check_lengths(token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        seqs = [
            self._make_sequence(request_id, i, token_ids, params, max_tokens)
            for i in range(params.n)
        ]
        return Request(request_id, text, token_ids, seqs)

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
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
        if needed > self.pool.num_pages:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {needed} KV "
                f"pages; the pool has {self.pool.num_pages}"
            )
        return max_tokens

    def _make_sequence(
        self,
        request_id: str,
        index: int,
        token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
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

    # -- introspection ----------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
