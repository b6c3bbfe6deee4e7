"""Every device-specific choice of the engine, made here and nowhere else.

Batched LoRA: the Triton kernels on CUDA; on CPU the native kernel (kernels/cpu/lora.c, built
with the machine's C compiler) for decode tokens, or, where it cannot be built, the torch path that
stacks decode tokens' adapters into batched matmuls (the Triton interpreter is for testing, far
too slow to serve).

On CPU, dense projections run through oneDNN with weights prepacked once at load time: on the 2-core
AVX-512 machines loraplex is developed on, that is 2-3x faster than the default BLAS path for the
32-to-256-row batches of a serving step, and still IEEE float32. In bfloat16, a decode step's
products (up to NATIVE_LINEAR_MAX_ROWS rows) go through the native kernel instead, on AMX tiles or
AVX512-BF16 dot products (choose_linear); with AMX, in its FMA build and on Zen 4 and 5, every
product does. In float32 on AMD's (Zen 2 to 5) and on Intel Xeons with AVX-512, a decode step's
products go through the native float32 kernel (on Zen 2 and 5 every product; IEEE products and sums,
in another order than oneDNN's). Anywhere else (CUDA, or a CPU build without oneDNN),
`torch.nn.functional.linear`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_lora, cpu_screen

if TYPE_CHECKING:
    from loraplex.engine.sampler import Argmax
    from loraplex.kernels.cpu_screen import ScreenedHead

LORA_BACKENDS = ("native", "torch", "triton", "reference")
# CPU flags meaning bfloat16 matrix products run natively (Intel AMX, AVX512-BF16 on Intel and
# AMD); without them bfloat16 is emulated and slower than float32.
_NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Zeros, on a CPU held in 2 MiB pages where Linux offers them (transparent huge pages, which
    most distributions give only to memory that asks, with madvise). The page pool is read row by
    row at scattered places (keys and values of each sequence, adapter rows): with 4 KiB pages
    nearly every row costs a TLB miss, with 2 MiB pages a whole stretch of the pool shares one."""
    if device != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype)
    start = tensor.data_ptr()
    low = -(-start // HUGE_PAGE) * HUGE_PAGE  # the whole 2 MiB pages inside the tensor
    high = (start + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if high > low:
        _libc().madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), _MADV_HUGEPAGE)
    return tensor.zero_()  # first touch after the advice: the kernel backs it with huge pages


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively, as the kernel reports it."""
    return any(flag in cpu_lora.cpu_flags() for flag in _NATIVE_BF16_FLAGS)


def choose_dtype(dtype: str, device: str) -> str:
    """A concrete dtype for "auto": bfloat16 where the device computes it natively (CUDA with
    bfloat16 support; a CPU with AMX or AVX512-BF16), else float16 on CUDA and float32 on CPU.
    Any other value is returned as it is."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def decode_attention_dtype(dtype: torch.dtype, device: str) -> torch.dtype:
    """The dtype decode attention computes in. On CPU always float32: torch's CPU attention
    kernel is several times slower in bfloat16 than in float32 for one query row per sequence
    (2.3 against 0.4 ms for 32 sequences of 128 tokens, 9 heads, on a Zen 5 with AVX512-BF16),
    and upcasting the gathered keys and values costs less than the difference."""
    return torch.float32 if device == "cpu" else dtype


def choose_lora_backend(
    device: str, override: str | None, dtype: torch.dtype = torch.float32
) -> str:
    """The configured backend, else: Triton on CUDA; on CPU the native kernel where it builds
    and takes `dtype`, else the torch path (also for "native" configured where it cannot be)."""
    if override is not None and override not in LORA_BACKENDS:
        raise ValueError(f"lora_backend must be one of {LORA_BACKENDS}, got {override!r}")
    if override not in (None, "native"):
        return override
    if override is None and device.startswith("cuda"):
        return "triton"
    kernel = cpu_lora.load()
    return "native" if kernel is not None and kernel.supports(dtype) else "torch"


def choose_attention_kernel(device: str, dtype: torch.dtype):
    """On CPU, the native decode attention kernel where it builds and takes `dtype` (it reads
    keys and values in place: no gather, no upcast copy, 2-3x faster than gathering for torch's
    attention); None elsewhere. LORAPLEX_TORCH_ATTENTION=1 keeps torch's."""
    if device != "cpu" or os.environ.get("LORAPLEX_TORCH_ATTENTION") == "1":
        return None
    kernel = cpu_lora.load_attention()
    return kernel if kernel is not None and kernel.supports(dtype) else None


def kernel_takes_prefill(dtype: torch.dtype) -> bool:
    """Whether the native attention kernel (where chosen) also runs prefill, each prompt token a
    query row over its sequence's pages up to itself: in bfloat16, where torch's CPU attention
    is slow for the short spans of chunked prefill (4 spans of 64 tokens, 9 heads over 3: 247
    against 652 us a layer on a Zen 5; one of 256 tokens after 768 cached: 2.9 against 4.6 ms).
    float32 keeps torch's, with which it is token-identical to transformers, and which the
    kernel does not beat there over all prompt lengths (SmolLM2 on a 2-core Zen 4, the same
    tokens either way: 32 prompts of 64 tokens 2.59 against torch's 2.79 s, 8 of 512 tokens
    6.50 against 6.07 s)."""
    return dtype == torch.bfloat16


def choose_ops(device: str, dtype: torch.dtype):
    """On CPU, in bfloat16 and float32, RMSNorm (alone or after the residual add), SwiGLU's
    product and the rotary embedding with the KV write each in one native call
    (cpu_lora.CpuOps; torch's bits in bfloat16 but for a rare rounding step, in float32 within a
    few units in the last place); None elsewhere. In float32 they were measured to keep the
    fidelity suite token-identical to transformers, as the native float32 projection, which
    sums in its own order too, does. A float32 decode step of 32 sequences on a 2-core Zen 4
    spent 17% of its samples in the torch ops these replace (py-spy)."""
    if device != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return None
    return cpu_lora.load_ops()


def choose_argmax(device: str) -> Argmax:
    """Greedy sampling's argmax over a step's logits [n, vocab] -> int64 [n] (the first of equal
    values), and its `greedy` (the picks and whether each row is finite, in one pass; None where
    it has none): on CPU the native kernel where it builds (torch's max with indices is a scalar
    loop there), else torch's."""
    kernel = cpu_lora.load_argmax() if device == "cpu" else None
    return kernel if kernel is not None else _TorchArgmax()


class _TorchArgmax:
    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        # max's indices are argmax's (the first best on a tie), in a third of the time on CPU
        return logits.max(dim=-1).indices

    def greedy(self, logits: torch.Tensor) -> None:
        return None  # the runner finds the rows that are not finite in a pass of its own


# Row count oneDNN tunes the packed layout for; any row count works.
_PACKING_ROWS_HINT = 64


# The most rows the native projection takes, unless it is as fast for any (bfloat16 with AMX, in
# its FMA build and on Zen 4 and 5: cpu_lora.CpuLinearBf16.any_rows; float32 on Zen 2 and 5:
# cpu_lora.CpuLinearF32.any_rows); more (prompt chunks) go to oneDNN, whose blocking wins there
# elsewhere (float32 on Zen 4: 256 rows 1.08-1.13x oneDNN's time, cpu_lora.CpuLinearF32).
NATIVE_LINEAR_MAX_ROWS = 32


def choose_linear(weight: torch.Tensor):
    """The native projection for a CPU weight, where it builds and runs natively for the weight's
    dtype: bfloat16 on a CPU with AMX or AVX512-BF16 (cpu_lora.CpuLinearBf16), float32 on AMD's
    (Zen 3, 4 and 5) and Intel with AVX-512 (cpu_lora.CpuLinearF32); None elsewhere.
    LORAPLEX_ONEDNN_LINEAR=1 keeps oneDNN's alone."""
    if weight.device.type != "cpu" or os.environ.get("LORAPLEX_ONEDNN_LINEAR") == "1":
        return None
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
        kernel = cpu_lora.load_linear()
    elif weight.dtype == torch.float32:
        kernel = cpu_lora.load_linear_f32()
    else:
        return None
    return kernel if kernel is not None and kernel.supports(weight.dtype) else None


def choose_screen(weight: torch.Tensor, head: Linear) -> ScreenedHead | None:
    """The greedy screen of an LM head (kernels/cpu_screen.py: each row's greedy token without
    all its float32 logits, the native float32 head's pick), where that head is native and the
    engine takes the screen by default (CpuScreenF32.by_default: Zen 3, and wherever its
    AVX512-VNNI tile builds). LORAPLEX_SCREEN=0 keeps the full head everywhere, =1 takes the
    screen wherever it builds (the tests do)."""
    choice = os.environ.get("LORAPLEX_SCREEN")
    if choice == "0" or head.native_packed is None or weight.dtype != torch.float32:
        return None
    screen = cpu_screen.load()
    if screen is None or not (screen.by_default or (choice == "1" and screen.native)):
        return None
    return screen.prepare(weight)


class Linear:
    """y = x W^T (+ b), with W stored however the device runs it fastest.

    Where choose_linear offers it, batches of up to NATIVE_LINEAR_MAX_ROWS rows (decode steps; in
    bfloat16 any batch with AMX, in its FMA build and on Zen 4 and 5, in float32 on Zen 2 and 5,
    where it is as fast or faster for all) go through the native projection, which makes the LoRA
    call after it in the same native call (`lora`) and, but with AMX, brings that call's adapter
    rows into cache while it computes (`fetch`); this keeps a second copy of W, packed for it,
    beside oneDNN's for larger batches, but where it takes every product and keeps the one copy.

    The lm_head, one pass over a vocabulary of rows, is such a projection too. At SmolLM2's 49,152
    x 576 and 32 rows, against oneDNN's: bfloat16 with AMX 1.74 against 2.09 ms on a 2-core Xeon,
    on Zen 4 4.8 against 5.3 ms, in the FMA build 347 against 215 GFLOP/s; on a 2-core Zen 5
    (family 26, model 2) 2.78 against 3.39 ms, faster at every decode batch of 1-32 rows, and a
    decode step of 32 sequences 1.03 ms shorter on the base model and 0.90 ms on 32 q,v adapters
    (the two lm_heads swapped step by step, medians of 60), where an earlier Zen 5 had measured
    oneDNN faster; float32 on a 2-core Zen 3 (family 25, model 1; AVX2) 19.9 against 23.2 ms
    (8.6 against 10.3 at 1 row), on Zen 4 10.1-12.8 against 13.1-14.7 ms, on Zen 5 4.39 against
    5.41 ms, on a Xeon with AVX512-FP16 10.9 against 13.9 ms, on a Cascade Lake Xeon 11.2 and
    14.1 against 12.3 and 16.3 ms."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias.contiguous() if bias is not None else None
        self.out_features, self.in_features = weight.shape
        self._packed = None
        self._native = choose_linear(weight)
        self._native_packed = self._native.pack(weight) if self._native is not None else None
        self.weight: torch.Tensor | None = weight
        # the native projection takes every product, of any shape (bfloat16 with AMX, in its
        # FMA build and on Zen 4 and 5; float32 on Zen 2 and 5)
        self._native_takes_all = self._native is not None and self._native.any_rows
        if self._native_takes_all:
            self.weight = None
        elif _use_onednn(weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_ROWS_HINT)
            self.weight = None  # the packed copy replaces it

    @property
    def native_packed(self) -> torch.Tensor | None:
        """W packed for the native projection (where it runs), as cpu/layers.c reads it too."""
        return self._native_packed

    def native(self, x: torch.Tensor) -> bool:
        """Whether the product of x goes through the native projection."""
        return x.dim() == 2 and self.native_rows(x.shape[0])

    def native_rows(self, rows: int) -> bool:
        """Whether the product of a 2-D input of `rows` rows goes through the native projection."""
        if self._native is None:
            return False
        return rows <= NATIVE_LINEAR_MAX_ROWS or self._native_takes_all

    def fetches(self, x: torch.Tensor) -> bool:
        """Whether the product of x takes a `fetch` (fetches_rows)."""
        return x.dim() == 2 and self.fetches_rows(x.shape[0])

    def fetches_rows(self, rows: int) -> bool:
        """Whether the product of a 2-D input of `rows` rows takes a `fetch`: wherever the native
        projection takes it and fetches. That is a decode step's, and where the native
        projection takes every product, a step's with a prompt chunk too: its decode tokens'
        rows would otherwise come from memory during the LoRA call, one adapter's after
        another's, while the chunk's products leave the memory bus idle (a prompt span reads its
        rows from memory once, then from cache). On a 2-core Zen 4 (family 25, model 17),
        bfloat16, a request arriving every step on 32 distinct adapters, each step a 64-token
        prompt beside about 31 decode tokens (benchmarks/mixed_steps.py, medians of 8 alternated
        runs of 120 steps): without this fetch 1.045x the time on all-module adapters, 1.013x on
        q,v ones."""
        return self.native_rows(rows) and self._native.fetches

    def fetches_decode_rows(self, rows: int) -> bool:
        """Whether the product of a 2-D input of `rows` rows takes a `fetch` and is
        decode-sized (NATIVE_LINEAR_MAX_ROWS rows at most)."""
        return self._decode_native(rows) and self._native.fetches

    def fetches_shrink_rows(self, rows: int) -> bool:
        """Whether the product of a 2-D input of `rows` rows, making its LoRA call in its own
        native call, may take a `fetch` of that call's A rows alone (cpu_lora.CpuLinearF32)."""
        return self._decode_native(rows) and self._native.fetches_shrinks

    @property
    def shrinks_first(self) -> bool:
        """Whether its steps fetch the A rows alone until timed (fetch_placement.py), where it
        can fetch either."""
        return self._native is not None and self._native.shrinks_first

    def _decode_native(self, rows: int) -> bool:
        """Whether a decode-sized product of `rows` rows goes through the native projection."""
        return self.native_rows(rows) and rows <= NATIVE_LINEAR_MAX_ROWS

    def __call__(
        self,
        x: torch.Tensor,
        fetch: cpu_lora.Fetch | None = None,
        lora: cpu_lora.BoundLoRA | None = None,
    ) -> torch.Tensor:
        if lora is not None and not self.native(x):
            raise ValueError("this projection of x does not take a LoRA call")
        if lora is not None or self._native_takes_all or self.native(x):
            native, packed, n = self._native, self._native_packed, self.out_features
            return native(x, packed, n, self.bias, fetch, lora)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _use_onednn(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and _onednn_linear_works(weight.dtype)


@functools.cache
def _onednn_linear_works(dtype: torch.dtype) -> bool:
    """Probe once per dtype: the ops are internal to torch, so fall back if they misbehave."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.randn(8, 16).to(dtype)
        x = torch.randn(3, 16).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_ROWS_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return torch.allclose(got.float(), F.linear(x, weight).float(), atol=1e-2, rtol=1e-2)
    except (RuntimeError, AttributeError):
        return False
