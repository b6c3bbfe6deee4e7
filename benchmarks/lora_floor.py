"""Multi-adapter decode steps against the memory-bandwidth floor, measured side by side in one run.

    python benchmarks/lora_floor.py [--dtype float32|bfloat16|auto]

A decode step of 32 sequences has to read every distinct adapter's weights once at least, so its
extra time over a base-only step cannot go below (adapter bytes read) / (memory bandwidth). This
prints, for 32 sequences decoding together (64 prompt tokens each, then steady decode steps):

* the box's read bandwidth (a sum over a 1 GiB tensor, larger than any cache, all threads),
  before the steps and after them: on a shared host it can change in between (a 2-core Zen 5
  VM moved between about 45 and 77 GB/s within minutes), and the floor uses the first; and
  read again between the pairs of steps (every SAMPLE_EVERY pairs), and the floor and the
  extra's multiple of it at the median of those reads, taken side by side with the steps;
* the step time with 32 distinct rank-16 adapters on q,v and on all seven projections, each step
  followed by the same batch with LoRA skipped (its base step); the adapter bytes each step
  reads; the floor they imply; the extra step time over base (median of the pairs' differences)
  as a multiple of that floor (target <= 1.25x for all-module) and the q,v batch's
  throughput against base (target >= 0.95x);
* what the base step itself reads (the weights and the sequences' KV cache) and how long that
  takes at the bandwidth read between the pairs: where the q,v floor is more than 5% of the
  base step, 0.95x needs the rows fetched while the step computes, and the rest of the base
  step is where that can happen; and so the most the step with adapters can run at against
  base, were all its bytes read at that rate and all else hidden behind the reads (where that
  is under 0.95x, the q,v target is likely out of reach at the box's bandwidth of the
  minute: the bound is of reads from memory, and some may come from L3);
* the q,v target as the issue words it, on throughput: the whole workload (the sequences'
  prompts prefilled, then 64 new tokens each, greedy, EOS ignored, as side_by_side.py runs it)
  with the q,v adapters and on the base model, `--workload-rounds` runs of each, in turn and
  each run on prompts of its own (a repeated prompt would find its KV in the prefix cache): each
  median, and the median of the pairs' ratios. A prompt chunk reads each adapter's rows once
  for its 256 tokens, but the decode steps are most of the run, and on a 2-core Zen 4 the whole
  run's ratio came out level with theirs (docs/performance.md);
* the engine's own strategy on 32 adapters measured once more after the strategies below, some
  minutes later: a shared host has slow phases (a 2-core Xeon's base step went from 46-48 to
  58-64 ms for tens of seconds), longer than one measurement, and two far apart show when one
  fell in one;
* what brings the q,v adapters' rows into cache before their LoRA call: where the build's
  projection fetches them, the way the engine chose by timing steps after a warm-up long
  enough for it (fetch_placement.py: the layer before's gate_up, or the q,k,v projection itself
  fetching all of them or, in float32, their A rows alone); or nothing (the AMX build);
* the same batches with each CPU LoRA strategy forced: *native* (the C kernel in
  kernels/cpu/lora.c, reading every decode token's rows in place; the default where it
  builds), and the torch path's two, *gathered* (every decode token's adapter rows copied into
  one buffer, applied with one batched matmul) and *grouped* (each adapter applied in place
  with plain matmuls, once for all its tokens), on 32 adapters x 1 token and 8 adapters x 4
  tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import layer_weights, make_prompts
from side_by_side import alternated_runs, prompt_sets

PROMPT_TOKENS = 64  # a sequence's prompt, in the steps and the whole runs alike
QV = ("q_proj", "v_proj")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class BandwidthProbe:
    """The box's streaming read: a torch sum over a tensor no cache holds, kept for the run so
    that it can be read between steps too."""

    def __init__(self, gib: float = 1.0) -> None:
        self.x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        self.x.sum()

    def read(self, runs: int = 1) -> float:
        """Bytes/s, best of `runs`."""
        return self.x.numel() * 4 / min(_timed(self.x.sum) for _ in range(runs))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class LoRASwitch:
    """Wraps the step's LoRA metadata builder so that a step can skip every adapter: the same
    batch then runs as base-only, and steps with and without LoRA alternate, so the machine's
    drift (other tenants of the host) falls on both alike."""

    def __init__(self) -> None:
        from loraplex.engine import forward_batch

        self.build, self.on = forward_batch.build_lora_batch, True
        forward_batch.build_lora_batch = self

    def __call__(self, *args):
        return self.build(*args) if self.on else None


def load_random_adapters(llm, modules, count: int, folder: Path, rank: int = 16) -> list:
    """`count` random rank-`rank` adapters on `modules` (seeds 0 .. count - 1, written under
    `folder`), loaded into `llm`'s engine: their LoRARequests, named a0, a1, ..."""
    from loraplex import LoRARequest
    from loraplex.engine.adapters.peft_format import random_peft_adapter

    loras = []
    for i in range(count):
        path = random_peft_adapter(folder / f"a{i}", llm.engine.model_config, rank, modules, seed=i)
        loras.append(LoRARequest(f"a{i}", str(path)))
        llm.engine.load_adapter(loras[-1])
    return loras


def add_decoding(engine, prompts, loras, max_tokens: int) -> None:
    """`prompts` added to `engine`, greedy with EOS ignored for `max_tokens` tokens each, request
    i on loras[i mod len(loras)] (on the base model where there are none)."""
    from loraplex import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(engine.make_request(prompt, params, lora=lora))


def step_pair(engine, switch: LoRASwitch) -> tuple[float, float]:
    """The times of a step with LoRA and of the next, the same batch with LoRA skipped (the
    switch is left off)."""
    switch.on = True
    with_lora = _timed(engine.step)
    switch.on = False
    return with_lora, _timed(engine.step)


@dataclasses.dataclass
class Steps:
    with_lora: float  # median step time, seconds
    without: float  # median step time of the same batch with LoRA skipped
    extra: float  # median of (with - without) over adjacent pairs
    bandwidth: list[float]  # bytes/s read between the pairs (BandwidthProbe), in order
    context: float  # median over the pairs of the tokens in the running sequences' KV cache


SAMPLE_EVERY = 6  # pairs of steps between two reads of the bandwidth


def decode_steps(
    engine, prompts, loras, steps: int, switch: LoRASwitch, probe: BandwidthProbe | None = None
) -> Steps:
    """Decode steps once every sequence is past its prefill, LoRA on and off in turn; with a
    probe, the bandwidth read before every SAMPLE_EVERY pairs, each read followed by a step left
    out of the pairs (the read empties the caches)."""
    add_decoding(engine, prompts, loras, 2 * steps + 4)
    started: set[str] = set()
    while len(started) < len(prompts):
        started |= {delta.request_id for delta in engine.step()}
    pairs, bandwidth, context = [], [], []
    for i in range(steps):
        if probe is not None and i % SAMPLE_EVERY == 0:
            bandwidth.append(probe.read())
            engine.step()
        context.append(sum(seq.num_tokens for seq in engine.scheduler.running))
        pairs.append(step_pair(engine, switch))
    switch.on = True
    while engine.has_unfinished():
        engine.step()
    return Steps(
        statistics.median(on for on, _ in pairs),
        statistics.median(off for _, off in pairs),
        statistics.median(on - off for on, off in pairs),
        bandwidth,
        statistics.median(context),
    )


def beside_pairs(steps: Steps, size: int) -> str:
    """The bandwidth read between a measurement's pairs, and its extra against the floor of
    `size` adapter bytes at their median."""
    during = statistics.median(steps.bandwidth)
    reads = ", ".join(f"{b / 1e9:.0f}" for b in steps.bandwidth)
    return (
        f"read between its pairs: {reads} GB/s; at their median, {during / 1e9:.1f} GB/s, the "
        f"floor is {size / during * 1e3:5.2f} ms and the extra, {steps.extra * 1e3:.2f} ms, "
        f"{steps.extra / (size / during):.2f}x it"
    )


def base_reads(config, dtype: torch.dtype, steps: Steps, size: int) -> str:
    """What a base decode step itself reads from memory, as a line to print: every projection's
    weights and the LM head, and the KV cache of its sequences; and the time that takes at the
    median of the reads between the pairs. q,v's 0.95x allows an extra of about 5% of the base
    step; where the rows' floor is more, a fetch has to carry them in the part of the step that
    does not stream. Then the most the step with `size` adapter bytes can run at against base
    were its every byte read from memory at that rate, with all the rest of its work hidden
    behind the reads: base step / max(base step, all its bytes / the rate)."""
    from loraplex.engine.kv_cache import kv_page_numel

    c, itemsize = config, dtype.itemsize
    weights = (c.num_layers * layer_weights(c) + c.vocab_size * c.hidden_size) * itemsize
    kv = steps.context * kv_page_numel(c, 1) * itemsize  # a one-token page: every layer's K, V
    during = statistics.median(steps.bandwidth)
    streaming = (weights + kv) / during
    least = max(steps.without, streaming + size / during)
    return (
        f"the base step reads {weights / 2**20:.0f} MiB of weights and {kv / 2**20:.0f} MiB of "
        f"KV cache ({steps.context:.0f} tokens): {streaming * 1e3:.1f} ms of its "
        f"{steps.without * 1e3:.1f} ms at {during / 1e9:.1f} GB/s; with the adapters' bytes "
        f"at that rate, {least * 1e3:.1f} ms at least, {steps.without / least:.2f}x base at most"
    )


def step_against_base(steps: Steps) -> str:
    """A measurement's median step with LoRA against the same batch's without."""
    return (
        f"step {steps.with_lora * 1e3:6.2f} ms against base {steps.without * 1e3:6.2f} ms "
        f"({steps.without / steps.with_lora:.2f}x base throughput)"
    )


@dataclasses.dataclass
class Workload:
    adapters: float  # median tokens/s of the runs with adapters
    base: float  # median tokens/s of the runs on the base model
    ratio: float  # median over the pairs of adapters / base


def whole_runs(llm, rounds: list[dict], loras, new_tokens: int) -> Workload:
    """Pairs of whole runs of len(loras) requests, on the adapters and on the base model
    (side_by_side.alternated_runs), a pair a round of prompt_sets."""
    runs = alternated_runs(llm, rounds, loras, new_tokens)
    ratios = [a / b for a, b in zip(runs["adapters"], runs["base"], strict=True)]
    return Workload(
        statistics.median(runs["adapters"]), statistics.median(runs["base"]),
        statistics.median(ratios),
    )  # fmt: skip


def rows_fetched(model, rows: int) -> str:
    """What brings the q,k,v adapter rows of the model's last batch with LoRA (a step of `rows`
    rows) into cache before their LoRA call in this build, as a line to print."""
    from loraplex.engine import fetch_placement as fp

    qkv = model.layers[0].qkv
    if not (qkv.fetches_rows(rows) or qkv.fetches_shrink_rows(rows)):
        return "q,k,v rows: nothing fetches them before their LoRA call in this build"
    steps = model._steps
    way = model.fetch_placement.chosen(steps.key, steps.ways)
    by = {
        fp.AHEAD: "all of them by the layer before's gate_up",
        fp.ALL: "all of them by the q,k,v projection itself",
        fp.SHRINKS: "their A rows alone by the q,k,v projection itself (B rows by the expands)",
    }[way]
    if len(steps.ways) == 1:
        return f"q,k,v rows fetched {by}: the one way here"
    return f"q,k,v rows fetched {by}: the engine's timed choice of {', '.join(steps.ways)}"


def still_timing(model) -> bool:
    """Whether the model's steps like its last batch's with LoRA still take the ways to fetch
    their rows in turn, to time them (engine/fetch_placement.py), not the one way kept."""
    steps = model._steps
    return model.fetch_placement.measuring(steps.key, steps.ways)


def adapter_bytes(engine) -> int:
    """Bytes of the weights of every resident adapter, at the pool's dtype."""
    return sum(resident.nbytes for resident in engine.adapters.resident.values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workload-rounds", type=int, default=8, help="pairs of whole q,v runs")
    parser.add_argument("--new-tokens", type=int, default=64, help="a request's, whole runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import loraplex.engine.adapters.lora_batch as lora_batch
    from loraplex import LLM
    from loraplex.engine.default_model import resolve_model
    from loraplex.engine.fetch_placement import ROUNDS as FETCH_ROUNDS

    probe = BandwidthProbe()
    bandwidth = probe.read(5)
    model_dir = resolve_model(args.model)
    n = args.sequences

    def engine_with(modules, count, tmp) -> tuple:
        llm = LLM(model=str(model_dir), dtype=args.dtype, max_num_batched_tokens=256)
        folder = Path(tmp) / str(len(modules))
        return llm, load_random_adapters(llm, modules, count, folder, args.rank)

    switch = LoRASwitch()
    results: dict[str, Steps] = {}
    workload: Workload | None = None  # the q,v whole runs, where --workload-rounds asks
    again: dict[str, Steps] = {}
    floors: dict[str, int] = {}
    fetched: dict[str, str] = {}  # how each engine's steps fetched their q,k,v rows
    with tempfile.TemporaryDirectory() as tmp:
        for name, modules in (("q,v", QV), ("all", ALL)):
            llm, loras = engine_with(modules, n, tmp)
            # the steps' prompts, then fresh ones for every whole run (q,v only)
            runs = args.workload_rounds if name == "q,v" else 0
            sets = prompt_sets(make_prompts(llm.tokenizer, n * (1 + 2 * runs), PROMPT_TOKENS), n)
            prompts = sets["warmup"]
            # warm up, and past the engine's first timing of where to fetch q,k,v rows
            decode_steps(llm.engine, prompts, loras, 3 * FETCH_ROUNDS + 3, switch)
            fetched[name] = rows_fetched(llm.engine.runner.model, n)
            floors[name] = adapter_bytes(llm.engine)
            runner = llm.engine.runner
            default, settings = lora_batch.GROUP_MIN_TOKENS, runner.settings
            strategies = [("gathered", "torch", n + 1), ("grouped", "torch", 1)]
            if settings.lora_backend == "native":
                strategies.insert(0, ("native", "native", default))
            try:
                for strategy, forced, min_run in strategies:
                    lora_batch.GROUP_MIN_TOKENS = min_run
                    runner.settings = dataclasses.replace(settings, lora_backend=forced)
                    for per in (1, 4):
                        key = f"{name} {strategy} {n // per}x{per}"
                        results[key] = decode_steps(
                            llm.engine, prompts, loras[: n // per], args.steps, switch, probe
                        )
            finally:
                lora_batch.GROUP_MIN_TOKENS, runner.settings = default, settings
            dtype, backend = llm.engine.config.dtype, settings.lora_backend
            config, torch_dtype = llm.engine.model_config, llm.engine.config.torch_dtype
            # the engine's own choice on 32 distinct adapters: native, or else the torch path,
            # which gathers runs of one token
            default_strategy = "native" if backend == "native" else "gathered"
            results[name] = results[f"{name} {default_strategy} {n}x1"]
            # the engine's own strategy once more, minutes later: a shared host's slow phases
            # last longer than one measurement, and two far apart show when one fell in one
            again[name] = decode_steps(llm.engine, prompts, loras, args.steps, switch, probe)
            if runs:
                workload = whole_runs(llm, sets["rounds"], loras, args.new_tokens)
            del llm

    print(
        f"model {model_dir.name}, {dtype}, {args.threads} threads; {n} sequences decoding "
        f"together; medians over {args.steps} steps with LoRA, each followed by the same batch "
        f"with LoRA skipped (base); rank {args.rank} adapters"
    )
    after = probe.read(5)
    print(
        f"read bandwidth of this box: {bandwidth / 1e9:.1f} GB/s before the steps, "
        f"{after / 1e9:.1f} GB/s after them; LoRA backend {backend}"
    )
    for name in ("q,v", "all"):
        r, size = results[name], floors[name]
        floor = size / bandwidth
        print(
            f"{n} adapters on {name:3s}: {step_against_base(r)}; adapter bytes per step "
            f"{size / 2**20:6.1f} MiB; floor {floor * 1e3:5.2f} ms; "
            f"extra over base {r.extra * 1e3:6.2f} ms = {r.extra / floor:.2f}x floor"
        )
        print(f"    {beside_pairs(r, size)}")
        print(f"    {base_reads(config, torch_dtype, r, size)}")
        r = again[name]
        print(f"    again after the strategies: {step_against_base(r)}; {beside_pairs(r, size)}")
        if name == "q,v" and workload is not None:
            print(
                f"    the whole workload ({n} requests x ({PROMPT_TOKENS} prompt + "
                f"{args.new_tokens} new tokens)): {workload.adapters:.1f} tok/s against base "
                f"{workload.base:.1f} tok/s, {workload.ratio:.3f}x base throughput (median of "
                f"{args.workload_rounds} pairs of runs)"
            )
    if backend == "native":
        for name, line in fetched.items():
            print(f"{name}: {line}")
    print(
        "targets: q,v throughput >= 0.95x base (the whole workload's, and here a decode step's "
        "too); all-module extra <= 1.25x floor"
    )
    print("strategies (adapters x tokens per adapter): step, base step, extra")
    for key, r in results.items():
        if key not in ("q,v", "all"):
            print(
                f"  {key:22s} {r.with_lora * 1e3:7.2f} ms {r.without * 1e3:7.2f} ms "
                f"{r.extra * 1e3:6.2f} ms"
            )


if __name__ == "__main__":
    main()
