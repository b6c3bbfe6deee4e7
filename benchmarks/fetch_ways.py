"""How a decode step fetches its LoRA rows: each way the engine may take, measured in one engine,
and the way its own timer keeps.

    python benchmarks/fetch_ways.py [--modules qv|all] [--dtype auto|float32|bfloat16]
                                    [--rounds 30] [--timings 3] [--timer-rounds N]

One engine (SmolLM2), 32 sequences decoding together on 32 distinct rank-16 adapters on the
modules asked (64-token prompts). Each round takes, for each way the batch's steps may fetch
(fetch_placement.py: the layer before's gate_up ahead, each projection all its call's rows, or
its A rows alone; as the CPU, the dtype and the modules allow), a step fetching that way and the
same batch with LoRA skipped, the ways' order turning round by round; it prints each way's
median step and its median extra over base. Then the engine's timer measures the ways afresh
`--timings` times, as it does while serving (fetch_placement.ROUNDS rounds each, or
`--timer-rounds`), and prints the way each measurement kept: where the ways lie within the noise,
they may differ.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from engine_throughput import make_prompts
from lora_floor import ALL, QV, LoRASwitch, add_decoding, load_random_adapters, step_pair


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modules", choices=("qv", "all"), default="qv")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--timings", type=int, default=3)
    parser.add_argument("--timer-rounds", type=int, help="rounds a timing takes (default ROUNDS)")
    args = parser.parse_args()
    torch.set_num_threads(2)

    from loraplex import LLM
    from loraplex.engine.default_model import resolve_model
    from loraplex.engine.fetch_placement import ROUNDS, FetchPlacement

    modules = QV if args.modules == "qv" else ALL
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=str(resolve_model("default")), dtype=args.dtype)
        engine, switch = llm.engine, LoRASwitch()
        loras = load_random_adapters(llm, modules, 32, Path(tmp))
        model = engine.runner.model
        placement = model.fetch_placement
        timer_rounds = args.timer_rounds or ROUNDS
        steps = 3 * (2 * args.rounds + args.timings * (timer_rounds + 1)) + 10  # 3 ways at most
        add_decoding(engine, make_prompts(llm.tokenizer, 32, 64), loras, steps + 20)
        started: set[str] = set()
        while len(started) < 32:  # past the prefills
            started |= {delta.request_id for delta in engine.step()}
        step_pair(engine, switch)  # the batch's ways known
        ways = model._steps.ways
        print(
            f"SmolLM2 {engine.config.torch_dtype}, 32 sequences on 32 rank-16 {args.modules} "
            f"adapters; "
            f"the ways: {', '.join(ways)} ({ways[0]} until timed)"
        )
        pairs: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        for r in range(args.rounds):
            turn = r % len(ways)
            for way in ways[turn:] + ways[:turn]:
                placement.fix(way)
                pairs[way].append(step_pair(engine, switch))
        for way, timed in pairs.items():
            step = statistics.median(on for on, _ in timed)
            extra = statistics.median(on - off for on, off in timed)
            print(
                f"  {way:8s} step {step * 1e3:7.2f} ms  extra over base {extra * 1e3:6.2f} ms "
                f"(medians of {len(timed)})"
            )
        kept = []
        for _ in range(args.timings):
            model.fetch_placement = timer = FetchPlacement(rounds=timer_rounds)
            switch.on = True
            for _ in range(len(ways) * (timer_rounds + 1)):
                engine.step()
            kept.append(timer.chosen(model._steps.key, ways))
        print(f"  the engine's timer kept, {args.timings} measurements afresh: {', '.join(kept)}")


if __name__ == "__main__":
    main()
