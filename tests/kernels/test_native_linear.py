"""The native projections. bfloat16 (CPUs with AMX or AVX512-BF16; each of its kernels runs where
the CPU has it, and the vdpbf16ps and FMA builds both run on every CPU with AVX512-BF16): the
product rounded once, whatever the shape (with AMX, input widths that are not a multiple of 32
end in a vdpbf16ps tail); decode-sized batches take it and larger ones oneDNN (or it too, with
AMX and in the FMA build: rows 32 at a time), with the same results to a rounding step; and the
adapter rows a fetching projection is asked to bring into cache are exactly those the LoRA call
after it reads. float32 (the engine's on AMD's CPUs and Intel's with AVX-512, tested on any CPU
with AVX-512 or AVX2 and FMA, and where the machine's build has AVX-512, with its other AVX-512
tile and in the AVX2 build too): the product to float32's precision, and with its LoRA call in
the same native call, the bits of the two apart; where it takes batches of every size (Zen 2),
prompt chunks too, from its one copy of W, and an engine so matches transformers and PEFT."""

from __future__ import annotations

import ctypes

import pytest
import torch

from loraplex import LoRARequest, SamplingParams
from loraplex.engine import device
from loraplex.engine.adapters.lora_batch import TorchLoRA
from loraplex.engine.workspace import Workspace
from loraplex.kernels import cpu_lora
from tests.engine.test_adapters import peft_reference
from tests.engine.test_fidelity import CHUNK, mixed_prompts
from tests.factories import cpu_flags, make_llm
from tests.kernels.test_lora_kernels import bind_one, build_for, build_library, other_bf16_flags
from tests.oracle import assert_matches_reference

bf16_native = pytest.mark.skipif(
    device.choose_linear(torch.zeros(2, 2, dtype=torch.bfloat16)) is None,
    reason="the native bfloat16 projection does not run on this CPU",
)
STEP = 2.0**-7  # a bfloat16 rounding step, relative


@pytest.fixture(scope="module")
def other_build(tmp_path_factory) -> tuple[cpu_lora.CpuLinearBf16, cpu_lora.CpuLoRAKernel]:
    """The projection's other build for this CPU (other_bf16_flags), and its LoRA kernel."""
    fma = "-DBF16_BY_FMA" in cpu_lora.build_flags()
    lib = build_library(other_bf16_flags(), tmp_path_factory.mktemp("kernels"))
    kernel = cpu_lora.CpuLinearBf16(lib)
    assert kernel.any_rows != fma and kernel.supports(torch.bfloat16)
    return kernel, cpu_lora.CpuLoRAKernel(lib)


@pytest.fixture(params=["machine's build", "other build"])
def build(request, monkeypatch):
    """Each test of a product twice: with the machine's build of the projection, and with the
    other (Linear takes it), whose LoRA calls made apart are its own too (the two builds' shrinks
    round differently: vdpbf16ps against two FMAs)."""
    if request.param == "other build":
        kernel, lora = request.getfixturevalue("other_build")
        monkeypatch.setattr(device, "choose_linear", lambda weight: kernel)
        monkeypatch.setattr(cpu_lora, "load", lambda: lora)
    return request.param


TALL_TILE = "-DF32_TALL_TILE"


def other_tile_flags() -> tuple[str, ...]:
    """This machine's flags with the other AVX-512 float32 tile: 8 rows by 48 columns where it
    takes 4 by 96 (AMD's), 4 by 96 where it takes 8 by 48 (Intel's Xeons)."""
    flags = cpu_lora.build_flags()
    return tuple(f for f in flags if f != TALL_TILE) if TALL_TILE in flags else (*flags, TALL_TILE)


@pytest.fixture(scope="module", params=["native", "other AVX-512 tile", "without AVX-512"])
def f32_library(request, tmp_path_factory) -> ctypes.CDLL:
    """The library with the float32 projection: the machine's build, and where that has
    AVX-512, the same build with the other AVX-512 tile and the AVX2 build (its tile)."""
    if request.param != "native" and "avx512f" not in cpu_flags():
        pytest.skip("the machine's own build is the AVX2 one")
    if request.param == "other AVX-512 tile":
        lib = build_library(other_tile_flags(), tmp_path_factory.mktemp("kernels"))
    else:
        lib = build_for(request.param, tmp_path_factory) or cpu_lora.library()
    if lib is None or not lib.linear_native_f32():
        pytest.skip("the library has no float32 projection on this CPU (no AVX2 and FMA)")
    return lib


@pytest.fixture
def f32_kernel(monkeypatch, f32_library) -> cpu_lora.CpuLinearF32:
    """The float32 projection wherever the library has it (AVX-512, or AVX2 and FMA), the
    engine's on AMD's CPUs and put in its place elsewhere, so that its kernel is tested on any
    CPU that can run it; an engine's decoder layers in one native call from the same library,
    which read W as its build packs it (the AVX2 build's blocks are not the AVX-512 build's)."""
    kernel = cpu_lora.CpuLinearF32(f32_library, any_cpu=True)
    monkeypatch.setattr(
        device, "choose_linear", lambda weight: kernel if weight.dtype == torch.float32 else None
    )
    monkeypatch.setattr(
        cpu_lora, "load_decoder_layers", lambda: cpu_lora.CpuDecoderLayers(f32_library)
    )
    return kernel


def reference(x, weight, bias):
    """The float32 product (and bias), rounded once to bfloat16."""
    y = x.float() @ weight.float().T
    return (y + bias.float() if bias is not None else y).bfloat16()


def assert_within_a_rounding_step(got, want):
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    gap = (got.float() - want.float()).abs()
    assert bool((gap <= STEP * want.float().abs() + 1e-6).all()), float(gap.max())


@bf16_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 31, 32, 33, 48, 70])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (100, 64), (17, 18), (97, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_projection_is_the_product_rounded_once(
    build, rows, out_features, in_features, with_bias
):
    torch.manual_seed(rows * 1000 + out_features)
    weight = (torch.randn(out_features, in_features) * 0.2).bfloat16()
    bias = torch.randn(out_features).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features).bfloat16()
    linear = device.Linear(weight, bias)
    assert linear._native is not None
    assert_within_a_rounding_step(linear(x), reference(x, weight, bias))


@bf16_native
def test_rows_a_stride_apart_and_larger_batches_agree(build):
    torch.manual_seed(0)
    weight = (torch.randn(300, 128) * 0.2).bfloat16()
    linear = device.Linear(weight)
    wide = torch.randn(70, 256).bfloat16()
    x = wide[:, :128]  # rows 256 apart
    assert_within_a_rounding_step(linear(x[:32]), reference(x[:32], weight, None))
    # past NATIVE_LINEAR_MAX_ROWS: oneDNN's kernels, or the native ones with AMX, on Zen 4 and in
    # the FMA build
    assert_within_a_rounding_step(linear(x), reference(x, weight, None))
    batched = torch.randn(2, 35, 128).bfloat16()  # not 2-D (the FMA build keeps no other copy)
    assert_within_a_rounding_step(linear(batched), reference(batched, weight, None))


@bf16_native
def test_where_it_takes_every_batch_a_row_gives_the_same_bits_in_any_batch(build):
    """With AMX, on Zen 4 and 5 and in the FMA build the native projection takes batches of any
    size, each row's sums kept apart from the other rows': a token's projection is the same bits
    whether it runs alone, in a decode batch or in a prompt chunk (112 inputs: with AMX, three
    steps of tiles and a vdpbf16ps tail)."""
    torch.manual_seed(1)
    weight = (torch.randn(200, 112) * 0.2).bfloat16()
    linear = device.Linear(weight, torch.randn(200).bfloat16())
    if not linear._native_takes_all:
        pytest.skip("this build takes decode-sized batches only")
    assert_a_row_gives_the_same_bits_in_any_batch(linear, torch.randn(100, 112).bfloat16())


def assert_a_row_gives_the_same_bits_in_any_batch(linear: device.Linear, x: torch.Tensor) -> None:
    whole = linear(x)
    for start, end in [(0, 1), (5, 6), (0, 32), (31, 64), (40, 100), (99, 100)]:
        assert torch.equal(linear(x[start:end]), whole[start:end]), (start, end)


@bf16_native
def test_odd_input_width_keeps_onednn():
    weight = torch.randn(8, 7).bfloat16()
    assert device.choose_linear(weight) is None
    x = torch.randn(3, 7).bfloat16()
    assert_within_a_rounding_step(device.Linear(weight)(x), reference(x, weight, None))


@bf16_native
@pytest.mark.parametrize("shrinks_only", [False, True])
def test_fetch_covers_exactly_the_rows_the_lora_call_reads(tiny_llama, tiny_adapters, shrinks_only):
    """For a decode batch over several adapters (different ranks and modules), the ranges a
    projection fetches for a LoRA call are each token's adapter rows for the call's modules, in
    the kernel's order: A rows then B^T rows, module after module, token after token; for the
    call's shrinks alone, its A rows in that order."""
    llm = make_llm(tiny_llama, dtype="bfloat16")
    engine = llm.engine
    names = ["qv-r4", "attn-r8", "qkv-r8", "all-r2", "qv-r4"]
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    for i, name in enumerate(names):
        lora = LoRARequest(name, str(tiny_adapters[name]))
        engine.add_request(engine.make_request(f"prompt {i}", greedy, lora=lora))
    while engine.has_unfinished():  # loads them; they stay resident
        engine.step()
    hashes = [engine.catalog.read(str(tiny_adapters[name])).content_hash for name in names]
    token_adapters = [engine.adapters.resident[h] for h in hashes]
    kernel = cpu_lora.load()
    pool = engine.adapters.pool.data
    lora = TorchLoRA(token_adapters, len(token_adapters), pool, Workspace("cpu"), kernel)
    c = engine.model_config
    modules = (("q_proj", 0, c.q_size), ("k_proj", c.q_size, c.kv_size),
               ("v_proj", c.q_size + c.kv_size, c.kv_size))  # fmt: skip
    for layer in range(c.num_layers):
        fetch = lora.fetch(layer, modules, c.hidden_size, shrinks_only)
        got = list(zip(fetch.at.tolist(), fetch.bytes.tolist(), strict=True))
        want = []
        for group in lora.groups:  # the kernel's order: group by group, token by token
            for adapter in token_adapters[group.start : group.end]:
                for module, _, _ in modules:
                    if (layer, module) in adapter.targets:
                        a, b = adapter.a_matrix(layer, module), adapter.b_matrix(layer, module)
                        for m in (a,) if shrinks_only else (a, b):
                            want += [(row.data_ptr(), row.nbytes) for row in m]
        assert got == want, layer


@bf16_native
@pytest.mark.parametrize("span", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 70, 95])  # past NATIVE_LINEAR_MAX_ROWS: 70, 95
def test_a_projection_and_its_lora_call_in_one_native_call_give_their_bits_apart(build, rows, span):
    """q, k and v's projection and LoRA call (tokens on three adapters in any order, runs of
    one, or those and then a prompt span, which the threads share by blocks) in one native call:
    the bits of the projection, then the call, apart, for a call on every row or on the later
    rows alone; a product that cannot take the call (past NATIVE_LINEAR_MAX_ROWS, but in the FMA
    build and on Zen 4) is refused it."""
    projection_and_call_give_their_bits_apart(rows, torch.bfloat16, span)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 70])
def test_float32_projection_and_its_lora_call_in_one_native_call_give_their_bits_apart(
    f32_kernel, rows
):
    """The same in float32, where decode-sized batches take the native projection."""
    projection_and_call_give_their_bits_apart(rows, torch.float32)


def projection_and_call_give_their_bits_apart(
    rows: int, dtype: torch.dtype, span: bool = False
) -> bool:
    """Whether the projection of `rows` rows took the LoRA call in its native call (it is refused
    it where it does not), with the bits of the two apart; with `span`, its second half one run
    on one adapter, as a prompt span after decode tokens."""
    torch.manual_seed(rows)
    fin, widths, rank, adapters = 576, (576, 192, 192), 8, 3
    weight = (torch.randn(sum(widths), fin) * 0.05).to(dtype)
    linear = device.Linear(weight)
    a = (torch.randn(len(widths), adapters * rank, fin) * 0.05).to(dtype)
    b = [(torch.randn(adapters * rank, width) * 0.05).to(dtype) for width in widths]
    pool = torch.cat([a.flatten(), *[m.flatten() for m in b]])
    a_rows = (torch.arange(a.shape[0] * a.shape[1]) * fin).view(a.shape[0], a.shape[1])
    b_rows, at = [], a.numel()
    for width, matrix in zip(widths, b, strict=True):
        b_rows.append(at + torch.arange(adapters * rank) * width)
        at += matrix.numel()
    slots = torch.randint(0, adapters, (rows,))
    if span:
        slots[rows // 2 :] = adapters - 1
    scales = torch.tensor([0.5, 1.0, 2.0])
    outputs = cpu_lora.Outputs([(0, 0, 576), (1, 576, 192), (2, 768, 192)])
    call = bind_one(
        cpu_lora.load(), pool, a_rows, torch.stack(b_rows), slots, rank, scales, outputs, 0, rows
    )
    x = torch.randn(rows, fin).to(dtype)
    apart = linear(x)
    call(x, apart)
    if not linear.native(x):
        with pytest.raises(ValueError, match="does not take"):
            linear(x, lora=call)
        return False
    fused = linear(x, lora=call)
    assert torch.equal(fused, apart)
    assert not torch.equal(fused, linear(x))
    first = rows // 3  # a call on the later rows alone (the first ones on no adapter)
    later = bind_one(
        cpu_lora.load(),
        pool,
        a_rows,
        torch.stack(b_rows),
        slots[first:],
        rank,
        scales,
        outputs,
        first,
        rows,
    )
    later_apart = linear(x)
    later(x, later_apart)
    assert torch.equal(linear(x, lora=later), later_apart)
    if linear.fetches(x):  # the call's rows brought into cache meanwhile change nothing
        size, rows_of = pool.element_size(), rank * adapters
        offsets = torch.cat([a_rows.flatten(), *b_rows])
        nbytes = [fin * size] * a_rows.numel() + [w * size for w in widths for _ in range(rows_of)]
        fetch = cpu_lora.Fetch(pool.data_ptr() + offsets * size, torch.tensor(nbytes))
        assert torch.equal(linear(x, fetch, lora=call), apart)
    return True


# every tile's row count: 8 rows in the AVX-512 build's tall tile (Intel's), 4 in the others
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 32, 33])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (100, 37), (1, 1), (97, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_projection_is_the_product(f32_kernel, rows, out_features, in_features, with_bias):
    """Decode-sized batches through the native float32 projection, larger ones (33 rows) through
    oneDNN's (but on Zen 2 and 5): float32's product either way, to its rounding over the sum's
    length."""
    torch.manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features) * 0.2
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(rows, in_features)
    linear = device.Linear(weight, bias)
    assert linear._native is f32_kernel
    assert linear.native(x) == (rows <= device.NATIVE_LINEAR_MAX_ROWS or f32_kernel.any_rows)
    assert_the_float32_product(linear(x), x, weight, bias)


def assert_the_float32_product(got, x, weight, bias) -> None:
    """got is x W^T (+ bias) to float32's rounding over the sum's length."""
    want = x.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    assert got.dtype == torch.float32 and got.shape == want.shape
    bound = 1e-6 * (x.double().abs() @ weight.double().abs().T + 1) * x.shape[-1] ** 0.5
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.fixture
def f32_every_batch(monkeypatch, f32_kernel) -> cpu_lora.CpuLinearF32:
    """The float32 projection taking batches of every size, as it does on Zen 2 (any_rows)."""
    monkeypatch.setattr(f32_kernel, "any_rows", True)
    return f32_kernel


@pytest.mark.parametrize("rows", [33, 70, 256])
def test_float32_projection_taking_every_batch_is_the_product_from_one_copy(f32_every_batch, rows):
    """Where it takes every batch (Zen 2), prompt chunks and batches that are not 2-D go through
    it too, and the projection keeps W packed its way alone, no oneDNN copy beside it."""
    torch.manual_seed(rows)
    weight = torch.randn(960, 576) * 0.2
    bias = torch.randn(960)
    linear = device.Linear(weight, bias)
    assert linear.weight is None and linear._packed is None
    x = torch.randn(rows, 576)
    assert linear.native(x)
    assert_the_float32_product(linear(x), x, weight, bias)
    batched = torch.randn(2, rows, 576)
    assert_the_float32_product(linear(batched), batched, weight, bias)


def test_float32_projection_taking_every_batch_gives_a_row_the_same_bits_in_any_batch(
    f32_every_batch,
):
    """A token's projection is the same bits alone, in a decode batch or in a prompt chunk."""
    torch.manual_seed(1)
    linear = device.Linear(torch.randn(200, 112) * 0.2, torch.randn(200))
    assert_a_row_gives_the_same_bits_in_any_batch(linear, torch.randn(100, 112))


@pytest.mark.parametrize("rows", [70, 256])
def test_float32_projection_taking_every_batch_makes_a_prompt_chunks_lora_call(
    f32_every_batch, rows
):
    """Past NATIVE_LINEAR_MAX_ROWS it takes the LoRA call in its native call too, with the bits of
    the two apart."""
    assert projection_and_call_give_their_bits_apart(rows, torch.float32)


def test_an_engine_whose_float32_projection_takes_prompt_chunks_matches_transformers_and_peft(
    f32_every_batch, tiny_llama, tiny_adapters, report, monkeypatch
):
    """As served on Zen 2 and 5: prompt chunks (a prompt longer than a chunk too, beside decode
    steps) through the native float32 projection, each with its LoRA call in the same native
    call and that call's adapter rows fetched meanwhile, on the base model and on adapters of
    every rank and module set; greedy tokens identical to transformers' and PEFT's."""
    llm = make_llm(tiny_llama, max_num_batched_tokens=CHUNK)
    model = llm.engine.runner.model
    assert all(p._native_takes_all for p in (model.layers[0].qkv, model.layers[0].down))
    chunk_rows, fetched, fused = [], [], f32_every_batch._fused[torch.float32]

    def counted(*arguments):  # the projection and its LoRA call: (x, x's stride, rows, ...)
        if arguments[2] > device.NATIVE_LINEAR_MAX_ROWS:
            chunk_rows.append(arguments[2])
            fetched.append(arguments[11] > 0)  # the ranges it brings into cache meanwhile
        return fused(*arguments)

    monkeypatch.setitem(f32_every_batch._fused, torch.float32, counted)
    prompts = mixed_prompts(llm.tokenizer, 2 * (len(tiny_adapters) + 1), seed=5)
    names = [*tiny_adapters, None]
    adapters = [tiny_adapters[n] if n else None for n in names] * 2
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = llm.generate(prompts, params, adapters=adapters)
    refs = [peft_reference(tiny_llama, a, p, 12) for a, p in zip(adapters, prompts, strict=True)]
    near_ties = assert_matches_reference([r.outputs[0].token_ids for r in results], refs)
    assert len(chunk_rows) >= 4  # products of prompt chunks (up to 64 rows) with a LoRA call
    assert all(fetched)  # each fetching its call's rows, decode tokens' and prompt spans'
    report(
        f"tiny llama, float32, {len(chunk_rows)} products of {min(chunk_rows)}-{max(chunk_rows)}"
        f" rows with their LoRA calls natively, their rows fetched: identical to PEFT, "
        f"{near_ties} near-ties"
    )
