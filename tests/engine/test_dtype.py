"""`dtype="auto"`: bfloat16 where the device computes it natively, float32 elsewhere; an explicit
dtype always wins, and the engine reports what it runs."""

from __future__ import annotations

import pytest
import torch

from loraplex import SamplingParams
from loraplex.engine import device
from loraplex.engine.config import EngineConfig
from loraplex.kernels import cpu_lora
from tests.factories import cpu_flags, make_llm


def test_auto_follows_what_this_cpu_reports():
    native = bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})
    assert device.cpu_has_native_bf16() == native
    assert EngineConfig().dtype == ("bfloat16" if native else "float32")
    assert EngineConfig(dtype="auto").torch_dtype == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_on_a_cpu_with_and_without_native_bfloat16(monkeypatch, native, expected):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: native)
    assert device.choose_dtype("auto", "cpu") == expected
    for explicit in ("float32", "bfloat16", "float16"):  # an explicit choice always wins
        assert device.choose_dtype(explicit, "cpu") == explicit
        assert EngineConfig(dtype=explicit).dtype == explicit


@pytest.mark.parametrize(
    "vendor, family, flags, fma_build, amd_bf16, f32, fetch_next, tall",
    [
        # Zen 4, Zen 5, Zen 3 (no AVX-512), Zen 2
        ("AuthenticAMD", "25", "avx2 avx512f avx512_bf16", False, True, "fetching", True, False),
        ("AuthenticAMD", "26", "avx2 avx512f avx512_bf16", False, True, "fetching", False, True),
        ("AuthenticAMD", "25", "avx2", False, False, "shrinks", True, False),
        ("AuthenticAMD", "23", "avx2", False, False, "fetching", False, False),
        # Intel: AVX-512 alone (Cascade Lake), AVX512-BF16 without AVX512-FP16 (Cooper Lake);
        # since Sapphire Rapids, without AMX (as a hypervisor may offer it) and with; AVX2 alone
        ("GenuineIntel", "6", "avx2 avx512f avx512_vnni", False, False, "own", True, True),
        ("GenuineIntel", "6", "avx2 avx512f avx512_bf16", True, False, "own", True, True),
        ("GenuineIntel", "6", "avx2 avx512f avx512_bf16 avx512_fp16", True, False, "shrinks", True,
         True),
        ("GenuineIntel", "6", "avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16", False, False,
         "shrinks", True, True),
        ("GenuineIntel", "6", "avx2", False, False, None, False, False),
    ],
)  # fmt: skip
def test_the_kernels_follow_the_cpu_model(
    monkeypatch, vendor, family, flags, fma_build, amd_bf16, f32, fetch_next, tall
):
    """Which bfloat16 build and projection a CPU gets, from what /proc/cpuinfo reports: the FMA
    build where vdpbf16ps runs at half rate (Intel without AMX), and on AMD's (Zen 4 and 5)
    alone of the vdpbf16ps CPUs the native projection for prompt chunks as well; and the native
    float32 projection (where the library has it: AVX-512, or AVX2 and FMA) on AMD's (Zen 2 to
    5) and on Intel with AVX-512, fetching the LoRA rows on AMD's and, since Sapphire Rapids, on
    Intel's (all the call's rows or the A rows alone, as the engine times them; the A rows alone
    first on Zen 3 and Intel's), before Sapphire Rapids fetching nothing; Intel's with AVX2
    alone keep oneDNN's. The float32 decode
    attention fetches a thread's next sequence where that was measured faster in steps (Intel's
    Xeons with AVX-512, Zen 3 and Zen 4), and the float32 projection's tiles are 8 rows tall on
    Intel's Xeons with AVX-512 and on Zen 5."""
    # this machine's build, taken before the CPU is faked: library() keeps what it first builds
    # for the process, and a faked CPU would have it build (and keep) that CPU's
    lib = cpu_lora.library()
    fake_cpu(monkeypatch, {"vendor_id": vendor, "cpu family": family, "flags": flags})
    assert cpu_lora.dpbf16_half_rate() == fma_build
    assert ("-DBF16_BY_FMA" in cpu_lora.build_flags()) == fma_build
    assert ("-DF32_FETCH_NEXT" in cpu_lora.build_flags()) == fetch_next
    assert ("-DF32_TALL_TILE" in cpu_lora.build_flags()) == tall
    assert cpu_lora.amd_bf16() == amd_bf16
    if lib is not None and lib.linear_native_bf16() and not lib.linear_any_rows_bf16():
        # the vdpbf16ps build, which cannot tell AMD's from Intel's: the CPU's vendor decides
        assert cpu_lora.CpuLinearBf16(lib).any_rows == amd_bf16
    if lib is not None and lib.linear_native_f32():
        assert cpu_lora.CpuLinearF32(lib).supports(torch.float32) == (f32 is not None)
        linear = cpu_lora.CpuLinearF32(lib)
        # it may fetch all the LoRA call's rows or its A rows alone; the engine times which
        assert linear.fetches == linear.fetches_shrinks == (f32 in ("fetching", "shrinks"))
        assert linear.shrinks_first == (f32 == "shrinks")  # the A rows alone until timed
        assert not cpu_lora.CpuLinearF32(lib).supports(torch.bfloat16)


@pytest.mark.parametrize(
    "vendor, family, model, flags, every_batch",
    [
        ("AuthenticAMD", "23", "49", "avx2 fma", True),  # Zen 2: Rome
        ("AuthenticAMD", "23", "113", "avx2 fma", True),  # Zen 2: Matisse
        ("AuthenticAMD", "23", "1", "avx2 fma", False),  # Zen: 128-bit FMA units
        ("AuthenticAMD", "23", "8", "avx2 fma", False),  # Zen+
        ("AuthenticAMD", "25", "1", "avx2 fma", False),  # Zen 3
        ("AuthenticAMD", "25", "17", "avx2 fma avx512f avx512_bf16", False),  # Zen 4
        ("AuthenticAMD", "26", "2", "avx2 fma avx512f avx512_bf16", True),  # Zen 5
        ("GenuineIntel", "6", "85", "avx2 fma avx512f", False),
    ],
)  # fmt: skip
def test_zen2_and_zen5_take_prompt_chunks_through_the_float32_projection(
    monkeypatch, vendor, family, model, flags, every_batch
):
    """The float32 projection takes batches of every size (prompt chunks too, and the model keeps
    no oneDNN copy of its weights) on Zen 2 and Zen 5 alone, where whole prefills were measured
    as fast as or faster than with oneDNN's; elsewhere decode-sized batches alone."""
    lib = cpu_lora.library()  # this machine's build, before the CPU is faked
    if lib is None or not lib.linear_native_f32():
        pytest.skip("the library has no float32 projection on this CPU (no AVX2 and FMA)")
    fake_cpu(
        monkeypatch, {"vendor_id": vendor, "cpu family": family, "model": model, "flags": flags}
    )
    assert cpu_lora.CpuLinearF32(lib).any_rows == every_batch


def fake_cpu(monkeypatch, info: dict[str, str]) -> None:
    """/proc/cpuinfo's first CPU as cpu_lora reads it, made `info` (its "flags" split)."""
    monkeypatch.setattr(cpu_lora, "cpu_info", lambda: info)
    monkeypatch.setattr(cpu_lora, "cpu_flags", lambda: frozenset(info["flags"].split()))


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="auto, float32, bfloat16 or float16"):
        EngineConfig(dtype="float64")


def test_the_engine_runs_and_reports_the_dtype_auto_chose(tiny_llama):
    llm = make_llm(tiny_llama, dtype="auto")
    chosen = EngineConfig(dtype="auto").dtype
    assert llm.engine.model_info().dtype == chosen
    assert llm.engine.pool.data.dtype == getattr(torch, chosen)  # KV and adapter pages
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert len(llm.generate(["the sea"], greedy)[0].outputs[0].token_ids) == 6
