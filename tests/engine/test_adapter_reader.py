"""The engine's adapter reader lays adapters out as the pool's pages hold them, converting a file's
bytes straight into those pages natively once its header is known: what it serves must be what
the checks, tensor by tensor, and the manager's own packing give, and nothing it would refuse
may get through because a file shares a header with one that passed."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.engine.adapters.manager import AdapterManager
from loraplex.engine.adapters.peft_format import (
    MODULES,
    WEIGHTS_FILE,
    AdapterReader,
    load_peft_adapter,
    module_shape,
    save_peft_adapter,
)
from loraplex.engine.config import ModelConfig
from loraplex.engine.errors import AdapterError, ErrorCode
from loraplex.engine.pool import PagePool
from loraplex.kernels import cpu_lora
from tests.factories import make_llm

RANK = 8
# the values where conversions go wrong: ties between two bfloat16s (1 + 2**-8 rounds down to
# even, 1 + 3 * 2**-8 up), float32 and float16 subnormals, -0, near the largest finite bfloat16
SPECIAL = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1e-40, 6e-8, -0.0, 3.38e38, -2.5e-3]

pytestmark = pytest.mark.skipif(
    cpu_lora.load_packer() is None, reason="the CPU kernels do not build here"
)


def write_adapter(model, path, dtype, seed, special=(), modules=MODULES, layers=None):
    """A PEFT adapter stored in `dtype`, its first lora_B starting with `special`."""
    generator = torch.Generator().manual_seed(seed)
    lora_a, lora_b = {}, {}
    for layer in range(model.num_layers):
        for module in modules:
            fan_in, fan_out = module_shape(model, module)
            lora_a[(layer, module)] = torch.randn(RANK, fan_in, generator=generator).to(dtype)
            lora_b[(layer, module)] = torch.randn(fan_out, RANK, generator=generator).to(dtype)
    first = lora_b[(0, modules[0])].view(-1)
    first[: len(special)] = torch.tensor(special, dtype=torch.float32).to(dtype)
    save_peft_adapter(path, lora_a, lora_b, lora_alpha=2 * RANK)
    if layers is not None:
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(
            json.dumps({**config, "layers_to_transform": layers})
        )
    return path


@pytest.fixture(scope="module")
def model(tiny_llama):
    return ModelConfig.from_dir(tiny_llama)


def bits(tensor):
    """Its bytes, so that -0 and 0 differ."""
    return tensor.contiguous().view(torch.uint8)


def page_numel(model):
    """Pages small enough that gate and up's B^T (RANK rows of the intermediate size) split."""
    return 3 * model.intermediate_size


@pytest.mark.parametrize("served", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float16])
def test_a_known_header_is_read_into_the_pages_the_checks_and_the_manager_give(
    model, tmp_path, stored, served
):
    reader = AdapterReader(model, 64, served, page_numel=page_numel(model))
    first = reader.read(write_adapter(model, tmp_path / "first", stored, seed=1))
    special = [v for v in SPECIAL if torch.tensor(v).to(stored).isfinite()]  # 3.38e38 in float16
    second_path = write_adapter(model, tmp_path / "second", stored, seed=2, special=special)
    second = reader.read(second_path)
    assert first.packed == {} and second.packed, "the second file of a header is laid out natively"

    checked = load_peft_adapter(second_path, model, 64, served)  # the checks, tensor by tensor
    pool = PagePool(num_pages=64, page_numel=page_numel(model), dtype=served, device="cpu")
    expected = AdapterManager(pool, model).pack(checked)
    (packed,) = second.packed.values()
    assert any(len(chunks) > 1 for _, chunks in packed.layout.matrices.values())
    assert packed.image.dtype == served
    assert torch.equal(bits(packed.image), bits(expected.image))
    assert second.content_hash == checked.content_hash
    assert second.a.keys() == checked.a.keys() == second.b.keys()
    for key in checked.a:
        assert torch.equal(bits(second.a[key]), bits(checked.a[key]))
        assert torch.equal(bits(second.b[key]), bits(checked.b[key]))


@pytest.mark.parametrize("served", [torch.float32, torch.bfloat16])
def test_a_value_not_finite_in_a_file_of_a_known_header_is_refused_by_name(model, tmp_path, served):
    reader = AdapterReader(model, 64, served, page_numel=page_numel(model))
    reader.read(write_adapter(model, tmp_path / "good", torch.float32, seed=1))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    for i, value in enumerate([float("nan"), float("-inf")]):
        bad = write_adapter(model, tmp_path / f"bad{i}", torch.float32, seed=3, special=[0, value])
        with pytest.raises(AdapterError, match=f"adapter tensor {name} holds NaN or infinite"):
            reader.read(bad)
    # finite in float32, infinite once rounded to bfloat16 (its largest is about 3.39e38)
    large = write_adapter(model, tmp_path / "large", torch.float32, seed=4, special=[3.399e38])
    if served == torch.bfloat16:
        with pytest.raises(AdapterError, match=f"{name} holds NaN or infinite.*bfloat16"):
            reader.read(large)
    else:
        assert reader.read(large).packed


def test_a_file_of_a_known_header_but_another_length_is_refused_by_the_checks(model, tmp_path):
    reader = AdapterReader(model, 64, torch.float32, page_numel=page_numel(model))
    reader.read(write_adapter(model, tmp_path / "good", torch.float32, seed=1))
    for name, cut in (("truncated", slice(0, -4)), ("longer", slice(None))):
        path = write_adapter(model, tmp_path / name, torch.float32, seed=2)
        data = (path / WEIGHTS_FILE).read_bytes()[cut]
        (path / WEIGHTS_FILE).write_bytes(data if name == "truncated" else data + b"\0" * 8)
        with pytest.raises(AdapterError, match="not a readable safetensors file") as error:
            reader.read(path)
        assert error.value.code is ErrorCode.ADAPTER_CORRUPT


def test_a_known_header_under_another_config_goes_through_the_checks(model, tmp_path):
    """The same tensors under an adapter_config.json that leaves layer 1 out: PEFT would not
    load layer 1's tensors, so the adapter is refused, as on a first read."""
    reader = AdapterReader(model, 64, torch.float32, page_numel=page_numel(model))
    reader.read(write_adapter(model, tmp_path / "good", torch.float32, seed=1))
    narrowed = write_adapter(model, tmp_path / "narrowed", torch.float32, seed=1, layers=[0])
    with pytest.raises(AdapterError, match=r"outside what adapter_config\.json targets"):
        reader.read(narrowed)
    assert reader.read(tmp_path / "good").packed


def test_the_engine_reads_an_adapter_of_a_known_header_into_its_pool_pages(
    tiny_llama, tiny_adapters
):
    """The engine's catalog reads with the pool's page size: the second file of a header comes
    laid out for the pool, which then loads that image as it is, and serves what PEFT does
    (tests/engine/test_adapters.py)."""
    engine = make_llm(tiny_llama).engine
    path = str(tiny_adapters["all-r2"])
    assert engine.catalog.read(path).packed == {}
    weights = engine.catalog.read(path)
    packed = weights.packed[(engine.pool.page_numel, engine.pool.data.dtype)]
    assert engine.adapters.pack(weights) is packed


@pytest.mark.parametrize(
    "rename",
    [
        ("layers.1.self_attn.q_proj.lora_A", "layers.1.mlp.q_proj.lora_A"),
        ("layers.1.self_attn.q_proj.lora_A", "layers.01.self_attn.q_proj.lora_A"),
        ("layers.1.self_attn.q_proj.lora_A", None),  # beside it, under mlp: a second name
    ],
    ids=["under another block", "a layer written 01", "one matrix under two names"],
)
def test_a_name_peft_gives_no_module_is_refused_on_every_read(model, tmp_path, rename):
    """Served, such a name would be a second name for one matrix, and which of the two got
    served could depend on the order a path takes them in."""
    from safetensors.torch import load_file, save_file

    reader = AdapterReader(model, 64, torch.float32, page_numel=page_numel(model))
    reader.read(write_adapter(model, tmp_path / "good", torch.float32, seed=1))
    path = write_adapter(model, tmp_path / "renamed", torch.float32, seed=1)
    tensors = load_file(path / WEIGHTS_FILE)
    old, new = (f"base_model.model.model.{part}.weight" if part else None for part in rename)
    if new is None:
        tensors[old.replace("self_attn", "mlp")] = tensors[old] + 1
    else:
        tensors[new] = tensors.pop(old)
    save_file(tensors, path / WEIGHTS_FILE)
    for read in (reader.read, lambda p: load_peft_adapter(p, model, 64, torch.float32)):
        for _ in range(2):
            with pytest.raises(AdapterError, match=r"no mlp\.q_proj|not a LoRA weight"):
                read(path)
