"""bfloat16 decoder layers in one native call against the calls one by one, in one process.

    python benchmarks/fused_layers.py [--requests 32] [--new-tokens 64] [--rounds 10]

Runs the same base-model generation (64-token prompts, greedy, EOS ignored) on one engine with
CausalLM.fuse_layers on and off, alternated round by round, and prints the tokens/s of each
(median of the rounds), their ratio, and whether both gave the same tokens and logprobs. Needs a
CPU with a native bfloat16 projection (AMX or AVX512-BF16).
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine_throughput import make_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()

    from loraplex import LLM, SamplingParams
    from loraplex.engine.default_model import resolve_model

    llm = LLM(model=str(resolve_model(args.model)), dtype="bfloat16")
    model = llm.engine.runner.model
    if model._decoder is None:
        raise SystemExit("no native bfloat16 ops on this CPU: nothing to compare")
    prompts = make_prompts(llm.tokenizer, args.requests, 64)
    checked = SamplingParams(
        temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=2
    )
    outputs = {}
    for fused in (True, False):
        model.fuse_layers = fused
        outputs[fused] = [
            (r.outputs[0].token_ids, r.outputs[0].logprobs) for r in llm.generate(prompts, checked)
        ]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.rounds):
        for fused in (True, False) if i % 2 == 0 else (False, True):
            model.fuse_layers = fused
            started = time.perf_counter()
            llm.generate(prompts, params)
            seconds[fused].append(time.perf_counter() - started)
    tokens = args.requests * args.new_tokens
    fused, apart = (tokens / statistics.median(seconds[f]) for f in (True, False))
    print(
        f"{args.requests} requests x (64 prompt + {args.new_tokens} new tokens), bfloat16, "
        f"median of {args.rounds} rounds each, alternated"
    )
    print(f"  layers in one native call {fused:7.1f} tok/s")
    print(f"  calls one by one          {apart:7.1f} tok/s")
    same = outputs[True] == outputs[False]
    print(f"  ratio {fused / apart:.3f}x; same tokens and logprobs: {same}")


if __name__ == "__main__":
    main()
