"""LoRA adapters on the tiny model: exact against PEFT, refused when unservable, managed in the
shared pool."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.adapters import lora_batch
from loraplex.engine.adapters.peft_format import random_peft_adapter
from loraplex.engine.config import ModelConfig
from loraplex.engine.errors import AdapterError
from tests.factories import make_llm
from tests.oracle import (
    assert_matches_reference,
    load_reference_model,
    reference_greedy,
)

PROMPTS = [
    "the river runs",
    "a cat sleeps quickly",
    "old king tells a story of the mountain",
    "hello world",
    "über café",
    "green light",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def peft_reference(base_dir, adapter_dir, prompt_ids, max_tokens):
    model = load_reference_model(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    return reference_greedy(model, prompt_ids, max_tokens, None)


@pytest.mark.parametrize(
    "backend, strategy",
    [
        ("native", None),
        ("torch", "grouped"),
        ("torch", "gathered"),
        ("reference", None),
        ("triton", None),
    ],
)
def test_mixed_adapter_batch_matches_peft(
    tiny_llama, tiny_adapters, backend, strategy, report, monkeypatch
):
    # the CPU path's two strategies, each forced on every decode token: an adapter's tokens
    # applied in place from its pages (grouped), or every token's rows gathered (gathered)
    if strategy:
        monkeypatch.setattr(lora_batch, "GROUP_MIN_TOKENS", 1 if strategy == "grouped" else 10**9)
    llm = make_llm(tiny_llama, lora_backend=backend)
    names = [*tiny_adapters, None]
    # every adapter twice (and the base model twice), interleaved, all in one continuous batch
    cases = [(names[i % len(names)], PROMPTS[i % len(PROMPTS)]) for i in range(2 * len(names))]
    prompts = [llm.tokenizer.encode(p) for _, p in cases]
    adapters = [tiny_adapters[n] if n else None for n, _ in cases]
    max_tokens = 6 if backend == "triton" else 16  # the Triton interpreter is slow
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = llm.generate(prompts, params, adapters=adapters)
    refs = [
        peft_reference(tiny_llama, a, p, max_tokens) for a, p in zip(adapters, prompts, strict=True)
    ]
    near_ties = assert_matches_reference([r.outputs[0].token_ids for r in results], refs)
    report(
        f"tiny llama + {len(tiny_adapters)} adapters ({backend} LoRA path"
        f"{f', {strategy}' if strategy else ''}): identical to PEFT, "
        f"{near_ties} near-ties"
    )
    base = llm.generate(prompts, params)  # the same prompts without adapters
    changed = [
        r.outputs[0].token_ids != b.outputs[0].token_ids
        for r, b, adapter in zip(results, base, adapters, strict=True)
        if adapter is not None
    ]
    assert sum(changed) > len(changed) // 2, "the adapters should change most outputs"


# -- refused adapters ------------------------------------------------------------------------


def peft_adapter(base_dir, out_dir, **config):
    model = get_peft_model(load_reference_model(base_dir), LoraConfig(r=4, **config))
    model.save_pretrained(out_dir)
    return out_dir


def corrupt(src, dst, how):
    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    data = weights.read_bytes()
    if how == "pickle":
        weights.rename(dst / "adapter_model.bin")
    elif how == "garbage":
        weights.write_bytes(b"\x00\x13not a safetensors file at all" * 10)
    elif how == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        save_file({}, weights)
    return dst


def with_values(src, dst, *values):
    """A copy of the adapter at `src` whose first lora_B tensor starts with `values`."""
    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = sorted(n for n in tensors if "lora_B" in n)[0]
    tensors[name].view(-1)[: len(values)] = torch.tensor(values)
    save_file(tensors, weights)
    return dst


def bad_adapters(tiny_llama, tiny_adapters, tmp_path):
    good = tiny_adapters["qv-r4"]
    other = ModelConfig.from_dir(tiny_llama)
    other = dataclasses.replace(other, hidden_size=48)
    return {
        "pickle": (corrupt(good, tmp_path / "pickle", "pickle"), "never unpickles"),
        "garbage": (
            corrupt(good, tmp_path / "garbage", "garbage"),
            "not a readable safetensors file",
        ),
        "truncated": (
            corrupt(good, tmp_path / "truncated", "truncated"),
            "not a readable safetensors file",
        ),
        "empty": (corrupt(good, tmp_path / "empty", "empty"), "holds no LoRA weights"),
        "NaN": (
            with_values(good, tmp_path / "nan", 0.5, float("nan")),
            "lora_B.weight holds NaN or infinite values",
        ),
        "infinite": (
            with_values(good, tmp_path / "inf", float("-inf")),
            "lora_B.weight holds NaN or infinite values",
        ),
        "other base": (
            random_peft_adapter(tmp_path / "other", other, 4),
            "q_proj.lora_A.weight has shape (4, 48); the base model needs (4, 64)",
        ),
        "lm_head": (
            peft_adapter(tiny_llama, tmp_path / "lm_head", target_modules=["q_proj", "lm_head"]),
            "LoRA on lm_head is not supported",
        ),
        "embeddings": (
            peft_adapter(tiny_llama, tmp_path / "embed", target_modules=["embed_tokens"]),
            "LoRA on embed_tokens is not supported",
        ),
        "dora": (
            peft_adapter(tiny_llama, tmp_path / "dora", target_modules=["q_proj"], use_dora=True),
            "DoRA (use_dora) is not supported",
        ),
        "modules_to_save": (
            peft_adapter(
                tiny_llama, tmp_path / "mts", target_modules=["q_proj"], modules_to_save=["lm_head"]
            ),
            "modules_to_save is not supported",
        ),
        "rank too high": (
            tiny_adapters["mlp-r16"],
            "adapter rank 16 exceeds the configured maximum 8",
        ),
        "outside roots": (tiny_adapters["attn-r8"], "is outside the configured adapter roots"),
    }


def test_unservable_adapters_are_refused_and_the_engine_keeps_serving(
    tiny_llama, tiny_adapters, tmp_path
):
    roots = tmp_path / "roots"
    roots.mkdir()
    cases = bad_adapters(tiny_llama, tiny_adapters, tmp_path)
    for name, (path, _) in cases.items():
        if name != "outside roots":  # everything else lives inside the allowed root
            shutil.copytree(path, roots / name)
    fine = roots / "fine"
    shutil.copytree(tiny_adapters["qv-r4"], fine)
    llm = make_llm(tiny_llama, max_lora_rank=8, adapter_roots=(str(roots),))
    engine = llm.engine
    expected = llm.generate(["the river"], GREEDY, adapters=[str(fine)])[0].outputs[0].token_ids
    for name, (path, message) in cases.items():
        where = path if name == "outside roots" else roots / name
        with pytest.raises(AdapterError) as error:
            engine.make_request("the river", GREEDY, lora=LoRARequest(name, str(where)))
        assert message in str(error.value), f"{name}: {error.value}"
        # nothing changed: the next request is served exactly as before
        out = llm.generate(["the river"], GREEDY, adapters=[str(fine)])
        assert out[0].outputs[0].token_ids == expected, name
    assert engine.pool_snapshot().kv_pages == 0


def test_symlink_out_of_the_roots_is_refused(tiny_llama, tiny_adapters, tmp_path):
    roots = tmp_path / "roots"
    roots.mkdir()
    (roots / "sneaky").symlink_to(tiny_adapters["qv-r4"])
    llm = make_llm(tiny_llama, adapter_roots=(str(roots),))
    with pytest.raises(AdapterError, match="outside the configured adapter roots"):
        llm.engine.make_request("a", GREEDY, lora=LoRARequest("x", str(roots / "sneaky")))


# -- the pool ------------------------------------------------------------------------------


def test_load_pin_unpin_unload_and_snapshot(tiny_llama, tiny_adapters):
    llm = make_llm(tiny_llama, num_pages=40)
    engine = llm.engine
    a = LoRARequest("a", str(tiny_adapters["mlp-r16"]))
    b = LoRARequest("b", str(tiny_adapters["qv-r4"]))
    engine.load_adapter(a)
    engine.pin_adapter(b)
    snap = engine.pool_snapshot()
    assert {tuple(r.adapter_ids) for r in snap.resident} == {("a",), ("b",)}
    assert (
        snap.kv_pages == 0
        and snap.adapter_pages + snap.free_pages + snap.cached_pages == snap.num_pages
    )
    pinned = {r.adapter_ids[0]: r.pinned for r in snap.resident}
    assert pinned == {"a": False, "b": True}

    # fill the pool with KV: the idle adapter goes, the pinned one stays
    llm.generate([[5] * 300], SamplingParams(max_tokens=200, ignore_eos=True))
    resident = {r.adapter_ids[0] for r in engine.pool_snapshot().resident}
    assert resident == {"b"}

    engine.unpin_adapter("b")
    engine.unload_adapter("b")
    snap = engine.pool_snapshot()
    assert snap.resident == () and snap.free_pages + snap.cached_pages == snap.num_pages


def test_unloading_an_adapter_lets_its_running_request_finish(tiny_llama, tiny_adapters):
    llm = make_llm(tiny_llama)
    engine = llm.engine
    lora = LoRARequest("doomed", str(tiny_adapters["attn-r8"]))
    expected = llm.generate(["the river"], GREEDY, adapters=[lora])[0].outputs[0].token_ids
    engine.unload_adapter("doomed")
    engine.add_request(engine.make_request("the river", GREEDY, "r", lora=lora))
    engine.step()
    engine.step()
    engine.unload_adapter("doomed")  # while the request runs
    tokens = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.outputs[0].token_ids
    assert len(tokens) == 16 - 2
    assert engine.pool_snapshot().resident == ()
    assert engine.pool.num_available == engine.pool.num_pages
    assert expected[2:] == tokens


def test_new_content_under_an_old_id_is_not_served_stale(tiny_llama, tiny_adapters, tmp_path):
    llm = make_llm(tiny_llama)
    first = llm.generate(
        ["the river"], GREEDY, adapters=[LoRARequest("x", str(tiny_adapters["qv-r4"]))]
    )
    second = llm.generate(
        ["the river"], GREEDY, adapters=[LoRARequest("x", str(tiny_adapters["attn-r8"]))]
    )
    direct = llm.generate(["the river"], GREEDY, adapters=[str(tiny_adapters["attn-r8"])])
    assert second[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    assert second[0].outputs[0].token_ids != first[0].outputs[0].token_ids


def test_requests_with_resident_adapters_go_ahead_but_nobody_starves(tiny_llama, tmp_path):
    config = ModelConfig.from_dir(tiny_llama)
    one, two = (
        random_peft_adapter(
            tmp_path / n, config, 16, ("q_proj", "v_proj", "o_proj"), seed=s, std=0.2
        )
        for n, s in (("one", 1), ("two", 2))
    )
    llm = make_llm(tiny_llama, num_pages=12)
    engine = llm.engine
    pages = engine.adapters.plan_pages(engine.catalog.get("one", str(one)).weights)
    # room for one adapter and the KV of the requests below, not for both adapters
    assert 2 * pages + 6 > engine.pool.num_pages >= pages + 6
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    order = ["one", "two", "one", "one", "one"]
    first_token_step = {}
    for i, name in enumerate(order):
        lora = LoRARequest(name, str(one if name == "one" else two))
        engine.add_request(engine.make_request([3 + i] * 8, params, f"r{i}", lora=lora))
    step = 0
    while engine.has_unfinished():
        step += 1
        for delta in engine.step():
            first_token_step.setdefault(delta.request_id, step)
    assert set(first_token_step) == {f"r{i}" for i in range(5)}  # everybody ran
    # the later requests for the resident adapter overtook the one that needed a load
    assert all(first_token_step[f"r{i}"] < first_token_step["r1"] for i in (2, 3, 4))
    assert engine.adapters.num_loads == 2  # "one" once, "two" once: no back-and-forth


def test_request_that_only_fits_without_the_pinned_adapters_is_refused(tiny_llama, tiny_adapters):
    llm = make_llm(tiny_llama, num_pages=40, max_model_len=512)
    engine = llm.engine
    engine.pin_adapter(LoRARequest("pinned", str(tiny_adapters["mlp-r16"])))
    pinned = engine.pool_snapshot().adapter_pages
    # 100 + max_tokens tokens need 41 - pinned pages: more than the unpinned pages, fewer than all
    fits_only_unpinned = SamplingParams(max_tokens=16 * (41 - pinned) - 100)
    with pytest.raises(ValueError, match=f"{pinned} of them held by pinned adapters"):
        engine.make_request([5] * 100, fits_only_unpinned)
    engine.unpin_adapter("pinned")
    engine.make_request([5] * 100, fits_only_unpinned)  # fine once nothing is pinned


def test_large_finite_weights_are_not_mistaken_for_infinite(tiny_llama, tiny_adapters, tmp_path):
    """Finite values whose sum overflows: the check that sums first looks again, element by
    element, and serves the adapter."""
    huge = with_values(tiny_adapters["qv-r4"], tmp_path / "huge", 3e38, 3e38, -3e38)
    engine = make_llm(tiny_llama).engine
    request = engine.make_request("the river", GREEDY, lora=LoRARequest("huge", str(huge)))
    assert request.seqs[0].adapter is not None


def test_an_adapter_is_laid_out_for_the_pool_when_requested_and_its_host_copy_held_once(
    tiny_llama, tiny_adapters
):
    """The request's thread lays the adapter out as the pool's pages hold it (so the engine
    thread loads it with one copy); the host copy's matrices are views of that image, not a
    second copy; the pool then holds exactly the adapter's matrices as read from its file."""
    llm = make_llm(tiny_llama)
    engine = llm.engine
    path = str(tiny_adapters["all-r2"])
    fresh = engine.catalog.read(path)  # another copy, never packed
    request = engine.make_request("the river", GREEDY, lora=LoRARequest("all", path))
    weights = request.seqs[0].adapter.weights
    (packed,) = weights.packed.values()
    image = packed.image.untyped_storage().data_ptr()
    matrices = {("a", k): t for k, t in weights.a.items()}
    matrices.update({("b", k): t for k, t in weights.b.items()})
    assert all(t.untyped_storage().data_ptr() == image for t in matrices.values())
    engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    resident = engine.adapters.resident[weights.content_hash]
    assert fresh.packed == {} and fresh.a.keys() == weights.a.keys()
    for (layer, module), a in fresh.a.items():
        assert torch.equal(resident.a_matrix(layer, module), a), (layer, module)
        assert torch.equal(resident.b_matrix(layer, module), fresh.b[(layer, module)])
