"""The Python a step spends on its LoRA metadata, in steps whose batch changes.

    python benchmarks/step_bookkeeping.py [--modules qv|all] [--rounds 4] [--steps 120]
                                          [--dtype auto|bfloat16|float32] [--against REV]

A request arrives every step, as in mixed_steps.py (a 64-token prompt, 32 new tokens, greedy,
each on the next of 32 distinct rank-16 adapters), so no step's batch is the one before's and
its LoRA metadata is built anew every step:

* the token runs and the row tables they read (in build_forward_batch);
* each projection's LoRA calls and the rows it fetches (CausalLM._lora_steps);
* their native form, for the decoder layers' one native call (lora_steps.BatchSteps.native_calls).

This times those three in every step as the engine runs it, with the caches cold after the
native work of the step before, and the same on the base model under the same arrivals (where
the first is all there is), in the dtype the engine serves here unless `--dtype` says another.
It prints, per round, milliseconds of bookkeeping a step and the step's whole time.

With `--against REV` it also runs the package as it is at git revision REV (from `git archive`),
in processes of its own, each round one process of each, their order alternating. The
bookkeeping is timed inside each process, so the host's drift from one process to the next
moves it less than it moves the steps' times.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS, NEW_TOKENS, ADAPTERS = 64, 32, 32


def timed(owner, name: str, spent: list[float]) -> None:
    """owner.name wrapped so that each call adds its seconds to `spent`."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    setattr(owner, name, wrapper)


def one_round(modules: str, steps: int, dtype: str) -> dict:
    """A run of `steps` arriving requests on the adapters, then one on the base model (after a
    warm-up run): each one's bookkeeping and whole time, milliseconds a step; and the dtype
    served."""
    import torch
    from engine_throughput import make_prompts
    from lora_floor import ALL, QV, load_random_adapters

    from loraplex import LLM, SamplingParams
    from loraplex.engine import model, runner
    from loraplex.engine.default_model import resolve_model

    try:
        from loraplex.engine import lora_steps
    except ImportError:  # a revision before lora_steps.py, whose model.py held BatchSteps
        lora_steps = model
    spent: list[float] = []
    timed(runner, "build_forward_batch", spent)
    timed(model.CausalLM, "_lora_steps", spent)
    timed(lora_steps.BatchSteps, "native_calls", spent)
    llm = LLM(model=str(resolve_model("default")), dtype=dtype, max_num_batched_tokens=256)
    engine = llm.engine
    folder = tempfile.TemporaryDirectory()
    loras = load_random_adapters(llm, QV if modules == "qv" else ALL, ADAPTERS, Path(folder.name))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    torch.manual_seed(0)
    prompts = iter(make_prompts(llm.tokenizer, 3 * steps, PROMPT_TOKENS))

    def arrivals(on: list | None) -> dict[str, float]:
        spent.clear()
        started = time.perf_counter()
        for i in range(steps):
            lora = on[i % len(on)] if on else None
            engine.add_request(engine.make_request(next(prompts), params, lora=lora))
            engine.step()
        seconds = time.perf_counter() - started
        bookkeeping = sum(spent)
        while engine.has_unfinished():
            engine.step()
        return {"bookkeeping": bookkeeping * 1e3 / steps, "step": seconds * 1e3 / steps}

    arrivals(loras)  # warm-up
    result = {"adapters": arrivals(loras), "base": arrivals(None)}
    result["dtype"] = engine.config.dtype
    folder.cleanup()
    return result


def in_process(tree: Path | None, modules: str, steps: int, dtype: str) -> dict:
    """one_round in a process of its own, on the package of `tree` (None: the working tree)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--one-round", "--modules", modules]
    command += ["--steps", str(steps), "--dtype", dtype]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # REV may lack a function this times
        raise SystemExit(f"a round failed ({tree or 'working tree'}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modules", choices=("qv", "all"), default="qv")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--dtype", default="auto", help="the engine's (auto: what it serves here)")
    parser.add_argument("--against", help="git revision to time beside the working tree")
    parser.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_round:
        print(json.dumps(one_round(args.modules, args.steps, args.dtype)))
        return

    with tempfile.TemporaryDirectory() as folder:
        trees: dict[str, Path | None] = {"working tree": None}
        if args.against:
            archive = subprocess.run(
                ["git", "archive", args.against, "loraplex"], cwd=ROOT, check=True,
                capture_output=True,
            ).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
            trees[args.against] = Path(folder)
        names = list(trees)
        results: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                results[name].append(in_process(trees[name], args.modules, args.steps, args.dtype))

    print(
        f"a {PROMPT_TOKENS}-token request arriving every step on {ADAPTERS} distinct rank-16 "
        f"{args.modules} adapters, {results['working tree'][0]['dtype']}, {args.steps} steps a "
        "run; ms a step, each round"
    )
    for name, rounds in results.items():
        for kind in ("adapters", "base"):
            book = [r[kind]["bookkeeping"] for r in rounds]
            step = [r[kind]["step"] for r in rounds]
            print(
                f"{name:14s} {kind:8s} bookkeeping {statistics.median(book):6.2f} "
                f"({' '.join(f'{b:.2f}' for b in book)}); step {statistics.median(step):6.2f} "
                f"({' '.join(f'{s:.2f}' for s in step)})"
            )
        ratios = [r["base"]["step"] / r["adapters"]["step"] for r in rounds]
        print(f"{name:14s} adapters against the base model, throughput "
              f"{statistics.median(ratios):.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
