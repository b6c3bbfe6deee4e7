"""Many adapters in one continuous batch vs the base model alone vs PEFT, side by side in one run.

    python benchmarks/multi_lora_throughput.py                 # 32 rank-16 adapters on q,v
    python benchmarks/multi_lora_throughput.py --modules q_proj,k_proj,v_proj,o_proj

Prints output tokens/s of 32 concurrent requests spread over 32 distinct adapters, of the same 32
requests on the base model alone, and of transformers + PEFT switching adapters per request; the
ratios; and the cold-load time of one adapter from disk to its first generated token.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import hf_generate_alone, make_prompts


def run_engine(llm, prompts, new_tokens: int, adapters) -> float:
    from loraplex import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, adapters=adapters)
    elapsed = time.perf_counter() - start
    return sum(len(r.outputs[0].token_ids) for r in results) / elapsed


def run_peft_switching(model_dir: Path, adapter_dirs: list[Path], prompts, new_tokens) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name="a0")
    for i, path in enumerate(adapter_dirs[1:], start=1):
        model.load_adapter(str(path), adapter_name=f"a{i}")
    model.eval()
    tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            model.set_adapter(f"a{i}")
            tokens += hf_generate_alone(model, prompt, new_tokens)
    return tokens / (time.perf_counter() - start)


def cold_load_seconds(llm, adapter_dir: Path, prompt) -> float:
    """From a request naming an adapter never seen (not in host memory, not in the pool) to its
    first generated token."""
    from loraplex import LoRARequest, SamplingParams

    engine = llm.engine
    start = time.perf_counter()
    request = engine.make_request(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=1),
        lora=LoRARequest("cold", str(adapter_dir)),
    )
    engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--modules", default="q_proj,v_proj")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--peft-requests",
        type=int,
        default=8,
        help="run the PEFT baseline on the first N requests (it is ~40x slower)",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from loraplex import LLM, LoRARequest
    from loraplex.engine.adapters.peft_format import random_peft_adapter
    from loraplex.engine.default_model import resolve_model

    model_dir = resolve_model(args.model)
    llm = LLM(model=str(model_dir), max_num_batched_tokens=256, dtype=args.dtype)
    config = llm.engine.model_config
    prompts = make_prompts(llm.tokenizer, args.requests, args.prompt_tokens)
    modules = tuple(args.modules.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [
            random_peft_adapter(Path(tmp) / f"a{i}", config, args.rank, modules, seed=i)
            for i in range(args.requests + 1)
        ]
        loras = [LoRARequest(f"a{i}", str(d)) for i, d in enumerate(dirs[:-1])]
        for lora in loras:
            llm.engine.load_adapter(lora)  # disk -> host -> pool before timing
        run_engine(llm, prompts[:2], 4, loras[:2])  # warm up
        base = run_engine(llm, prompts, args.new_tokens, None)
        multi = run_engine(llm, prompts, args.new_tokens, loras)
        cold = cold_load_seconds(llm, dirs[-1], prompts[0])
        snapshot = llm.engine.pool_snapshot()
        del llm
        peft = run_peft_switching(
            model_dir, dirs[: args.peft_requests], prompts[: args.peft_requests], args.new_tokens
        )

    print(
        f"model {model_dir.name}, float32, {args.threads} threads; {args.requests} requests x "
        f"({args.prompt_tokens} prompt + {args.new_tokens} new tokens), greedy, EOS ignored"
    )
    print(
        f"adapters: {args.requests} distinct, rank {args.rank}, on {', '.join(modules)}; "
        f"{snapshot.adapter_pages} pool pages resident"
    )
    print(f"{'loraplex, base model only':40s} {base:8.1f} tok/s")
    print(f"{'loraplex, 32 adapters in one batch':40s} {multi:8.1f} tok/s")
    print(
        f"{'PEFT, switching adapter per request':40s} {peft:8.1f} tok/s "
        f"({args.peft_requests} requests)"
    )
    print(f"multi-LoRA / base-only: {multi / base:5.2f}x   (target >= 0.75x)")
    print(f"multi-LoRA / PEFT:      {multi / peft:5.1f}x   (target >= 15x)")
    print(f"cold load of one rank-{args.rank} adapter, disk to first token: {cold * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
