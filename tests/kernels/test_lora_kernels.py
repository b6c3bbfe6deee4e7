"""Triton batched-LoRA kernels (run by the interpreter on CPU) and the CPU kernel against the
torch reference.

Tolerance: float32 storage 1e-4 absolute on outputs of magnitude ~1; bfloat16 storage compares
against the reference on the same bfloat16 inputs with 2e-2 (one bfloat16 rounding of the result).
"""

from __future__ import annotations

import ctypes
import platform
import random
import subprocess
import types

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.device import choose_attention_kernel, choose_lora_backend
from loraplex.engine.model import rms_norm
from loraplex.kernels import cpu_lora
from loraplex.kernels.lora import (
    Segments,
    lora_expand_reference,
    lora_expand_triton,
    lora_shrink_reference,
    lora_shrink_triton,
)
from tests.factories import cpu_flags

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def scattered_pool(
    rng: random.Random, ranks: list[int], in_features: int, out_features: int, dtype: torch.dtype
):
    """A pool in which each adapter's rows sit in pages scattered out of order."""
    page_numel = 4 * max(in_features, out_features)
    rows_needed = sum(ranks) * 2
    num_pages = rows_needed + 8
    pool = torch.randn(num_pages * page_numel).mul_(0.3).to(dtype)
    order = list(range(num_pages))
    rng.shuffle(order)  # pages handed out in a scrambled order, like a busy allocator
    free_rows = iter(
        (page * page_numel + i * max(in_features, out_features)) for page in order for i in range(2)
    )
    max_rank = max(ranks)
    a_offsets = torch.zeros(len(ranks), max_rank, dtype=torch.long)
    b_offsets = torch.zeros(len(ranks), max_rank, dtype=torch.long)
    for slot, rank in enumerate(ranks):
        for j in range(rank):
            a_offsets[slot, j] = next(free_rows)
            b_offsets[slot, j] = next(free_rows)
    return pool, a_offsets, b_offsets


def random_case(
    seed: int,
    ranks: list[int],
    segment_lens: list[int],
    base_rows: int,
    dtype: torch.dtype,
    in_features: int = 48,
    out_features: int = 40,
):
    rng = random.Random(seed)
    pool, a_offsets, b_offsets = scattered_pool(rng, ranks, in_features, out_features, dtype)
    segments, start = [], base_rows  # the first `base_rows` tokens use no adapter
    for length in segment_lens:
        segments.append((start, length, rng.randrange(len(ranks))))
        start += length
    num_tokens = start + base_rows  # base rows at both ends
    torch.manual_seed(seed)
    x = torch.randn(num_tokens, in_features).to(dtype)
    y = torch.randn(num_tokens, out_features).to(dtype)
    ranks_t = torch.tensor(ranks, dtype=torch.int32)
    scales = torch.tensor([rng.uniform(0.5, 2.0) for _ in ranks], dtype=torch.float32)
    return x, y, pool, a_offsets, b_offsets, ranks_t, scales, Segments.from_lists(segments, "cpu")


def run_both(x, y, pool, a_offsets, b_offsets, ranks, scales, segments):
    v_ref = lora_shrink_reference(x, pool, a_offsets, ranks, segments)
    v_tri = lora_shrink_triton(x, pool, a_offsets, ranks, segments)
    y_ref, y_tri = y.clone(), y.clone()
    lora_expand_reference(y_ref, v_ref, pool, b_offsets, ranks, scales, segments)
    lora_expand_triton(y_tri, v_tri, pool, b_offsets, ranks, scales, segments)
    return v_ref, v_tri, y_ref, y_tri


CASES = {
    "mixed ranks 1..64": ([1, 4, 16, 33, 64], [3, 5, 2, 1, 4], 2),
    "empty segments": ([8, 16], [0, 4, 0, 3], 1),
    "all base rows": ([8], [], 5),
    "single token": ([16], [1], 0),
    "one long segment": ([32], [37], 0),
    "runs of one rank": ([16, 16, 16], [3, 1, 5, 2, 1], 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_triton_matches_reference(case, dtype):
    ranks, lens, base_rows = CASES[case]
    x, y, pool, a_off, b_off, ranks_t, scales, segments = random_case(
        7, ranks, lens, base_rows, dtype
    )
    v_ref, v_tri, y_ref, y_tri = run_both(x, y, pool, a_off, b_off, ranks_t, scales, segments)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(v_tri, v_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(y_tri.float(), y_ref.float(), atol=tol * 4, rtol=tol)
    # rows outside every segment are untouched
    covered = torch.zeros(x.shape[0], dtype=torch.bool)
    for start, length in zip(segments.starts.tolist(), segments.lens.tolist(), strict=True):
        covered[start : start + length] = True
    assert torch.equal(y_tri[~covered], y[~covered])
    if covered.any():
        assert not torch.equal(y_tri[covered], y[covered])


def test_rank_zero_slot_leaves_its_tokens_alone():
    x, y, pool, a_off, b_off, _, scales, segments = random_case(3, [8, 8], [4, 4], 0, torch.float32)
    ranks = torch.tensor([0, 8], dtype=torch.int32)
    segments = Segments.from_lists([(0, 4, 0), (4, 4, 1)], "cpu")
    _, _, y_ref, y_tri = run_both(x, y, pool, a_off, b_off, ranks, scales, segments)
    assert torch.equal(y_tri[:4], y[:4])
    torch.testing.assert_close(y_tri, y_ref, atol=1e-4, rtol=1e-4)


def test_expand_into_a_column_slice_of_a_wider_output():
    x, _, pool, a_off, b_off, ranks, scales, segments = random_case(
        5, [16, 4], [3, 2], 1, torch.float32
    )
    fused = torch.randn(x.shape[0], 100)  # like the fused qkv output
    ref = fused.clone()
    v = lora_shrink_reference(x, pool, a_off, ranks, segments)
    lora_expand_triton(fused[:, 30:70], v, pool, b_off, ranks, scales, segments)
    lora_expand_reference(ref[:, 30:70], v, pool, b_off, ranks, scales, segments)
    torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(fused[:, :30], ref[:, :30]) and torch.equal(fused[:, 70:], ref[:, 70:])


# -- the CPU kernel (cpu/lora.c) ---------------------------------------------------------------


def native_kernel():
    kernel = cpu_lora.load()
    if kernel is None:
        pytest.fail("the CPU LoRA kernel did not build: a C compiler is part of the setup")
    return kernel


# Builds of the kernels besides the machine's own (-march=native): on x86-64, AVX-512 without
# AVX512-BF16 (x86-64-v4, where the CPU runs it), AVX2 only (x86-64-v3) and neither (x86-64, the
# plain C that other architectures compile too): the paths other CPUs take (the kernels choose
# by what the compiler targets); and on a CPU with AVX512-BF16, its other build (with or without
# BF16_BY_FMA: other_bf16_flags).
BUILDS = {
    "native": None,
    "other AVX512-BF16 build": "native",
    "AVX-512 without BF16": "x86-64-v4",
    "without AVX-512": "x86-64-v3",
    "plain x86-64": "x86-64",
}
# the builds whose float32 products are rounded before they are added (no FMA)
WITHOUT_FMA = {"plain x86-64"}
FMA_BUILD = ("-DBF16_BY_FMA", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


def other_bf16_flags() -> tuple[str, ...]:
    """The compiler's flags for the build this machine does not take, of the two for CPUs with
    AVX512-BF16: with vdpbf16ps where its own is the FMA build (cpu_lora.dpbf16_half_rate),
    else the FMA build (without AMX)."""
    if "-DBF16_BY_FMA" in cpu_lora.build_flags():
        return cpu_lora.FLAGS
    return cpu_lora.FLAGS + FMA_BUILD


def build_library(flags, folder) -> ctypes.CDLL:
    """The kernels' sources compiled with `flags` into a library in `folder`."""
    target = folder / "cpu_kernels.so"
    command = cpu_lora.compile_command(cpu_lora._compiler(), cpu_lora.SOURCES, target, flags)
    subprocess.run(command, check=True)
    return ctypes.CDLL(str(target))


def build_for(build: str, tmp_path_factory) -> ctypes.CDLL | None:
    """The kernels' library built for `build` (skips where this CPU cannot run it); None for the
    machine's own build, which cpu_lora loads."""
    march = BUILDS[build]
    if build == "native":
        return None
    if platform.machine() != "x86_64":
        pytest.skip("the other builds are x86-64 targets")
    if march == "x86-64-v4" and not {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    if march == "native" and "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16")
    flags = other_bf16_flags() if march == "native" else cpu_lora.FLAGS
    flags = [f if f != "-march=native" else f"-march={march}" for f in flags]
    return build_library(flags, tmp_path_factory.mktemp("kernels"))


def kernel_for(build: str, tmp_path_factory, kernel_class: type, load):
    """kernel_class on the library built for `build` (build_for), or on the machine's own build
    (`load`, cpu_lora's loader of that kernel), which must have built."""
    lib = build_for(build, tmp_path_factory)
    kernel = load() if lib is None else kernel_class(lib)
    if kernel is None:
        pytest.fail("the CPU kernels did not build: a C compiler is part of the setup")
    return kernel


@pytest.fixture(scope="module", params=list(BUILDS))
def kernel_build(request, tmp_path_factory):
    """The LoRA kernel as this machine builds it, and as the other x86-64 builds run it."""
    return kernel_for(request.param, tmp_path_factory, cpu_lora.CpuLoRAKernel, cpu_lora.load)


def apply_native(x, y, pool, a_offsets, b_offsets, ranks, scales, segments, kernel=None):
    """The kernel as the engine calls it: consecutive segments of one rank in one call, each
    segment a run whose tokens share its rows."""
    kernel = kernel or native_kernel()
    runs = [
        (start, length, slot, int(ranks[slot]))
        for start, length, slot in zip(
            segments.starts.tolist(), segments.lens.tolist(), segments.slots.tolist(), strict=True
        )
        if length and int(ranks[slot])
    ]
    while runs:
        rank = runs[0][3]
        group = [runs.pop(0)]
        while runs and runs[0][3] == rank and runs[0][0] == group[-1][0] + group[-1][1]:
            group.append(runs.pop(0))
        slots = [slot for _, _, slot, _ in group]
        rows = slice(group[0][0], group[-1][0] + group[-1][1])
        a_rows = torch.cat([a_offsets[slot, :rank] for slot in slots])
        b_rows = torch.cat([b_offsets[slot, :rank] for slot in slots])
        lengths = torch.tensor([length for _, length, _, _ in group])
        token_runs = torch.arange(len(group)).repeat_interleave(lengths)
        whole = cpu_lora.Outputs([(0, 0, y.shape[1])])  # one module onto all of y
        tables = (pool, a_rows, b_rows, token_runs, rank, scales[slots], whole)
        bind_one(kernel, *tables, rows.start, rows.stop)(x, y)


def bind_one(kernel, pool, a_rows, b_rows, slots, rank, scales, outputs, start, end):
    """kernel.bind_layers on one layer's tables (2-D; 1-D: one module): that layer's call."""
    a_layer, b_layer = (t[(None,) * (3 - t.dim())] for t in (a_rows, b_rows))
    tables = (pool, a_layer, b_layer, slots, rank, scales)
    return kernel.bind_layers(*tables, [outputs], start, end)[0]


def assert_native_matches_reference(case_tensors, kernel) -> None:
    """The native kernel's y against the torch reference's, to the dtype's tolerance, and the
    rows of no segment untouched."""
    x, y, pool, a_off, b_off, ranks, scales, segments = case_tensors
    y_ref, y_native = y.clone(), y.clone()
    v = lora_shrink_reference(x, pool, a_off, ranks, segments)
    lora_expand_reference(y_ref, v, pool, b_off, ranks, scales, segments)
    apply_native(x, y_native, pool, a_off, b_off, ranks, scales, segments, kernel)
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(y_native.float(), y_ref.float(), atol=tol * 4, rtol=tol)
    covered = torch.zeros(x.shape[0], dtype=torch.bool)
    for start, length in zip(segments.starts.tolist(), segments.lens.tolist(), strict=True):
        covered[start : start + length] = True
    assert torch.equal(y_native[~covered], y[~covered])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_native_cpu_kernel_matches_reference(case, dtype, kernel_build):
    ranks, lens, base_rows = CASES[case]
    # 600 inputs: one full 512-element chunk of the bfloat16 path and a ragged tail
    case_tensors = random_case(11, ranks, lens, base_rows, dtype, in_features=600, out_features=300)
    assert_native_matches_reference(case_tensors, kernel_build)


@pytest.mark.parametrize("ranks", [[16, 16], [8, 2, 16]], ids=["rank 16", "ranks 8, 2, 16"])
def test_long_prefill_spans_match_reference(ranks, kernel_build):
    """Spans of 16 tokens and more, inputs a multiple of 32 wide, ranks up to 16: on a CPU with
    AMX they go 16 tokens at a time through tiles (v as two bfloat16 halves; 300 output columns
    end in a partial tile), the rest of each span and elsewhere through the vector blocks.
    Either way the float32 reference's result to a rounding step, and the rows outside the spans
    untouched."""
    case_tensors = random_case(
        5, ranks, [40, 16, 70, 3, 33], 1, torch.bfloat16, in_features=576, out_features=300
    )
    assert_native_matches_reference(case_tensors, kernel_build)


def test_native_cpu_kernel_writes_a_column_slice_of_a_wider_output():
    x, _, pool, a_off, b_off, ranks, scales, segments = random_case(
        5, [16, 4], [3, 2], 1, torch.float32, in_features=130, out_features=260
    )
    fused = torch.randn(x.shape[0], 400)  # like q, k, v split from the fused qkv output
    ref = fused.clone()
    v = lora_shrink_reference(x, pool, a_off, ranks, segments)
    lora_expand_reference(ref[:, 70:330], v, pool, b_off, ranks, scales, segments)
    apply_native(x, fused[:, 70:330], pool, a_off, b_off, ranks, scales, segments)
    torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(fused[:, :70], ref[:, :70]) and torch.equal(fused[:, 330:], ref[:, 330:])


def three_modules_case(dtype: torch.dtype):
    """q, k and v as the engine calls them: one input, the modules' outputs side by side in one
    row, module rows picked from the [modules, runs * rank] tables; four runs, the last a
    prefill span of three tokens."""
    rng, rank, fin, widths = random.Random(9), 8, 600, (520, 40, 40)
    pools = [scattered_pool(rng, [rank, rank], fin, width, dtype) for width in widths]
    shift = [0, pools[0][0].numel(), pools[0][0].numel() + pools[1][0].numel()]
    pool = torch.cat([p for p, _, _ in pools])
    a_tables = [a + at for (_, a, _), at in zip(pools, shift, strict=True)]  # [adapters, rank]
    b_tables = [b + at for (_, _, b), at in zip(pools, shift, strict=True)]
    run_adapter = [1, 0, 1, 1]  # four runs; the last is a prefill span of three tokens
    slots = torch.tensor([0, 1, 2, 3, 3, 3])
    a_rows = torch.stack([t[run_adapter].flatten() for t in a_tables])  # [modules, runs * rank]
    b_rows = torch.stack([t[run_adapter].flatten() for t in b_tables])
    scales = torch.tensor([1.5, 0.5, 1.5, 1.5])
    torch.manual_seed(9)
    x = torch.randn(6, fin).to(dtype)
    y = torch.randn(6, sum(widths)).to(dtype)
    columns = [0, widths[0], widths[0] + widths[1]]
    tables = (pool, a_rows, b_rows, slots, rank, scales)
    return x, y, tables, widths, columns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_cpu_kernel_applies_several_modules_of_one_input_in_one_call(dtype, kernel_build):
    """q and v in one call; k left out (an adapter that does not target it) keeps its columns
    as they were."""
    x, y, tables, widths, columns = three_modules_case(dtype)
    pool, a_rows, b_rows, slots, rank, scales = tables
    fin = x.shape[1]
    got = y.clone()
    outputs = cpu_lora.Outputs([(0, columns[0], widths[0]), (2, columns[2], widths[2])])
    bind_one(kernel_build, pool, a_rows, b_rows, slots, rank, scales, outputs, 0, 6)(x, got)
    want = y.float().clone()
    for m in (0, 2):
        for t, s in enumerate(slots.tolist()):
            a = pool[a_rows[m, s * rank : (s + 1) * rank, None] + torch.arange(fin)].float()
            b = pool[b_rows[m, s * rank : (s + 1) * rank, None] + torch.arange(widths[m])].float()
            delta = scales[s] * (x[t].float() @ a.T) @ b
            want[t, columns[m] : columns[m] + widths[m]] += delta
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol * 4, rtol=tol)
    k_columns = slice(columns[1], columns[2])
    assert torch.equal(got[:, k_columns], y[:, k_columns])
    with pytest.raises(ValueError, match="do not fit"):
        bind_one(kernel_build, pool, a_rows, b_rows, slots, rank, scales, outputs, 0, 6)(
            x, got[:, :500]
        )
    with pytest.raises(ValueError, match="do not fit"):
        bind_one(kernel_build, pool, a_rows[:2], b_rows[:2], slots, rank, scales, outputs, 0, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("span", [1, 2, 3, 4, 5, 9, 13])
def test_tokens_on_one_adapters_rows_get_the_bits_each_gets_alone(dtype, span, kernel_build):
    """Tokens that read the same rows are taken a few at a time, each adapter row read once for
    them: a prefill span's (one run) and decode tokens of one adapter (a run each, on the same
    rows). Every token gets exactly the bits it gets in a call of its own, however the tokens
    fall between the threads and the blocks, before and after other runs; decode tokens on the
    same rows with another scale get their own scale. (Spans here are shorter than the 16
    tokens a thread takes through AMX tiles, whose sums run in another order:
    test_long_prefill_spans_match_reference.)"""
    x, y, (pool, a_rows, b_rows, _, rank, scales), widths, columns = three_modules_case(dtype)
    n = span + 2  # a decode token on run 0, the span on run 1, a decode token on run 2
    torch.manual_seed(span)
    x, y = torch.randn(n, x.shape[1]).to(dtype), torch.randn(n, sum(widths)).to(dtype)
    outputs = cpu_lora.Outputs([(m, columns[m], widths[m]) for m in range(3)])
    as_span = torch.tensor([0] + [1] * span + [2])
    runs = [0] + [1] * span + [2]  # each token's run of its own (decode tokens), on these rows

    def rows_of(table, runs):
        return table.view(3, -1, rank)[:, runs].flatten(1)

    def each_alone(token_scales):
        out = y.clone()
        for t, run in enumerate(runs):
            a, b, one = rows_of(a_rows, [run]), rows_of(b_rows, [run]), torch.tensor([0])
            bind_one(
                kernel_build, pool, a, b, one, rank, token_scales[t : t + 1], outputs, t, t + 1
            )(x, out)
        return out

    def as_runs(token_scales):
        out, each = y.clone(), torch.arange(n)
        a, b = rows_of(a_rows, runs), rows_of(b_rows, runs)
        bind_one(kernel_build, pool, a, b, each, rank, token_scales, outputs, 0, n)(x, out)
        return out

    got = y.clone()
    bind_one(kernel_build, pool, a_rows, b_rows, as_span, rank, scales, outputs, 0, n)(x, got)
    want = each_alone(scales[runs])
    assert not torch.equal(got, y)
    assert torch.equal(got, want)
    assert torch.equal(as_runs(scales[runs]), want)
    other = scales[runs] * torch.tensor([1.0, 2.0]).repeat(n)[:n]  # every other token's doubled
    assert torch.equal(as_runs(other), each_alone(other))


@pytest.fixture(scope="module")
def avx2_kernel(tmp_path_factory):
    """The LoRA kernel of the build without AVX-512, on a CPU whose own build has it."""
    if not {"avx512f", "avx512dq"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512: its own build is the AVX2 one")
    return cpu_lora.CpuLoRAKernel(build_for("without AVX-512", tmp_path_factory))


@pytest.mark.parametrize("fin, fout", [(7, 5), (23, 13), (40, 31), (600, 300)])
@pytest.mark.parametrize("ranks", [[16, 16], [1, 3, 5]], ids=["rank 16", "ranks 1, 3, 5"])
def test_float32_gives_the_same_bits_with_and_without_avx512(fin, fout, ranks, avx2_kernel):
    """The AVX-512 float32 call, four A rows and every B row at once, sums each output in the
    order of the AVX2 build (four A rows at once too, each summed as dot_f32_ahead does; B row
    after row): both give the same bits, at widths with and without vector tails, so float32's
    token identity to PEFT does not depend on the CPU's vectors."""
    x, y, pool, a_off, b_off, ranks_t, scales, segments = random_case(
        3, ranks, [1, 2, 1, 3], 1, torch.float32, in_features=fin, out_features=fout
    )
    got, want = y.clone(), y.clone()
    apply_native(x, got, pool, a_off, b_off, ranks_t, scales, segments)
    apply_native(x, want, pool, a_off, b_off, ranks_t, scales, segments, avx2_kernel)
    assert not torch.equal(got, y)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_call_bound_to_some_rows_changes_only_them_every_time_it_is_made(dtype, kernel_build):
    """The engine binds a call once per batch and layer and makes it every step: bound to rows
    2..6 of x and y (their slots), it changes exactly those rows, bit for bit as a call bound to
    x[2:] and y[2:] whole does, each time; a call that does not fit is refused."""
    x, y, (pool, a_rows, b_rows, slots, rank, scales), widths, columns = three_modules_case(dtype)
    outputs = cpu_lora.Outputs([(0, columns[0], widths[0]), (2, columns[2], widths[2])])
    runs = a_rows[:, rank:]  # rows 2..6 are runs 1..3 of the tables
    bound = bind_one(
        kernel_build, pool, runs, b_rows[:, rank:], slots[2:] - 1, rank, scales[1:], outputs, 2, 6
    )
    want, got = y.clone(), y.clone()
    for _ in range(2):
        bind_one(kernel_build, pool, a_rows, b_rows, slots[2:], rank, scales, outputs, 0, 4)(
            x[2:], want[2:]
        )
        bound(x, got)
        assert torch.equal(got, want) and not torch.equal(got[2:], y[2:])
    assert torch.equal(got[:2], y[:2])
    with pytest.raises(ValueError, match="bound rows"):
        bound(x[:5], got)
    with pytest.raises(ValueError, match="dtype"):
        bound(x.double(), got)
    with pytest.raises(ValueError, match="one slot a row"):
        bind_one(kernel_build, pool, runs, b_rows[:, rank:], slots[3:], rank, scales, outputs, 2, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_calls_bound_for_every_layer_at_once_are_each_layers_call(dtype):
    """The engine binds a batch's calls for all layers at once (bind_layers): layer i's call
    gives the bits the call bound to layer i's tables alone gives, a layer whose adapters change
    none of the modules gets no call, and tables the outputs do not fit are refused."""
    x, y, (pool, a_rows, b_rows, slots, rank, scales), widths, columns = three_modules_case(dtype)
    kernel = native_kernel()
    # three layers: the tables as they are, their runs in another order, then no call at all
    order = torch.tensor([2, 0, 3, 1])
    other_a, other_b = (t.view(3, 4, rank)[:, order].reshape(3, -1) for t in (a_rows, b_rows))
    # each layer's tables inside a wider one, so that a layer's stride is not its table's size
    layers_a, layers_b = (torch.zeros(3, 5, t.shape[1], dtype=t.dtype) for t in (a_rows, b_rows))
    layers_a[:, :3] = torch.stack([a_rows, other_a, a_rows])
    layers_b[:, :3] = torch.stack([b_rows, other_b, b_rows])
    layers_a, layers_b = layers_a[:, :3], layers_b[:, :3]
    outputs = cpu_lora.Outputs([(0, columns[0], widths[0]), (2, columns[2], widths[2])])
    tables = (pool, layers_a, layers_b, slots, rank, scales)
    calls = kernel.bind_layers(*tables, [outputs, outputs, None], 0, 6)
    assert calls[2] is None
    for call, a, b in zip(calls[:2], (a_rows, other_a), (b_rows, other_b), strict=True):
        want, got = y.clone(), y.clone()
        bind_one(kernel, pool, a, b, slots, rank, scales, outputs, 0, 6)(x, want)
        call(x, got)
        assert torch.equal(got, want) and not torch.equal(got, y)
    wide = cpu_lora.Outputs([(3, 0, widths[0])])  # a fourth module row: not in the tables
    with pytest.raises(ValueError, match="do not fit"):
        kernel.bind_layers(*tables, [outputs, wide, None], 0, 6)
    with pytest.raises(ValueError, match="differ in layout"):
        kernel.bind_layers(pool, layers_a, layers_b[:, :2], slots, rank, scales, [None] * 3, 0, 6)


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "false"])
def test_without_a_working_compiler_the_cpu_falls_back_to_the_torch_path(
    compiler, monkeypatch, tmp_path
):
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("PATH", "/nonexistent" if compiler.startswith("/") else "/usr/bin:/bin")
    monkeypatch.setenv("LORAPLEX_KERNEL_CACHE", str(tmp_path))
    caches = (cpu_lora.library, cpu_lora.load, cpu_lora.load_attention)
    for cached in caches:
        cached.cache_clear()
    try:
        assert cpu_lora.load() is None and cpu_lora.load_attention() is None
        assert choose_lora_backend("cpu", None) == "torch"
        assert choose_attention_kernel("cpu", torch.float32) is None  # torch's attention
    finally:
        monkeypatch.undo()
        for cached in caches:
            cached.cache_clear()
    assert choose_lora_backend("cpu", None) == "native"  # back with the real compiler
    assert choose_attention_kernel("cpu", torch.bfloat16) is not None


# -- decode attention in place (cpu/attention.c) ----------------------------------------------


@pytest.fixture(scope="module", params=list(BUILDS))
def attention_build(request, tmp_path_factory):
    """The attention kernel as this machine builds it, and as the other x86-64 builds run it."""
    kernel_class, load = cpu_lora.CpuAttentionKernel, cpu_lora.load_attention
    return kernel_for(request.param, tmp_path_factory, kernel_class, load)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,sharpness",
    [
        (9, 3, 64, 1.0),
        (9, 3, 64, 12.0),
        (10, 2, 64, 1.0),
        (4, 4, 32, 1.0),
        (8, 1, 80, 1.0),
        (4, 2, 128, 4.0),
    ],
)
def test_decode_attention_in_place_matches_torch(
    request, attention_build, dtype, heads, kv_heads, dim, sharpness
):
    """Contexts of 1 token, a page and a token either side of a page, long ones; pages scattered
    through the pool; grouped-query heads; heads 64 wide (the AVX2 float32 path: one or two
    blocks of 64) and not; softmaxes flat and sharp (scores spread over tens, where the
    vectorized exp is pressed hardest); against torch's attention on the gathered keys."""
    generator = torch.Generator().manual_seed(heads * dim)
    num_pages, page_size, layers = 64, 16, 3
    # layer 1 of a pool holding 3 layers a page, as the engine's KV cache views it
    pool = torch.randn(num_pages, layers, page_size, 2, kv_heads, dim, generator=generator)
    kv = pool.to(dtype)[:, 1]
    lens = torch.tensor([1, 15, 16, 17, 100, 37, 250])
    max_pages = -(-int(lens.max()) // page_size)
    order = torch.randperm(num_pages, generator=generator)
    tables = torch.stack([order[i : i + max_pages] for i in range(len(lens))]).contiguous()
    q = (torch.randn(len(lens), heads, dim, generator=generator) * sharpness).to(dtype)
    scale = dim**-0.5

    out = attention_build.decode(q, kv, tables, lens, scale)
    without_fma = request.node.callspec.params["attention_build"] in WITHOUT_FMA

    flat = kv.contiguous().view(-1, 2, kv_heads, dim)
    for i, length in enumerate(lens.tolist()):
        slots = (tables[i, :, None] * page_size + torch.arange(page_size)).flatten()[:length]
        keys, values = (
            flat[slots, 0].float().transpose(0, 1),
            flat[slots, 1].float().transpose(0, 1),
        )
        ref = F.scaled_dot_product_attention(
            q[i].float().unsqueeze(1), keys, values, scale=scale, enable_gqa=True
        ).squeeze(1)
        if dtype == torch.float32:
            torch.testing.assert_close(out[i], ref, atol=5e-6 if without_fma else 2e-6, rtol=1e-5)
        else:  # float32 inside, one bfloat16 rounding of the result
            torch.testing.assert_close(out[i].float(), ref, atol=1e-2, rtol=1e-2)
    # a batch of two sequences, which the kernel splits by kv head to keep both cores busy
    few = attention_build.decode(q[4:6], kv, tables[4:6], lens[4:6], scale)
    assert torch.equal(few, out[4:6])


@pytest.mark.parametrize("rows", [33, 300], ids=["one thread", "all threads"])
@pytest.mark.parametrize("dim", [576, 64, 1000])
def test_native_rms_norm_is_bit_identical_to_torch_in_bfloat16(dim, rows):
    """The engine uses it in bfloat16 only, where it must round exactly as the torch ops do."""
    kernel = cpu_lora.load_ops()
    generator = torch.Generator().manual_seed(dim)
    x = (torch.randn(rows, dim, generator=generator) * 3).to(torch.bfloat16)
    weight = torch.randn(dim, generator=generator).to(torch.bfloat16)
    assert torch.equal(kernel.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("rows", [33, 300], ids=["one thread", "all threads"])
def test_native_residual_add_and_norm_give_the_add_and_the_norm_apart(rows):
    """The residual add, in place: torch's bits; the norm after it: the native norm's bits (which
    sums a row in another order than torch's mean, so may differ from it by a rounding step)."""
    kernel = cpu_lora.load_ops()
    generator = torch.Generator().manual_seed(rows)
    hidden = (torch.randn(rows, 576, generator=generator) * 3).to(torch.bfloat16)
    delta = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
    weight = torch.randn(576, generator=generator).to(torch.bfloat16)
    want_hidden = hidden + delta
    got = kernel.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, want_hidden)
    assert torch.equal(got, kernel.rms_norm(want_hidden, weight, 1e-5))
    want = rms_norm(want_hidden, weight, 1e-5).float()
    torch.testing.assert_close(got.float(), want, atol=0, rtol=2**-6)  # two roundings


@pytest.mark.parametrize("inter", [1536, 40, 7])
def test_native_swiglu_product_is_bit_identical_to_torch_in_bfloat16(inter):
    """silu(gate) * up from a fused [gate | up] row, rows wider than the row (a slice), across
    the range where silu bends (and past exp's clamps); a vector's tail when inter is not a
    multiple of sixteen."""
    kernel = cpu_lora.load_ops()
    generator = torch.Generator().manual_seed(inter)
    wide = torch.randn(300, 2 * inter + 8, generator=generator) * 6
    wide[0, :inter] = torch.linspace(-120, 120, inter)
    gate_up = wide.to(torch.bfloat16)[:, 8:]
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(kernel.silu_mul(gate_up), F.silu(gate) * up)
    assert torch.equal(kernel.silu_mul(gate_up[:5]), F.silu(gate[:5]) * up[:5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128), (2, 1, 80)])
def test_native_rope_and_kv_write_are_bit_identical_to_torch(
    ops_build, heads, kv_heads, dim, dtype
):
    """The engine rotates q and k and writes k and v to their cache slots in one native call:
    the same bits as the torch ops, and nothing else of the cache touched."""
    from loraplex.engine.attention import write_kv
    from loraplex.engine.config import RopeConfig
    from loraplex.engine.rope import RotaryEmbedding

    kernel = ops_build
    generator = torch.Generator().manual_seed(dim)
    n, max_positions, page_size = 21, 300, 4
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), dim, max_positions, dtype, "cpu")
    qkv = torch.randn(n, 40 + (heads + 2 * kv_heads) * dim, generator=generator) * 4
    qkv = qkv.to(dtype)[:, 40:]  # a row stride wider than the row, as a slice gives
    positions = torch.randperm(max_positions, generator=generator)[:n]
    pages = torch.randperm(12, generator=generator)[: -(-n // page_size)]
    slot_pages = pages.repeat_interleave(page_size)[:n]
    slot_offsets = torch.arange(n) % page_size
    # a layer's view of a pool: pages two layers apart
    pool = torch.randn(12, 2, page_size, 2, kv_heads, dim, generator=generator).to(dtype)
    before = pool.clone()
    got_cache, want_cache = pool[:, 1], before[:, 1].clone()
    got_q = kernel.rotate_and_write(
        qkv, heads, kv_heads, rope.cos, rope.sin, positions, got_cache, slot_pages, slot_offsets
    )
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    cos, sin = rope.lookup(positions)
    want_q = rope.rotate(q.reshape(n, heads, dim), cos, sin)
    k = rope.rotate(k.reshape(n, kv_heads, dim), cos, sin)
    slots = types.SimpleNamespace(slot_pages=slot_pages, slot_offsets=slot_offsets)
    write_kv(want_cache, k, v.reshape(n, kv_heads, dim), slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(pool[:, 0], before[:, 0])  # the other layer
    with pytest.raises(ValueError, match="past the rotary table"):
        kernel.rotate_and_write(
            qkv, heads, kv_heads, rope.cos[:10], rope.sin[:10], positions, got_cache,
            slot_pages, slot_offsets,
        )  # fmt: skip


@pytest.fixture(scope="module", params=list(BUILDS))
def ops_build(request, tmp_path_factory):
    """The per-layer ops as this machine builds them, and as the other x86-64 builds run them."""
    return kernel_for(request.param, tmp_path_factory, cpu_lora.CpuOps, cpu_lora.load_ops)


@pytest.mark.parametrize("rows", [33, 300], ids=["one thread", "all threads"])
@pytest.mark.parametrize("dim", [576, 64, 1000])
def test_native_float32_norms_are_torch_within_a_few_units_in_the_last_place(ops_build, dim, rows):
    """A float32 model's RMSNorm, alone and after the residual add (in place, torch's bits):
    the same ops as torch's but for the order of the row's sum of squares (2e-6 relative: about
    sixteen units in the last place, where a sum of 1,000 squares in another order moves its
    scale by a few)."""
    generator = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim, generator=generator) * 3
    weight = torch.randn(dim, generator=generator)
    got = ops_build.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, rms_norm(x, weight, 1e-5), rtol=2e-6, atol=0)
    delta = torch.randn(rows, dim, generator=generator)
    hidden, want_hidden = x.clone(), x + delta
    got = ops_build.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, want_hidden)
    assert torch.equal(got, ops_build.rms_norm(want_hidden, weight, 1e-5))


@pytest.mark.parametrize("inter", [1536, 40, 7])
def test_native_float32_swiglu_product_is_torch_within_a_few_units(ops_build, inter):
    """silu(gate) * up from a fused [gate | up] float32 row (a slice of wider rows), across the
    range where silu bends and past exp's clamps; a vector's tail where inter is not a multiple
    of sixteen."""
    generator = torch.Generator().manual_seed(inter)
    wide = torch.randn(300, 2 * inter + 8, generator=generator) * 6
    wide[0, :inter] = torch.linspace(-120, 120, inter)
    gate_up = wide[:, 8:]
    gate, up = gate_up.chunk(2, dim=-1)
    got, want = ops_build.silu_mul(gate_up), F.silu(gate) * up
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)
    assert torch.equal(ops_build.silu_mul(gate_up[:5]), got[:5])


# -- greedy argmax (cpu/ops.c) ----------------------------------------------------------------


@pytest.fixture(scope="module", params=list(BUILDS))
def argmax_build(request, tmp_path_factory):
    """The argmax as this machine builds it, and as the other x86-64 builds run it."""
    return kernel_for(request.param, tmp_path_factory, cpu_lora.CpuArgmax, cpu_lora.load_argmax)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 31, 32, 33, 100, 49157])
def test_native_argmax_picks_the_token_torch_max_picks(argmax_build, vocab):
    """Greedy decoding's token: the first of equal best logits (ties within a vector's lanes,
    across lanes and in the tail), -inf masks, a row's first NaN, rows of a wider tensor."""
    generator = torch.Generator().manual_seed(vocab)
    rows = torch.randn(12, vocab + 3, generator=generator)[:, 3:]  # row stride wider than a row
    rows[1] = 0.5  # all equal: the first
    rows[2, vocab // 2 :] = 9.0  # ties in the tail half
    rows[3] = float("-inf")  # masked out entirely
    rows[4, -1] = float("inf")
    rows[5, vocab // 3] = float("nan")
    rows[6, :] = torch.randint(0, 3, (vocab,), generator=generator).float()  # many ties
    rows[7, -1], rows[7, 0] = 100.0, 100.0
    rows[8, vocab // 2 :] = float("nan")
    rows[9] = -0.0
    rows[9, -1] = 0.0
    want = rows.max(dim=-1).indices
    assert torch.equal(argmax_build(rows), want), (argmax_build(rows), want)
    # one row, and rows torch keeps (another dtype)
    assert torch.equal(argmax_build(rows[:1]), want[:1])
    assert torch.equal(argmax_build(rows.double()), want)
    # bfloat16 logits, read as they are: the pick over their float32 copy
    rounded = rows.bfloat16()
    assert torch.equal(argmax_build(rounded), rounded.float().max(dim=-1).indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 17, 33, 49157])
def test_greedy_pass_flags_the_rows_that_are_not_finite(argmax_build, dtype, vocab):
    """A greedy step's one pass over its logits: each row's pick, as torch.max picks it from the
    float32 logits, and whether every logit of the row is finite (a row holding an infinity or a
    NaN anywhere, first, last or in the vector part, fails its sequence; the others sample)."""
    generator = torch.Generator().manual_seed(vocab)
    rows = (torch.randn(10, vocab + 5, generator=generator) * 8).to(dtype)[:, 5:]  # wider stride
    rows[1, -1] = float("inf")
    rows[2, 0] = float("-inf")
    rows[3, vocab // 2] = float("nan")
    rows[4, vocab // 3] = float("-inf")
    rows[5] = float("-inf")
    rows[6, -1] = float("nan")
    rows[7, vocab // 2] = float("inf")
    picks, finite = argmax_build.greedy(rows)
    assert torch.equal(picks, rows.float().max(dim=-1).indices)
    assert finite.tolist() == torch.isfinite(rows.float()).all(dim=-1).tolist()
    assert finite.tolist() == [True] + [False] * 7 + [True, True]
    assert argmax_build.greedy(rows.double()) is None  # a dtype it does not take
