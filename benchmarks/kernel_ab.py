"""Two builds of the CPU kernels compared in one process, decode step by decode step.

    python benchmarks/kernel_ab.py --against REV [--modules qv|all] [--dtype bfloat16|float32]
                                   [--fetch timed|ahead|all|shrinks] [--adapters N]

Builds the kernels' C sources as they are at git revision REV into a library of its own beside
the working tree's, then runs 32 sequences decoding together on 32 distinct rank-16 adapters
(SmolLM2, 64-token prompts), or on N adapters each shared by 32 / N of them. Each round takes a
base-only step and one step with each build's LoRA calls (the native projection's fused call,
and every LoRA call made apart), the two builds' order alternating, and it prints the medians of
each build's extra over base and the median of the paired differences. Only the LoRA calls
change between the builds; the projections, attention and the rest are the working tree's in
both. Where the build fetches a layer's q,k,v rows, the model settles during the warm-up, by
timing steps, where it fetches them (fetch_placement.py), and two runs may settle differently:
what fetches them is printed, and --fetch fixes the place.

On a shared host whose speed drifts from minute to minute (a 2-core Zen 5 VM read 46 to 80
GB/s within the hour), whole benchmark runs of one build after the other differ by more than
the changes they are meant to measure; steps alternated in one process do not.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from engine_throughput import make_prompts
from lora_floor import ALL, QV, LoRASwitch, add_decoding, load_random_adapters, rows_fetched

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "loraplex/kernels/cpu"


def build_at(
    revision: str | None,
    folder: Path,
    march: str = "native",
    defines: tuple[str, ...] = (),
    undefines: tuple[str, ...] = (),
) -> ctypes.CDLL:
    """The kernels' library built from their sources at `revision` (None: the working tree's),
    with this machine's flags, or for the x86-64 target `march` in place of -march=native, and
    the macros `defines` defined, those of `undefines` left out of this machine's flags."""
    from loraplex.kernels import cpu_lora

    if revision is None:
        listing = sorted(source.name for source in (ROOT / KERNELS).glob("*.[ch]"))
    else:
        listing = subprocess.run(
            ["git", "ls-tree", "--name-only", f"{revision}:{KERNELS}"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
    for name in listing:
        (folder / name).write_bytes(_source(revision, name))
    target = folder / "kernels.so"
    sources = sorted(folder / name for name in listing if name.endswith(".c"))
    left_out = {f"-D{name}" for name in undefines}
    flags = [f"-D{name}" for name in defines] + [
        f"-march={march}" if flag == "-march=native" else flag
        for flag in cpu_lora.build_flags()
        if flag not in left_out
    ]
    subprocess.run(
        cpu_lora.compile_command(cpu_lora._compiler(), sources, target, flags), check=True
    )
    return ctypes.CDLL(str(target))


def alternate(
    rounds: int,
    runs: dict[str, Callable[[], object]],
    before: Callable[[], object] | dict[str, Callable[[], object]] | None = None,
) -> dict[str, list[float]]:
    """The seconds of each of `runs` (name -> function), called once a round, their order
    alternating round by round; `before` (untimed) ahead of each call, or, as a dict, ahead of
    each run's own."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            first = before.get(name) if isinstance(before, dict) else before
            if first is not None:
                first()
            started = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - started)
    return times


def compile_scratch(folder: Path, name: str, source: str) -> ctypes.CDLL:
    """A benchmark's own C `source` built as the kernels are (cpu_lora.FLAGS: -march=native,
    OpenMP) into folder/name.so, loaded."""
    from loraplex.kernels import cpu_lora

    path, target = folder / f"{name}.c", folder / f"{name}.so"
    path.write_text(source)
    command = cpu_lora.compile_command(cpu_lora._compiler(), [path], target, cpu_lora.FLAGS)
    subprocess.run(command, check=True)
    return ctypes.CDLL(str(target))


def against(ours: list[float], theirs: list[float], revision: str, unit: str, per: str) -> str:
    """The working tree's times against `revision`'s, paired round by round, as a line: the
    median of the differences in `unit` (ms or us) a `per` (step, call) and of the ratios."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    paired = statistics.median(a - b for a, b in zip(ours, theirs, strict=True))
    ratio = statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
    return (
        f"working tree - {revision}: {paired * scale:+.3f} {unit} a {per} (median of the pairs), "
        f"{ratio:.3f}x"
    )


def other_label(revision: str, defines: list[str], undefines: list[str] = ()) -> str:
    """How the output names the build of `revision` with the macros `defines`, without
    `undefines`."""
    return " ".join([revision, *(f"-D{name}" for name in defines)] + [f"-U{u}" for u in undefines])


def build_against(args, folder: Path) -> tuple[ctypes.CDLL, str]:
    """The build of `--against REV` with its `--define` and `--undefine` macros (add_macro_options)
    and how the output names it."""
    library = build_at(
        args.against, folder, defines=tuple(args.define), undefines=tuple(args.undefine)
    )
    return library, other_label(args.against, args.define, args.undefine)


def add_macro_options(parser) -> None:
    """--define and --undefine, for the other revision's build (build_at)."""
    parser.add_argument("--define", action="append", default=[], help="a macro for REV's build")
    parser.add_argument(
        "--undefine", action="append", default=[],
        help="a macro of this machine's flags (cpu_lora.build_flags) left out of REV's build",
    )  # fmt: skip


def _source(revision: str | None, name: str) -> bytes:
    """A kernel source file as it is at `revision` (None: in the working tree)."""
    if revision is None:
        return (ROOT / KERNELS / name).read_bytes()
    return subprocess.run(
        ["git", "show", f"{revision}:{KERNELS}/{name}"], cwd=ROOT, capture_output=True, check=True
    ).stdout


class LoRACalls:
    """One build's LoRA functions, put in place of the engine's for a step: the function of
    every bound LoRA call, and the native projection's fused call (where the engine has one)."""

    def __init__(self, lora, fused: dict | None) -> None:
        self.lora, self.fused = lora, fused

    @classmethod
    def of_library(cls, lib: ctypes.CDLL, dtype: torch.dtype) -> LoRACalls:
        from loraplex.kernels import cpu_lora

        suffix = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
        lora = getattr(lib, f"lora_apply_{suffix}")
        lora.argtypes, lora.restype = cpu_lora._ARGTYPES, ctypes.c_int
        linear, fused = _native_linear(dtype), None
        if linear is not None and linear._fused:
            function = getattr(lib, f"linear_lora_{suffix}")
            function.argtypes = linear._fused[dtype].argtypes
            function.restype = ctypes.c_int
            fused = {dtype: function}
        return cls(lora, fused)

    @classmethod
    def of_engine(cls, model) -> LoRACalls:
        """The engine's own functions (the working tree's build)."""

        bound = _bound_calls(model)
        linear = _native_linear(model.embed.dtype)
        fused = dict(linear._fused) if linear is not None and linear._fused else None
        return cls(bound[0]._function if bound else None, fused)

    def use(self, model) -> None:
        for call in _bound_calls(model):
            call._function = self.lora
        if self.fused is not None:
            _native_linear(next(iter(self.fused)))._fused = self.fused

    def use_for(self, dtype: torch.dtype) -> None:
        """In the engine's place for the calls bound from now on (batches of new adapters)."""
        from loraplex.kernels import cpu_lora

        cpu_lora.load()._functions[dtype] = self.lora
        if self.fused is not None:
            _native_linear(dtype)._fused = self.fused


def _native_linear(dtype: torch.dtype):
    """The engine's native projection of `dtype` (cpu_lora.CpuLinearBf16 or CpuLinearF32)."""
    from loraplex.kernels import cpu_lora

    return cpu_lora.load_linear() if dtype == torch.bfloat16 else cpu_lora.load_linear_f32()


def _bound_calls(model) -> list:
    """Every native LoRA call of the batch the model last ran (its per-layer steps)."""
    from loraplex.kernels import cpu_lora

    calls = []
    steps = model._steps
    for layer in steps.layers_for(steps.contents[0]) if steps else []:
        for step in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if step.plan is not None:
                calls += [c for c in step.plan.calls if isinstance(c, cpu_lora.BoundLoRA)]
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", required=True, help="git revision of the other build")
    parser.add_argument("--modules", choices=("qv", "all"), default="qv")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument(
        "--adapters", type=int, help="distinct adapters, shared in turn (default: one a sequence)"
    )
    parser.add_argument(
        "--fetch", choices=("timed", "ahead", "all", "shrinks"), default="timed",
        help="how a layer's q,k,v rows are fetched (where the build fetches): as the model "
        "times it (fetch_placement.py), by the gate_up before, or by the q,k,v projection, all "
        "of them or (float32) their A rows alone",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(2)

    from loraplex import LLM
    from loraplex.engine.default_model import resolve_model
    from loraplex.engine.fetch_placement import ROUNDS

    n, modules = args.sequences, QV if args.modules == "qv" else ALL
    count = args.adapters or n
    with tempfile.TemporaryDirectory() as tmp:
        other = build_at(args.against, Path(tmp))
        llm = LLM(model=str(resolve_model("default")), dtype=args.dtype)
        engine, dtype = llm.engine, getattr(torch, args.dtype)
        loras = load_random_adapters(llm, modules, count, Path(tmp))
        switch = LoRASwitch()
        # past the prefills and the model's first timing of how rows are fetched (3 ways at most)
        warmup = 3 * ROUNDS + 20
        add_decoding(
            engine, make_prompts(llm.tokenizer, n, 64), loras, warmup + 3 * args.rounds + 8
        )
        for _ in range(warmup):
            engine.step()
        model = engine.runner.model
        model.fuse_layers = False  # the LoRA calls from Python, where the builds swap
        if args.fetch != "timed":
            model.fetch_placement.fix(args.fetch)
        builds = {
            "working tree": LoRACalls.of_engine(model),
            args.against: LoRACalls.of_library(other, dtype),
        }
        names = list(builds)
        times: dict[str, list[float]] = {name: [] for name in ["base", *names]}
        for i in range(args.rounds):
            for name in ["base", *(names if i % 2 == 0 else names[::-1])]:
                switch.on = name != "base"
                if name != "base":
                    builds[name].use(model)
                started = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - started)
        builds["working tree"].use(model)

    median = statistics.median
    base = times["base"]
    print(
        f"{args.dtype}, {n} sequences on {count} adapters ({args.modules}), {args.rounds} rounds; "
        f"base step median {median(base) * 1e3:.2f} ms; {rows_fetched(model, n)}"
    )
    for name in names:
        extra = median(a - b for a, b in zip(times[name], base, strict=True))
        print(f"  extra over base, {name:14s} {extra * 1e3:7.3f} ms (median of the pairs)")
    print(f"  {against(times['working tree'], times[args.against], args.against, 'ms', 'step')}")


if __name__ == "__main__":
    main()
