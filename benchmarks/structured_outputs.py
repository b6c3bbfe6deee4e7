"""Structured outputs: what a JSON-schema constraint costs the batch it shares, side by side.

    python benchmarks/structured_outputs.py [--dtype auto|float32|bfloat16]

A batch of 32 chat requests on SmolLM2, half of them constrained to one of four JSON schemas, is
generated (greedy); then the same 32 requests unconstrained, each asked for exactly as many tokens
as its constrained run produced (EOS ignored), so both batches do the same model work and differ
only by the grammar masks. The two alternate for several rounds; the medians' ratio is printed
(target >= 0.90x). Also: schema compile time, cold (a fresh compiler) and cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        },
        "required": ["name", "age", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "reason": {"type": "string"},
        },
        "required": ["label", "score", "reason"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                },
            },
            "note": {"type": "string"},
        },
        "required": ["items", "note"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
            "attendees": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["title", "day", "attendees"],
    },
]


def compile_times(engine) -> tuple[float, float]:
    """(cold, cached) seconds per schema, medians over SCHEMAS; cold on a fresh compiler."""
    from loraplex.engine.structured import Grammars, StructuredOutput

    config = engine.model_config
    fresh = Grammars(engine.tokenizer.hf, config.vocab_size, list(config.eos_token_ids))
    cold, cached = [], []
    for schema in SCHEMAS:
        constraint = StructuredOutput.json_schema(schema)
        start = time.perf_counter()
        fresh.compile(constraint)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        fresh.compile(constraint)
        cached.append(time.perf_counter() - start)
    return statistics.median(cold), statistics.median(cached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from loraplex import LLM, SamplingParams
    from loraplex.engine.structured import StructuredOutput

    llm = LLM(model="default", dtype=args.dtype, enable_prefix_caching=False)
    engine = llm.engine
    prompts = [
        engine.tokenizer.encode_chat(
            [{"role": "user", "content": f"Case {i}: describe it as JSON, with some detail."}]
        )
        for i in range(args.requests)
    ]
    constrained = [
        SamplingParams(
            temperature=0.0,
            max_tokens=args.max_tokens,
            structured_outputs=StructuredOutput.json_schema(SCHEMAS[i // 2 % len(SCHEMAS)]),
        )
        if i % 2 == 0
        else SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.requests)
    ]

    def run(params) -> tuple[float, list[int], list[str]]:
        start = time.perf_counter()
        results = llm.generate(prompts[: len(params)], params)
        elapsed = time.perf_counter() - start
        counts = [len(r.outputs[0].token_ids) for r in results]
        return sum(counts) / elapsed, counts, [r.outputs[0].text for r in results]

    run(constrained[:4])  # warm-up (compiles these schemas)
    _, counts, texts = run(constrained)
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in counts]
    with_schema, without = [], []
    for _ in range(args.rounds):
        with_schema.append(run(constrained)[0])
        without.append(run(free)[0])
    parsed = sum(1 for i, t in enumerate(texts) if i % 2 == 0 and _parses(t))
    cold, cached = compile_times(engine)
    print(
        f"model {engine.model_dir.name}, {engine.config.dtype}, {args.threads} threads; "
        f"{args.requests} requests, half constrained to {len(SCHEMAS)} JSON schemas; "
        f"{sum(counts)} output tokens per batch; medians of {args.rounds} alternated rounds"
    )
    print(f"constrained outputs that parse: {parsed}/{args.requests // 2}")
    print(f"batch with schemas      {statistics.median(with_schema):8.1f} tok/s")
    print(f"same batch, no schemas  {statistics.median(without):8.1f} tok/s")
    ratio = statistics.median(with_schema) / statistics.median(without)
    print(f"ratio {ratio:.3f}x (target >= 0.90x)")
    print(f"schema compile: cold {cold * 1e3:.1f} ms, cached {cached * 1e6:.0f} us (median)")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
