"""Decoder layers in one native call against the calls one by one, in one process.

    python benchmarks/fused_layers.py [--dtype bfloat16|float32] [--requests 32]
        [--new-tokens 64] [--rounds 10] [--adapters 32 --modules qv|all]

Runs the same generation (64-token prompts, greedy, EOS ignored; on the base model, or with
--adapters, request i on random rank-16 adapter i mod N) on one engine three ways, alternated
round by round: CausalLM.fuse_layers on; off; and off with torch's element-wise ops in place of
the native ones (norms, SwiGLU, rotary embedding and KV write: the float32 path before it had
them). Prints the tokens/s of each (median of the rounds), their ratios, whether the first two
gave the same tokens and logprobs, and whether torch's ops gave the same tokens. Needs a CPU
with a native projection in that dtype (bfloat16: AMX or AVX512-BF16; float32: AVX-512 on Zen 4
or Intel).
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
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
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

    llm = LLM(model=str(resolve_model(args.model)), dtype=args.dtype)
    model = llm.engine.runner.model
    if model._decoder is None or not model.layers[0].qkv.native_rows(1):
        raise SystemExit(f"no native {args.dtype} projection on this CPU: nothing to compare")
    prompts = make_prompts(llm.tokenizer, args.requests, 64)
    modules = QV if args.modules == "qv" else ALL
    loras = [
        LoRARequest(f"a{i}", str(random_peft_adapter(tmp / f"a{i}", model.config, 16, modules, i)))
        for i in range(args.adapters)
    ]
    for lora in loras:  # resident before either way runs: the same batches for both
        llm.engine.load_adapter(lora)
    adapters = [loras[i % len(loras)] for i in range(args.requests)] if loras else None
    native_ops = model._ops
    ways = {  # name: (fuse_layers, element-wise ops)
        "layers in one native call": (True, native_ops),
        "calls one by one": (False, native_ops),
        "calls one by one, torch's ops": (False, None),
    }

    def generate(way: str, params: SamplingParams):
        model.fuse_layers, model._ops = ways[way]
        return llm.generate(prompts, params, adapters=adapters)

    checked = SamplingParams(
        temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=2
    )
    # once before: the prompts' KV is then in the prefix cache for every run compared (in
    # bfloat16 a prompt's LoRA spans round differently when part of it comes from the cache)
    generate("calls one by one", checked)
    outputs = {
        way: [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in generate(way, checked)]
        for way in ways
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for i in range(args.rounds):
        for way in list(ways)[i % len(ways) :] + list(ways)[: i % len(ways)]:
            started = time.perf_counter()
            generate(way, params)
            seconds[way].append(time.perf_counter() - started)
    model.fuse_layers, model._ops = True, native_ops
    tokens = args.requests * args.new_tokens
    speed = {way: tokens / statistics.median(seconds[way]) for way in ways}
    on = f"{args.adapters} rank-16 adapters ({args.modules})" if loras else "the base model"
    print(
        f"{args.requests} requests x (64 prompt + {args.new_tokens} new tokens) on {on}, "
        f"{args.dtype}, median of {args.rounds} rounds each, in turn"
    )
    first = next(iter(ways))
    for way in ways:
        print(f"  {way:30s} {speed[way]:7.1f} tok/s  ({speed[first] / speed[way]:.3f}x to it)")
    same = outputs[first] == outputs["calls one by one"]
    print(f"  one native call and one by one: same tokens and logprobs: {same}")
    tokens_of = {way: [ids for ids, _ in outputs[way]] for way in ways}
    same_tokens = tokens_of[first] == tokens_of["calls one by one, torch's ops"]
    print(f"  native and torch's element-wise ops: same tokens: {same_tokens}")


if __name__ == "__main__":
    main()
