"""Builders for test models and engines (factories, not copy-pasted setup)."""

from __future__ import annotations

import contextlib
import random
import shutil
import threading
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from loraplex import LLM
from loraplex.engine.api import AsyncEngine

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

WORDS = (
    "the a river mountain city light dark cat dog runs sleeps quickly slowly green blue old new "
    "über café naïve 東京 日本語 😀 🚀 ünïcödé 42 7 3.14 hello world story tells of a king"
).split()


def cpu_flags() -> set[str]:
    """The flags this CPU reports (Linux)."""
    with open("/proc/cpuinfo") as cpuinfo:
        return set(next(line for line in cpuinfo if line.startswith("flags")).split())


def sample_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def build_tiny_tokenizer(out_dir: Path) -> Path:
    """A byte-level BPE trained in a second on generated text, with a chat template."""
    rng = random.Random(0)
    corpus = [sample_text(rng, 30) for _ in range(300)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(out_dir)
    return out_dir


_TINY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def build_tiny_model(out_dir: Path, family: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised checkpoint of `family` (llama, llama3, qwen2, mistral)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    common = dict(
        _TINY,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if family == "llama":
        config, model_class = LlamaConfig(**common, tie_word_embeddings=False), LlamaForCausalLM
    elif family == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        config = LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
        model_class = LlamaForCausalLM
    elif family == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True)
        model_class = Qwen2ForCausalLM
    elif family == "mistral":
        config = MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
        model_class = MistralForCausalLM
    else:
        raise ValueError(f"unknown tiny model family {family!r}")
    torch.manual_seed(seed)
    model = model_class(config)
    _spread_weights(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def _spread_weights(model: torch.nn.Module) -> None:
    # The default init (std 0.02) gives near-uniform logits where every step is a near-tie;
    # wider weights give a tiny model decisive, reproducible greedy choices. Biases (zero by
    # default) get values too, so that Qwen2's q/k/v bias is exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.25)


def make_llm(model_dir: Path, **options) -> LLM:
    """The engine as the fidelity suite runs it: float32 unless a test asks otherwise."""
    options.setdefault("memory_budget", "64MiB")
    options.setdefault("dtype", "float32")
    return LLM(model=str(model_dir), **options)


def build_adapter(
    base_dir: Path,
    out_dir: Path,
    rank: int,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    alpha: float | None = None,
    rslora: bool = False,
    seed: int = 0,
    std: float = 0.15,
    layers: list[int] | None = None,
) -> Path:
    """A PEFT LoRA adapter with random A and B (PEFT's own init leaves B zero, a no-op)."""
    from peft import LoraConfig, get_peft_model

    from tests.oracle import load_reference_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        target_modules=list(targets),
        use_rslora=rslora,
        layers_to_transform=layers,
        lora_dropout=0.0,
    )
    model = get_peft_model(load_reference_model(base_dir), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir)
    return out_dir


def poison_adapter(src: Path, out_dir: Path, value: float = 3e38) -> Path:
    """A copy of the adapter that passes validation (every weight finite, a sane scale) but
    whose lora_B entries are so large that its activations overflow to inf."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out_dir)
    weights = out_dir / "adapter_model.safetensors"
    tensors = load_file(weights)
    for name, tensor in tensors.items():
        if "lora_B" in name:
            tensors[name] = torch.full_like(tensor, value)
    save_file(tensors, weights)
    return out_dir


@contextlib.contextmanager
def wedged(engine: AsyncEngine):
    """Fault injection: the engine thread blocks inside its next step until released."""
    release = threading.Event()
    real_step = engine._engine.step

    def stuck_step():
        release.wait(timeout=30)
        return real_step()

    engine._engine.step = stuck_step
    try:
        yield
    finally:
        release.set()
        engine._engine.step = real_step
