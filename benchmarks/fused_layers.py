"""bfloat16 decoder layers in one native call against the calls one by one, in one process.

    python benchmarks/fused_layers.py [--requests 32] [--new-tokens 64] [--rounds 10]
        [--adapters 32 --modules qv|all]

Runs the same generation (64-token prompts, greedy, EOS ignored; on the base model, or with
--adapters, request i on random rank-16 adapter i mod N) on one engine with
CausalLM.fuse_layers on and off, alternated round by round, and prints the tokens/s of each
(median of the rounds), their ratio, and whether both gave the same tokens and logprobs. Needs a
CPU with a native bfloat16 projection (AMX or AVX512-BF16).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from engine_throughput import make_prompts
from lora_floor import ALL, QV


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--adapters", type=int, default=0)
    parser.add_argument("--modules", choices=("qv", "all"), default="all")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        compare(args, Path(tmp))


def compare(args: argparse.Namespace, tmp: Path) -> None:
    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.engine.adapters.peft_format import random_peft_adapter
    from loraplex.engine.default_model import resolve_model

    llm = LLM(model=str(resolve_model(args.model)), dtype="bfloat16")
    model = llm.engine.runner.model
    if model._decoder is None:
        raise SystemExit("no native bfloat16 ops on this CPU: nothing to compare")
    prompts = make_prompts(llm.tokenizer, args.requests, 64)
    modules = QV if args.modules == "qv" else ALL
    loras = [
        LoRARequest(f"a{i}", str(random_peft_adapter(tmp / f"a{i}", model.config, 16, modules, i)))
        for i in range(args.adapters)
    ]
    for lora in loras:  # resident before either way runs: the same batches for both
        llm.engine.load_adapter(lora)
    adapters = [loras[i % len(loras)] for i in range(args.requests)] if loras else None
    checked = SamplingParams(
        temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=2
    )
    # once before: the prompts' KV is then in the prefix cache for every run compared (in
    # bfloat16 a prompt's LoRA spans round differently when part of it comes from the cache)
    llm.generate(prompts, checked, adapters=adapters)
    outputs = {}
    for fused in (True, False):
        model.fuse_layers = fused
        outputs[fused] = [
            (r.outputs[0].token_ids, r.outputs[0].logprobs)
            for r in llm.generate(prompts, checked, adapters=adapters)
        ]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.rounds):
        for fused in (True, False) if i % 2 == 0 else (False, True):
            model.fuse_layers = fused
            started = time.perf_counter()
            llm.generate(prompts, params, adapters=adapters)
            seconds[fused].append(time.perf_counter() - started)
    tokens = args.requests * args.new_tokens
    fused, apart = (tokens / statistics.median(seconds[f]) for f in (True, False))
    on = f"{args.adapters} rank-16 adapters ({args.modules})" if loras else "the base model"
    print(
        f"{args.requests} requests x (64 prompt + {args.new_tokens} new tokens) on {on}, "
        f"bfloat16, median of {args.rounds} rounds each, alternated"
    )
    print(f"  layers in one native call {fused:7.1f} tok/s")
    print(f"  calls one by one          {apart:7.1f} tok/s")
    same = outputs[True] == outputs[False]
    print(f"  ratio {fused / apart:.3f}x; same tokens and logprobs: {same}")


if __name__ == "__main__":
    main()
