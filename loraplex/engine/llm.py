"""Offline batch API, in the shape vLLM users know:

    from loraplex import LLM, SamplingParams
    llm = LLM(model="default")
    for result in llm.generate(["Hello"], SamplingParams(max_tokens=32)):
        print(result.outputs[0].text)

`chat` does the same for conversations, through the model's chat template.
"""

from __future__ import annotations

from loraplex.engine.config import EngineConfig
from loraplex.engine.engine import LLMEngine, LoRARequest
from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "default", **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        adapters: list[str | LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One result per prompt, in order; all prompts run together in the continuous batch.

        `adapters` gives each prompt a LoRA adapter (a PEFT directory or a LoRARequest), or None
        for the base model.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        param_list = _per_prompt(params, len(prompts))
        loras = [_as_lora(a) for a in adapters] if adapters else [None] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} adapters for {len(prompts)} prompts")
        requests = [
            self.engine.make_request(p, sp, lora=lora)
            for p, sp, lora in zip(prompts, param_list, loras, strict=True)
        ]
        results = {}
        for request in requests:
            self.engine.add_request(request)
            results[request.request_id] = RequestOutput(
                request_id=request.request_id,
                prompt=request.prompt,
                prompt_token_ids=request.prompt_token_ids,
                outputs=[CompletionOutput(index=i) for i in range(len(request.seqs))],
                arrival_time=request.arrival_time,
            )
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                results[delta.request_id].add(delta)
        return [results[r.request_id] for r in requests]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        adapters: list[str | LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Like `generate`, for conversations: applies the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c) for c in conversations]
        return self.generate(prompts, params, adapters)


def _as_lora(adapter: str | LoRARequest | None) -> LoRARequest | None:
    if adapter is None or isinstance(adapter, LoRARequest):
        return adapter
    return LoRARequest(adapter_id=str(adapter), path=str(adapter))


def _per_prompt(params: SamplingParams | list[SamplingParams] | None, n: int):
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
