"""Continuous batching vs transformers on this machine, measured side by side in one run.

    python benchmarks/engine_throughput.py            # SmolLM2, 32 requests, 64 + 128 tokens

Prints output tokens/s for loraplex (all requests submitted at once), for transformers `generate`
one request at a time, and for transformers with every prompt padded into one static batch; the
ratios between them; time to first token p50/p99; and the achieved FLOP/s of the loraplex run
against this machine's measured float32 matmul FLOP/s.
"""

from __future__ import annotations

import argparse
import time

import torch

SENTENCES = [
    "The lighthouse keeper climbed the stairs every evening to light the lamp.",
    "A small boat appeared on the horizon just as the storm began to gather.",
    "In the village below, the baker was already preparing bread for the morning.",
    "Nobody remembered when the old bridge had been built, or by whom.",
    "The children ran along the beach, collecting shells and pieces of glass.",
    "A letter arrived with a stamp from a country that no longer existed.",
    "The river had flooded twice that year, and the fields were still wet.",
    "Her grandfather kept a map of the stars drawn by hand on thick paper.",
]


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = f"Story {i}. " + " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(8))
        ids = tokenizer.encode(text)
        assert len(ids) >= length, "make the seed text longer"
        prompts.append(ids[:length])
    return prompts


def measure_matmul_flops() -> tuple[float, float]:
    """float32 [512x576]x[576x1536]: torch.matmul, and the prepacked path the engine uses."""
    from loraplex.engine.device import Linear

    a, b = torch.randn(512, 576), torch.randn(576, 1536)
    packed = Linear(b.t().contiguous())
    return _flops(lambda: a @ b), _flops(lambda: packed(a))


def _flops(matmul, runs: int = 50) -> float:
    for _ in range(3):
        matmul()
    start = time.perf_counter()
    for _ in range(runs):
        matmul()
    return 2 * 512 * 576 * 1536 * runs / (time.perf_counter() - start)


def layer_weights(config) -> int:
    """The weights of one decoder layer's projections (q,k,v, o, gate, up, down)."""
    c = config
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    return per_layer + 3 * c.hidden_size * c.intermediate_size


def model_flops(config, prompts: list[list[int]], new_tokens: int) -> float:
    """Matmul FLOPs of the run: weights (2 per parameter per token) plus attention scores."""
    c = config
    weights = 2 * c.num_layers * layer_weights(c)
    total = 0.0
    for prompt in prompts:
        for position in range(len(prompt) + new_tokens - 1):
            attention = 4 * c.num_layers * c.q_size * (position + 1)
            total += weights + attention
        total += 2 * c.hidden_size * c.vocab_size * new_tokens  # lm_head on sampled rows only
    return total


def run_loraplex(model: str, prompts, new_tokens: int, dtype: str):
    from loraplex import LLM, SamplingParams

    llm = LLM(model=model, max_num_batched_tokens=256, dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ttft = sorted(r.first_token_time - r.arrival_time for r in results)
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    return tokens / elapsed, elapsed, ttft, llm


def hf_generate_alone(model, prompt: list[int], new_tokens: int) -> int:
    """Greedy transformers `generate` of exactly `new_tokens` for one prompt; -> tokens made."""
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt)),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out.shape[1] - len(prompt)


def run_hf_sequential(hf, prompts, new_tokens: int) -> float:
    start = time.perf_counter()
    tokens = sum(hf_generate_alone(hf, prompt, new_tokens) for prompt in prompts)
    return tokens / (time.perf_counter() - start)


def run_hf_static_batch(hf, prompts, new_tokens: int, pad_id: int) -> float:
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = hf.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start)


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--sequential-requests",
        type=int,
        default=None,
        help="run the one-at-a-time baseline on the first N prompts only",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from loraplex.engine.default_model import resolve_model
    from loraplex.engine.tokenizer import TokenizerWrapper

    model_dir = resolve_model(args.model)
    matmul_flops, packed_flops = measure_matmul_flops()
    prompts = make_prompts(TokenizerWrapper(model_dir), args.requests, args.prompt_tokens)
    ours, elapsed, ttft, llm = run_loraplex(str(model_dir), prompts, args.new_tokens, args.dtype)
    flops = model_flops(llm.engine.model_config, prompts, args.new_tokens)
    del llm

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        sequential = run_hf_sequential(hf, prompts[: args.sequential_requests], args.new_tokens)
        static = run_hf_static_batch(hf, prompts, args.new_tokens, pad_id=0)

    print(
        f"model {model_dir.name}, {args.dtype}, {args.threads} threads, {args.requests} requests, "
        f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, greedy, EOS ignored"
    )
    print(f"{'loraplex continuous batch':34s} {ours:8.1f} tok/s  ({elapsed:.1f} s)")
    print(f"{'transformers one at a time':34s} {sequential:8.1f} tok/s")
    print(f"{'transformers static batch':34s} {static:8.1f} tok/s")
    print(f"loraplex / one-at-a-time: {ours / sequential:5.1f}x   (target >= 12x)")
    print(f"loraplex / static batch:  {ours / static:5.2f}x   (target > 1x)")
    print(
        f"time to first token: p50 {percentile(ttft, 0.5) * 1e3:.0f} ms, "
        f"p99 {percentile(ttft, 0.99) * 1e3:.0f} ms"
    )
    achieved = flops / elapsed
    print(f"achieved {achieved / 1e9:.1f} GFLOP/s over the whole run ({flops / 1e9:.0f} GFLOP)")
    print(
        f"float32 matmul [512x576]x[576x1536]: torch.matmul {matmul_flops / 1e9:.1f} GFLOP/s "
        f"-> roofline fraction {achieved / matmul_flops:.2f}; prepacked oneDNN (the engine's "
        f"path) {packed_flops / 1e9:.1f} GFLOP/s -> {achieved / packed_flops:.2f}"
    )


if __name__ == "__main__":
    main()
