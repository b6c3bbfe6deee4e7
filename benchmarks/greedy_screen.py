"""A float32 greedy step's picks through the LM head's screen (kernels/cpu_screen.py) against the
full head and its argmax, alternated in one process.

    python benchmarks/greedy_screen.py [--steps 60] [--rounds 6] [--sequences 32] [--any-rows]

Workload: SmolLM2 in float32 on the base model, `--sequences` sequences decoding together
(64-token prompts, greedy, EOS ignored). First the LM head alone on that many rows, 32, 16 and
1 of the final hidden states of real decode steps: the engine's full head (the native float32
one up to 32 rows, oneDNN's beyond) and the argmax pass after it (the engine's way without the
screen) against the screen, alternated; the screen's picks must equal the argmax's. Then the
engine's decode steps with the screen on and off in turn, then whole runs of as many requests
of 64 new tokens in turn (`--rounds` pairs, each on prompts of its own), and one batch run both
ways, whose tokens must be the same. Prints medians, paired differences and ratios, and the
steps the screen declined. Beyond 32 sequences only the AVX512-VNNI tile takes the steps (the
AVX2 tile takes those of the native head alone); `--any-rows` lets the AVX2 tile take them too,
to measure it there against oneDNN's head.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from engine_throughput import make_prompts
from greedy_pick import NEW_TOKENS, PROMPT_TOKENS, SEQUENCES, paired_runs, paired_steps, print_pairs


def alone(model, argmax, states: torch.Tensor, rounds: int, sequences: int = SEQUENCES) -> None:
    """The head and argmax against the screen on rows of `states`, alternated."""
    screen = model._screen
    for rows in sorted({sequences, 32, 16, 1}, reverse=True):
        times: dict[str, list[float]] = {"screen": [], "head and argmax": []}
        for i in range(rounds):
            x = states[i * rows % (len(states) - rows) :][:rows].contiguous()
            ways = {
                "screen": lambda x=x: screen.greedy(x),
                "head and argmax": lambda x=x: argmax.greedy(model.head(x))[0],
            }
            picks = {}
            for name in list(ways) if i % 2 == 0 else list(ways)[::-1]:
                begun = time.perf_counter()
                picks[name] = ways[name]()
                times[name].append(time.perf_counter() - begun)
            assert torch.equal(picks["screen"], picks["head and argmax"]), "the picks differ"
        listed = ", ".join(f"{n} {statistics.median(t) * 1e3:.2f} ms" for n, t in times.items())
        ratio = statistics.median(times["screen"]) / statistics.median(times["head and argmax"])
        print(f"alone, {rows} rows: {listed}, {ratio:.2f}x the time (medians of {rounds})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="pairs of decode steps")
    parser.add_argument("--rounds", type=int, default=6, help="pairs of whole runs")
    parser.add_argument("--sequences", type=int, default=SEQUENCES, help="decoding together")
    parser.add_argument("--any-rows", action="store_true", help="the AVX2 tile beyond 32 rows")
    args = parser.parse_args()
    torch.set_num_threads(2)

    import os

    os.environ.setdefault("LORAPLEX_SCREEN", "1")  # wherever it builds, measured or not
    from loraplex import LLM, SamplingParams

    llm = LLM(model="default", dtype="float32")
    model = llm.engine.runner.model
    screen = model._screen
    if screen is None:
        raise SystemExit("no screen on this machine (LORAPLEX_SCREEN=0, or no AVX2 build)")
    screen.any_rows = screen.any_rows or args.any_rows
    ways = {"screen": screen, "full head": None}

    def use(name: str) -> None:
        model._screen = ways[name]

    sequences = args.sequences
    prompts = make_prompts(llm.tokenizer, sequences * (2 + 2 * args.rounds), PROMPT_TOKENS)
    batches = [prompts[i : i + sequences] for i in range(0, len(prompts), sequences)]

    states: list[torch.Tensor] = []  # the final hidden states of the decode steps' rows
    picks = model.greedy_picks

    def recorded(hidden):
        if hidden.shape[0] == sequences:
            states.append(hidden.clone())
        return picks(hidden)

    model.greedy_picks = recorded
    steps = paired_steps(llm, batches[0], list(ways), use, args.steps)
    model.greedy_picks = picks
    alone(model, llm.engine.runner.sampler._argmax, torch.cat(states), 60, sequences)

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = {}
    for name in ways:
        use(name)
        outputs[name] = [out.outputs[0].token_ids for out in llm.generate(batches[1], params)]
    use("screen")
    runs = paired_runs(llm, batches[2:], list(ways), use)
    tile = "AVX512-VNNI" if screen._screen.wide else "AVX2"
    print(f"model SmolLM2, float32, 2 threads, base model, {sequences} sequences, greedy")
    print(f"the screen's {tile} tile")
    print_pairs(steps, runs, sequences)
    same = outputs["screen"] == outputs["full head"]
    print(f"same tokens both ways: {same}; steps the screen declined: {screen.declined}")


if __name__ == "__main__":
    main()
