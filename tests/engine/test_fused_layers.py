"""bfloat16 and float32 on CPU: a step's decoder layers run in one native call (cpu/layers.c)
where every projection is native for its rows, with the batch's LoRA calls made by the
projections in it. They must give the bits of the calls the model otherwise makes one by one, in
prompt chunks (bfloat16) and decode steps alike, with biases on q,k,v (the tiny Qwen2) and
without, with adapters of several ranks and module sets in one batch beside requests without
one, wherever the q,k,v rows are fetched; and where every adapter of a batch has one shape on
every layer, with each projection's LoRA bound once for all layers (cpu_lora.StridedLoRA)."""

from __future__ import annotations

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.adapters.peft_format import MODULES, random_peft_adapter
from loraplex.engine.fetch_placement import AHEAD, ALL, SHRINKS
from loraplex.kernels import cpu_lora
from tests.factories import build_adapter, make_llm

PROMPTS = [
    "the river city",
    "a story of light and dark told by the old king " * 3,
    "tell me",
    "numbers: one two three four five six seven eight nine ten eleven twelve",
]


def run(llm, fused: bool, adapters=None) -> list:
    llm.engine.runner.model.fuse_layers = fused
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    count = len(adapters) if adapters else len(PROMPTS)  # the prompts in turn, one a request
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    results = llm.generate(prompts, params, adapters=adapters)
    return [
        (r.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in r.outputs[0].logprobs])
        for r in results
    ]


def fused_llm(model_dir, dtype: str):
    """An engine in `dtype` with its count of steps in one native call, those with LoRA and
    all: (llm, counts); skips where the CPU has no native projection in that dtype."""
    # every run computes its prompts (in bfloat16 a prompt's LoRA spans round differently when
    # part of it comes from the prefix cache), in chunks beside decode steps
    llm = make_llm(model_dir, dtype=dtype, max_num_batched_tokens=24, enable_prefix_caching=False)
    model = llm.engine.runner.model
    if model._decoder is None or not model.layers[0].qkv.native_rows(1):
        pytest.skip(f"no native {dtype} projection on this CPU")
    # steps in one native call (with LoRA, and with it bound for all layers at once); steps
    # without a prompt span apart (with LoRA), which it must take in either dtype (bfloat16
    # takes prompt chunks as rows too), and those it did not take; steps of decode tokens alone
    # with LoRA (and those bound for all layers at once)
    counts = {"all": 0, "lora": 0, "strided": 0, "decode": 0, "decode lora": 0}
    counts |= {"decode apart": 0, "decodes alone": 0, "strided decodes alone": 0}
    fuse, forward = model._decoder, model.forward

    def counted(dtype, layers, shape, step, lora=None):
        counts["all"] += 1
        counts["lora"] += lora is not None
        counts["strided"] += isinstance(lora, cpu_lora.StridedLoRA)
        return fuse(dtype, layers, shape, step, lora)

    def counted_forward(batch, kv):
        calls, strided = counts["all"], counts["strided"]
        out = forward(batch, kv)
        if model.fuse_layers and not batch.prefills:
            counts["decode"] += 1
            counts["decode lora"] += batch.lora is not None
            counts["decode apart"] += counts["all"] == calls
        if (
            model.fuse_layers
            and batch.lora is not None
            and batch.num_decodes == len(batch.input_ids)
        ):
            counts["decodes alone"] += 1
            counts["strided decodes alone"] += counts["strided"] > strided
        return out

    model._decoder, model.forward = counted, counted_forward
    return llm, counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_layers_give_the_bits_of_the_calls_one_by_one(tiny_model_dirs, family, dtype):
    llm, counts = fused_llm(tiny_model_dirs[family], dtype)
    one_by_one = run(llm, fused=False)
    assert counts["all"] == 0
    assert run(llm, fused=True) == one_by_one
    assert counts["decode"] >= 11 and counts["decode apart"] == 0  # 12 tokens, one the prompt's


ADAPTERS = [  # rank, modules: q,v alone, attention, MLP alone, all seven, one module
    (4, ("q_proj", "v_proj")),
    (8, ("q_proj", "k_proj", "v_proj", "o_proj")),
    (16, ("gate_proj", "up_proj", "down_proj")),
    (2, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (12, ("down_proj",)),
]


# each dtype with each way its steps may fetch (fetch_placement.py): the A rows alone in float32
DTYPE_WAYS = [
    ("bfloat16", AHEAD), ("bfloat16", ALL), ("float32", AHEAD), ("float32", ALL),
    ("float32", SHRINKS),
]  # fmt: skip


@pytest.mark.parametrize(("dtype", "way"), DTYPE_WAYS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_layers_with_adapters_give_the_bits_of_the_calls_one_by_one(
    tiny_model_dirs, tmp_path, family, way, dtype
):
    llm, counts = fused_llm(tiny_model_dirs[family], dtype)
    engine = llm.engine
    engine.runner.model.fetch_placement.fix(way)
    config = engine.model_config
    loras = [
        LoRARequest(f"a{i}", str(random_peft_adapter(tmp_path / f"a{i}", config, r, m, i, 0.2)))
        for i, (r, m) in enumerate(ADAPTERS)
    ]
    adapters = [*loras, None, *loras, None]  # each twice, beside requests without one
    assert_same_bits(llm, counts, adapters, len(loras))
    # steps of several shapes took a LayerLoRA a layer (steps of one shape alone, strided)
    assert counts["lora"] - counts["strided"] >= 4


def assert_same_bits(llm, counts: dict, adapters: list, changed_at_least: int) -> None:
    """The requests on `adapters` give the same bits with their steps' layers in one native
    call as one by one, where every step of decode tokens with LoRA took the native call; and
    the adapters change what they touch, so a LoRA call left out or misplaced shows."""
    one_by_one = run(llm, fused=False, adapters=adapters)
    assert counts["all"] == 0
    assert run(llm, fused=True, adapters=adapters) == one_by_one
    assert counts["decode lora"] >= 4 and counts["decode apart"] == 0
    base = run(llm, fused=True, adapters=[None] * len(adapters))
    changed = [ours[0] != theirs[0] for ours, theirs in zip(one_by_one, base, strict=True)]
    assert sum(changed) >= changed_at_least


ONE_SHAPE = {"q,v": (4, ("q_proj", "v_proj")), "all seven": (2, MODULES), "MLP": (8, MODULES[4:])}


@pytest.mark.parametrize(("dtype", "way"), DTYPE_WAYS)
@pytest.mark.parametrize("shape", ONE_SHAPE)
def test_adapters_of_one_shape_are_bound_once_for_every_layer_with_the_same_bits(
    tiny_model_dirs, tmp_path, shape, way, dtype
):
    llm, counts = fused_llm(tiny_model_dirs["llama"], dtype)
    engine = llm.engine
    engine.runner.model.fetch_placement.fix(way)
    rank, modules = ONE_SHAPE[shape]
    loras = [
        LoRARequest(f"a{i}", str(random_peft_adapter(tmp_path / f"a{i}", engine.model_config,
                                                     rank, modules, i, 0.2)))
        for i in range(3)
    ]  # fmt: skip
    assert_same_bits(llm, counts, [*loras, None, *loras], len(loras))
    # a step whose prompt chunks put a request without adapter between two of them has its
    # runs in two groups, each its own binding; decode steps hold one group
    assert counts["strided decodes alone"] == counts["decodes alone"] >= 4


def test_adapters_on_some_layers_alone_take_a_binding_a_layer(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["llama"]
    llm, counts = fused_llm(model_dir, "bfloat16")
    loras = [
        LoRARequest(f"a{i}", str(build_adapter(model_dir, tmp_path / f"a{i}", 4, seed=i,
                                               layers=[1])))
        for i in range(2)
    ]  # fmt: skip
    assert_same_bits(llm, counts, [*loras, None, *loras], len(loras))
    assert counts["strided"] == 0 and counts["lora"] >= 4
