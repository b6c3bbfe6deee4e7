"""The CPU kernels (the C files of kernels/cpu/): built once per machine with its own C compiler
into one library, loaded with ctypes. The LoRA kernel is called once per (layer, projection input,
group of runs): q, k and v in one call, gate and up in one; the attention kernel
(`CpuAttentionKernel`: decode tokens, and in bfloat16 prompt tokens too) once per layer, as are the
model's norms and rotary embedding (`CpuOps`); greedy sampling's argmax (`CpuArgmax`) once per step;
on CPUs with AMX or AVX512-BF16, a bfloat16 decode step's dense projections (`CpuLinearBf16`; every
product with AMX, in its FMA build and on Zen 4 and 5), and on AMD's and Intel's with AVX-512 a
float32 one's (`CpuLinearF32`; every product on Zen 2 and 5), each making the LoRA call after it in
the same native call and, but with AMX, bringing that call's adapter rows into cache while it
computes (`Fetch`); where every projection of a step is native, its decoder layers in one call
(`CpuDecoderLayers`); and, off the engine thread, an adapter's file converted into the pages of its
pool image as it is read (`CpuPacker`).

torch's own ops cannot read an adapter's rows in place for many adapters at once: the CPU path
either copies every row into a buffer first (index_select) or pays one small matmul per adapter,
and either way a decode step spends several times the memory-bandwidth floor on LoRA
(benchmarks/lora_floor.py prints both). This kernel streams each row from the pool once.

The library is compiled with `-march=native`, so it is cached under a key made of the source, the
compiler and the CPU's flags: a checkout moved to another CPU builds its own. No compiler, or a
failed build: `load()` returns None and the engine keeps the torch path (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("cpu")  # the C sources, each .c file into one library
SOURCES = tuple(sorted(KERNELS.glob("*.c")))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-lm")
MAX_RANK = 1024  # as in cpu/common.h; a larger rank takes the torch path
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_MODULES = 8  # outputs a call (cpu/common.h)
PACK_SOURCES = {"F32": 0, "BF16": 1, "F16": 2}  # CpuPacker's source dtypes, by safetensors' names
# a LoRA call: x, its row stride, y, its row stride, x's width, the LoRABinding (cpu/lora.h)
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
_ARGTYPES += [ctypes.c_void_p]


class LoRABinding(ctypes.Structure):
    """A LoRA call's arguments but x and y, as cpu/lora.h lays them out."""

    _fields_ = [
        ("start", ctypes.c_int64), ("end", ctypes.c_int64), ("modules", ctypes.c_int64),
        ("mods", ctypes.c_void_p), ("cols", ctypes.c_void_p), ("fouts", ctypes.c_void_p),
        ("pool", ctypes.c_void_p), ("a_rows", ctypes.c_void_p), ("b_rows", ctypes.c_void_p),
        ("mstride", ctypes.c_int64), ("slots", ctypes.c_void_p), ("r", ctypes.c_int64),
        ("scales", ctypes.c_void_p), ("num_threads", ctypes.c_int64),
    ]  # fmt: skip


def cache_dir() -> Path:
    root = os.environ.get("LORAPLEX_KERNEL_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(root or Path.home() / ".cache") / "loraplex" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first CPU's fields as the kernel reports them in /proc/cpuinfo (none where it does
    not): "vendor_id", "cpu family", "flags", ..."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first CPU's fields end at the first blank line
                name, _, value = line.partition(":")
                info[name.strip()] = value.strip()
    except OSError:
        pass
    return info


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags as the kernel reports them (none where it does not)."""
    return frozenset(cpu_info().get("flags", "").split())


def dpbf16_half_rate() -> bool:
    """Whether the CPU runs vdpbf16ps (bfloat16 pairs into float32) at half the rate of its
    float32 FMAs, so that bfloat16 products go faster widened to float32: Intel's cores with
    AVX512-BF16 and no AMX. On a 2-core Xeon (family 6, model 207, AMX not offered by its
    hypervisor): 0.46 vdpbf16ps a cycle against 1.9 FMAs, oneDNN's bfloat16 products at 160-220
    GFLOP/s against 270-410 in float32. AMD's Zen 4 and 5 run it at the FMAs' rate or better."""
    flags = cpu_flags()
    intel = cpu_info().get("vendor_id") == "GenuineIntel"
    return intel and "avx512_bf16" in flags and "amx_bf16" not in flags


def amd() -> bool:
    """Whether the CPU is AMD's."""
    return cpu_info().get("vendor_id") == "AuthenticAMD"


def amd_avx512() -> bool:
    """Whether the CPU is AMD's with AVX-512: Zen 4 (zen4) and Zen 5 (family 26)."""
    return amd() and "avx512f" in cpu_flags()


def zen4() -> bool:
    """Whether the CPU is AMD's Zen 4 (family 25 with AVX-512; Zen 3, also family 25, has none)."""
    return amd_avx512() and cpu_info().get("cpu family") == "25"


def zen5() -> bool:
    """Whether the CPU is AMD's Zen 5 (family 26 with AVX-512)."""
    return amd_avx512() and cpu_info().get("cpu family") == "26"


def zen3() -> bool:
    """Whether the CPU is AMD's Zen 3: family 25 without AVX-512 (Zen 4, also family 25, has it)."""
    return amd() and cpu_info().get("cpu family") == "25" and "avx512f" not in cpu_flags()


def zen2() -> bool:
    """Whether the CPU is AMD's Zen 2: family 23 from model 0x30 (Rome, Matisse, Renoir...); the
    family's earlier models are Zen and Zen+, whose FMA units are 128 bits wide."""
    info = cpu_info()
    model = info.get("model", "")
    return amd() and info.get("cpu family") == "23" and model.isdigit() and int(model) >= 0x30


def intel_avx512() -> bool:
    """Whether the CPU is Intel's with AVX-512: Xeons since Skylake-SP."""
    return cpu_info().get("vendor_id") == "GenuineIntel" and "avx512f" in cpu_flags()


def intel_fp16() -> bool:
    """Whether the CPU is Intel's with AVX512-FP16: Xeons since Sapphire Rapids."""
    return intel_avx512() and "avx512_fp16" in cpu_flags()


def amd_bf16() -> bool:
    """Whether the CPU is AMD's with AVX512-BF16 (Zen 4 and 5), where the native bfloat16
    projection outruns oneDNN's at every batch size: on a 2-core Zen 4 (family 25, model 17),
    SmolLM2's projections over 30 layers took 0.76-0.78x oneDNN's time at 32-33 rows and
    0.84-0.92x at 64-256 (benchmarks/prompt_projection.py), the lm_head's 49,152 x 576 at 32
    rows 4.8 against 5.3 ms. On a 2-core Zen 5 (family 26, model 2), 0.74x / 0.80x / 0.85x /
    0.88x / 0.93x at 32 / 64 / 96 / 128 / 256 rows, 0.97x and 0.96x at 512 and 1,024 (an earlier
    Zen 5 had measured oneDNN's faster from 64 rows, 256 rows 0.77x its speed, before the
    kernel's later changes); whole runs there (benchmarks/prompt_chunks.py --dtype bfloat16,
    medians of 6 alternated pairs) took 0.87x the time of the prompts alone on the base model
    and on 32 all-module adapters, 0.94x and 0.96x with 64 new tokens each (23 of 24 pairs
    lower), keeping 256 against 513 MiB of weights."""
    return amd_avx512() and "avx512_bf16" in cpu_flags()


def build_flags() -> tuple[str, ...]:
    """The compiler's flags for this machine: where dpbf16_half_rate, the FMA build
    (-DBF16_BY_FMA: the projection's and the LoRA shrink's bfloat16 products through float32
    FMAs, cpu/linear.c and cpu/lora.c); on Intel's Xeons (intel_avx512), Zen 3 and Zen 4,
    -DF32_FETCH_NEXT: the float32 decode attention fetches a thread's next sequence while it
    works on one, as the bfloat16 one does everywhere (cpu/attention.c); on Intel's Xeons and
    Zen 5, -DF32_TALL_TILE: the float32 projection's tiles are 8 rows by 48 columns, 4 by 96 on
    Zen 4 (cpu/linear_f32.c)."""
    flags = FLAGS + (("-DBF16_BY_FMA",) if dpbf16_half_rate() else ())
    if intel_avx512() or zen3() or zen4():
        flags += ("-DF32_FETCH_NEXT",)
    return flags + (("-DF32_TALL_TILE",) if intel_avx512() or zen5() else ())


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for source in sorted(KERNELS.glob("*.[ch]")):
        digest.update(source.name.encode() + source.read_bytes())
    digest.update(" ".join(build_flags()).encode())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    digest.update(version.stdout.encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())  # -march=native compiles for them
    return digest.hexdigest()[:16]


def compile_command(compiler: str, sources, target, flags=None) -> list[str]:
    """The command that builds the C `sources` into the shared library `target` with `flags`
    (None: this machine's, build_flags); the engine's library is SOURCES, benchmarks and tests
    build others."""
    flags = build_flags() if flags is None else flags
    return [compiler, *flags, *map(str, sources), "-o", str(target)]


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename: concurrent builders are safe."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            compile_command(compiler, SOURCES, tmp), check=True, capture_output=True, text=True
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels' library, built if needed; None where it cannot be built on this machine."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: decode uses the slower torch LoRA and attention paths")
        return None
    target = cache_dir() / f"cpu_kernels-{_build_key(compiler)}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("CPU kernels unavailable, using the torch paths: %s", detail.strip()[:500])
        return None


def _bind(lib: ctypes.CDLL, name: str, argtypes: list, restype, dtypes=_DTYPES) -> dict:
    """dtype -> the library's function `name_<dtype suffix>`, typed."""
    functions = {}
    for dtype, suffix in dtypes.items():
        function = getattr(lib, f"{name}_{suffix}")
        function.argtypes, function.restype = argtypes, restype
        functions[dtype] = function
    return functions


def _loader(kernel: type):
    """A cached `load()` of one kernel of the library; None where the library cannot be built."""

    @functools.cache
    def load():
        lib = library()
        return kernel(lib) if lib is not None else None

    return load


class _PerDtype:
    """A kernel with one function per storage dtype."""

    _functions: dict

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._functions


class Outputs:
    """Where a LoRA call's modules write: module rows[i] (a row of the a_rows / b_rows tables)
    onto columns columns[i] .. columns[i] + widths[i] of y. Made once per (adapter shape, layer,
    projection) and reused: a call then costs no tensor of its own."""

    def __init__(self, parts: list[tuple[int, int, int]]) -> None:
        if not 0 < len(parts) <= MAX_MODULES:
            raise ValueError(f"a call writes 1 to {MAX_MODULES} modules, got {len(parts)}")
        self.parts = tuple(parts)  # (table row, first column, width) of each module
        self.rows = torch.tensor([row for row, _, _ in parts], dtype=torch.int64)
        self.table_key = tuple(row for row, _, _ in parts)  # the table rows, as a dict key
        self.columns = torch.tensor([start for _, start, _ in parts], dtype=torch.int64)
        self.widths = torch.tensor([width for _, _, width in parts], dtype=torch.int64)
        self.pointers = (self.rows.data_ptr(), self.columns.data_ptr(), self.widths.data_ptr())
        self.count = len(parts)
        self.table_rows = max(row for row, _, _ in parts) + 1  # rows of the tables it reads
        self.end = max(start + width for _, start, width in parts)  # columns of y it writes


class CpuLoRAKernel(_PerDtype):
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._functions = _bind(lib, "lora_apply", _ARGTYPES, ctypes.c_int)

    def bind_layers(
        self,
        pool: torch.Tensor,
        a_rows: torch.Tensor,
        b_rows: torch.Tensor,
        slots: torch.Tensor,
        rank: int,
        scales: torch.Tensor,
        outputs: list[Outputs | None],
        start: int,
        end: int,
    ) -> list[BoundLoRA | None]:
        """For each layer i of the first len(outputs), the kernel on rows start..end of x and y,
        as a call of (x, y) alone (None where outputs[i] is None):
        y[t, cols_j] += scales[s] * (x[t] @ A_s,j^T) @ B_s,j
        for each of those rows t and every output j of outputs[i], s = slots[t - start], with
        run s's rows of module row m at a_rows[i, m, s*rank : (s+1)*rank] and b_rows[...] in
        the flat pool (int64 [layers, module rows, n], rows contiguous, as is slots); scales
        float32 [runs]; x, y (2-D, unit column stride) and pool of one dtype.

        Everything but x and y is checked and converted here, once: the engine binds a group's
        calls for every layer once per batch composition and calls them every step (with the
        rows in cache, a q,v call of 32 tokens takes about 15 us in C; checking and converting
        its arguments, and slicing the rows, took about 5 us more each time). The tables are
        checked once for all layers, and no view of a layer's is made: bound a layer at a time
        in a step (120 calls on all-module adapters), binding took about 16 us a call, more than
        in a loop of its own, with the caches cold after the step before."""
        if a_rows.dim() != 3 or len(outputs) > a_rows.shape[0]:
            raise ValueError("the row tables need a layer each, and outputs for layers in them")
        if rank > MAX_RANK:
            raise ValueError(f"the CPU LoRA kernel takes ranks up to {MAX_RANK}, got {rank}")
        if a_rows.stride(-1) != 1 or slots.numel() != end - start:
            raise ValueError("the row tables need unit column stride, and one slot a row")
        if any(o is not None and o.table_rows > a_rows.shape[1] for o in outputs):
            raise ValueError("the outputs do not fit the row tables")
        if a_rows.shape != b_rows.shape or a_rows.stride() != b_rows.stride():
            raise ValueError("a_rows and b_rows differ in layout")
        function, held = self._functions[pool.dtype], (pool, a_rows, b_rows, slots, scales)
        step = layer_stride(a_rows)  # b_rows' too (the same layout)
        a_at, b_at = a_rows.data_ptr(), b_rows.data_ptr()
        tables = (a_rows.stride(1), pool.data_ptr(), slots.data_ptr(), rank, scales.data_ptr())
        threads = torch.get_num_threads()
        calls: list[BoundLoRA | None] = []
        for i, o in enumerate(outputs):
            at = (a_at + i * step, b_at + i * step, *tables)
            args = (function, pool.dtype, (*held, o), o, start, end, threads, *at)
            calls.append(None if o is None else BoundLoRA(*args))
        return calls


def layer_stride(rows: torch.Tensor) -> int:
    """Bytes from one layer's row table to the next's: what a call bound for one layer
    (CpuLoRAKernel.bind_layers) moves by to be the next layer's (StridedProjection)."""
    return rows.stride(0) * rows.element_size()


class BoundLoRA:
    """A call of CpuLoRAKernel.bind_layers: the kernel on rows start..end of x and y, its other
    arguments converted once into one LoRABinding (and their tensors held as long as the
    call)."""

    def __init__(
        self, function, dtype, held, outputs, start, end, threads, a_rows, b_rows, mstride, pool,
        slots, rank, scales,
    ) -> None:  # fmt: skip
        """The call on the tables at the addresses given (a_rows, b_rows, their module stride,
        the pool, slots, scales), whose tensors `held` holds."""
        self._function, self._dtype = function, dtype
        self._end, self._columns = end, outputs.end
        self._tensors = held  # the tensors the binding points into, alive as long as the call
        self._binding = LoRABinding(
            start, end, outputs.count, *outputs.pointers, pool, a_rows, b_rows, mstride, slots,
            rank, scales, threads,
        )  # fmt: skip
        self.binding = ctypes.addressof(self._binding)  # what the kernels take
        self.empty = end == start

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.takes(x, y):
            self._function(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1],
                           self.binding)  # fmt: skip

    def takes(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether the call has rows to take on (x, y); raises if x and y do not fit it."""
        if x.stride(1) != 1 or y.stride(1) != 1:
            raise ValueError("x and y need unit column stride")
        self.check_fits(min(x.shape[0], y.shape[0]), y.shape[1], x.dtype, y.dtype)
        return not self.empty

    def check_fits(self, rows: int, columns: int, *dtypes: torch.dtype) -> None:
        """Raises unless x and y of `rows` rows, y of `columns` columns and of `dtypes` fit it."""
        if rows < self._end:
            raise ValueError("x and y need the bound rows")
        if columns < self._columns or any(dtype != self._dtype for dtype in dtypes):
            raise ValueError("the outputs do not fit y, or x, y and the pool differ in dtype")


_ATTENTION_ARGTYPES = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
_ATTENTION_ARGTYPES += [ctypes.c_void_p]
_ATTENTION_ARGTYPES += [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]


class CpuAttentionKernel(_PerDtype):
    """Attention of one query row per token (decode tokens; prompt tokens too where the engine
    asks), reading keys and values in place from their pages (cpu/attention.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._functions = _bind(lib, "attend_decode", _ATTENTION_ARGTYPES, ctypes.c_int)

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [n, heads, dim] -> [n, heads, dim]: each row attends to the first lens[i] slots of
        the pages tables[i] (int64 [n, max_pages], contiguous; lens int64 [n], each >= 1) of
        kv_cache [pages, page_size, 2, kv_heads, dim] (each page contiguous, pages any stride
        apart: a layer's view of the pool, as KVCacheManager.layer_cache gives it); q and
        kv_cache of one dtype."""
        q = q.contiguous()
        out = torch.empty_like(q)
        n, heads, dim = q.shape
        status = self._functions[q.dtype](
            q.data_ptr(), out.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), n, heads, kv_cache.shape[3], dim,
            kv_cache.shape[1], scale, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"the CPU attention kernel cannot take this shape (status {status})")
        return out


class CpuOps(_PerDtype):
    """Small per-layer ops of a bfloat16 or float32 model, each one native call instead of
    several torch ops (cpu/ops.c): RMSNorm, alone or after the residual add; SwiGLU's product;
    and the rotary embedding with the KV write. In bfloat16 the bits of the torch ops but for a
    rare rounding step (RMSNorm 12 against 32 us for 32 rows of 576; it sums a row in its own
    order, which moves an element by one rounding step now and then: 3 of 172,800 in one test;
    the rotary embedding and KV write 1.1 against 2.0 ms a decode step of 32 sequences). In
    float32 the rotary embedding's bits, the norm's and SwiGLU's within a few units in the last
    place (the norm's sum of squares in another order, the exp a series)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        norm = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
        self._norm = _bind(lib, "rms_norm", norm, None)
        add_norm = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
        self._add_norm = _bind(lib, "add_rms_norm", add_norm, None)
        swiglu = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int]
        self._silu_mul = _bind(lib, "silu_mul", swiglu, None)
        rope = [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 2
        rope += [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
        rope += [ctypes.c_void_p] * 2 + [ctypes.c_int]
        self._rope = _bind(lib, "rope_write", rope, ctypes.c_int)
        self._functions = self._rope  # what supports() asks: each op has both dtypes

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [n, dim] (made contiguous), weight [dim], both bfloat16 or both float32 -> [n, dim].
        The reference's torch ops (in float32, the normalized row rounded to the dtype, then
        times the weight, rounded)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self._norm[x.dtype](
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """hidden += delta (both [n, dim], contiguous, of the weight's dtype; hidden in place) ->
        RMSNorm of the sum, as `rms_norm` gives it."""
        if not (hidden.is_contiguous() and delta.is_contiguous()):
            raise ValueError("hidden and delta must be contiguous")
        out = torch.empty_like(hidden)
        self._add_norm[hidden.dtype](
            hidden.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
            hidden.shape[0], hidden.shape[1], eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [n, 2 * inter] (unit column stride) -> silu(gate) * up [n, inter]: in
        bfloat16 the bits of torch's silu and multiply (but where the exp's series and torch's
        differ across a rounding boundary: none in the tests' 1.4 million values)."""
        if gate_up.stride(1) != 1:
            raise ValueError("gate_up needs unit column stride")
        n, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(n, inter, dtype=gate_up.dtype)
        self._silu_mul[gate_up.dtype](
            gate_up.data_ptr(), gate_up.stride(0), n, inter, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rotate_and_write(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_pages: torch.Tensor,
        slot_offsets: torch.Tensor,
    ) -> torch.Tensor:
        """qkv [n, (heads + 2 * kv_heads) * dim] (unit column stride) -> q [n, heads, dim]
        rotated; k rotated and v written to slot (slot_pages[i], slot_offsets[i]) of kv_cache
        [pages, page_size, 2, kv_heads, dim] (each page contiguous). cos, sin [max_positions,
        dim] tables, contiguous, of qkv's dtype (bfloat16 or float32), as kv_cache; positions,
        slot_pages, slot_offsets int64 [n], contiguous. The same bits as RotaryEmbedding.rotate
        and write_kv."""
        n, dim = qkv.shape[0], cos.shape[1]
        if qkv.stride(1) != 1 or qkv.shape[1] != (heads + 2 * kv_heads) * dim:
            raise ValueError("qkv must be [n, (heads + 2 * kv_heads) * dim], unit column stride")
        q = torch.empty(n, heads, dim, dtype=qkv.dtype)
        status = self._rope[qkv.dtype](
            qkv.data_ptr(), qkv.stride(0), n, heads, kv_heads, dim, cos.data_ptr(),
            sin.data_ptr(), cos.shape[0], positions.data_ptr(), q.data_ptr(),
            kv_cache.data_ptr(), kv_cache.stride(0), slot_pages.data_ptr(),
            slot_offsets.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"a position is past the rotary table's {cos.shape[0]}")
        return q


class CpuArgmax(_PerDtype):
    """Greedy sampling's pick over float32 or bfloat16 logits (cpu/ops.c): the indices
    torch.max(dim=-1) gives (the first of equal values, a row's first NaN), where torch's is a
    scalar loop; with `greedy`, also whether each row is finite, from the same pass.
    It takes rows of fewer than 2**31 logits (its lanes count in int32)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int]
        self._functions = _bind(lib, "argmax_rows", argtypes, None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, vocab] -> int64 [n]; other dtypes and layouts (and empty rows) go to torch."""
        if not self._takes(logits):
            return logits.max(dim=-1).indices
        return self._pick(logits, None)

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[n, vocab] -> (the picks, int64 [n]; whether each row is all finite, bool [n]), or
        None for logits it does not take."""
        if not self._takes(logits):
            return None
        finite = torch.empty(logits.shape[0], dtype=torch.bool)
        return self._pick(logits, finite), finite

    def _takes(self, logits: torch.Tensor) -> bool:
        return (
            self.supports(logits.dtype) and logits.dim() == 2 and logits.stride(1) == 1
            and 0 < logits.shape[1] < 2**31
        )  # fmt: skip

    def _pick(self, logits: torch.Tensor, finite: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._functions[logits.dtype](
            logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
            out.data_ptr(), finite.data_ptr() if finite is not None else None,
            torch.get_num_threads(),
        )  # fmt: skip
        return out


class CpuPacker(_PerDtype):
    """An adapter's matrices from its safetensors bytes into a pool image (cpu/pack.c), in one
    call off the Python lock: each row of `table` [entries, 7] int64 is a run of a matrix's rows
    (source byte offset, source dtype as PACK_SOURCES numbers it, the source's element strides
    between rows and between columns, rows, columns, element offset in the image). Images of
    float32 and bfloat16 pages."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self._functions = _bind(lib, "pack_matrices", argtypes, ctypes.c_int64)

    def __call__(self, data: bytes, image: torch.Tensor, table: torch.Tensor) -> int:
        """Writes the runs into `image` (contiguous); the first entry holding a value that is
        not finite in the image's dtype, or -1. The table's offsets must lie inside both."""
        assert image.is_contiguous() and table.dtype == torch.int64 and table.is_contiguous()
        function = self._functions[image.dtype]
        return function(data, image.data_ptr(), table.data_ptr(), table.shape[0])


class Fetch:
    """Memory ranges for a dense projection to bring into cache while it computes: addresses
    and lengths in bytes (int64, contiguous), split between the threads in order."""

    def __init__(self, at: torch.Tensor, nbytes: torch.Tensor) -> None:
        self.at, self.bytes, self.count = at.contiguous(), nbytes.contiguous(), at.numel()
        self.pointers = (self.at.data_ptr(), self.bytes.data_ptr(), self.count)

    def __bool__(self) -> bool:
        return self.count > 0


_NO_FETCH = (None, None, 0)


class LayerFetch:
    """Memory ranges of every layer: addresses at [layers, fetches] (int64, rows contiguous)
    and their lengths in bytes nbytes [fetches], the same in every layer."""

    def __init__(self, at: torch.Tensor, nbytes: torch.Tensor) -> None:
        if at.dim() != 2 or at.stride(1) != 1 or nbytes.shape != at.shape[1:]:
            raise ValueError("a layer's addresses a row, rows contiguous, and a length each")
        self.at, self.bytes = at, nbytes.contiguous()


class _NativeLinear(_PerDtype):
    """A dense projection of the library's (y = x W^T (+ b) with W packed once) in one dtype,
    where it runs natively: `fetches`, whether it takes memory ranges to bring into cache
    meanwhile; `fetches_shrinks`, whether it may take only those of the A rows of the LoRA call it
    makes itself (whose shrinks go between its items), and `shrinks_first`, whether it does
    until the engine has timed both (fetch_placement.py); `any_rows`, whether it is the faster
    projection for any number of rows, not for decode steps only. Wherever it runs, it also
    makes the LoRA call after it in the same native call."""

    dtype: torch.dtype
    fetches = fetches_shrinks = shrinks_first = any_rows = False

    def __init__(self, lib: ctypes.CDLL, native: bool) -> None:
        argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64]
        argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
        argtypes += [ctypes.c_int64, ctypes.c_int]
        one = {self.dtype: _DTYPES[self.dtype]}
        self._functions = _bind(lib, "linear", argtypes, ctypes.c_int, one) if native else {}
        fused = [*argtypes[:-1], ctypes.c_void_p]  # the projection's but its threads, a binding
        self._fused = _bind(lib, "linear_lora", fused, ctypes.c_int, one) if native else {}
        numel = [ctypes.c_int64] * 2
        pack = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        if native:  # a build without the projection may not have these either (float32's)
            self._numel = _bind(lib, "linear_packed_numel", numel, ctypes.c_int64, one)[self.dtype]
            self._pack = _bind(lib, "linear_pack", pack, ctypes.c_int, one)[self.dtype]

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [n, k] of the projection's dtype -> its packed copy, 1-D."""
        n, k = weight.shape
        if weight.dtype != self.dtype or (self.dtype == torch.bfloat16 and k % 2):
            raise ValueError(f"the packed projection takes a {self.dtype} [n, k], k even in bf16")
        weight = weight.contiguous()
        packed = torch.empty(self._numel(n, k), dtype=self.dtype)
        if self._pack(weight.data_ptr(), n, k, packed.data_ptr()) != 0:
            raise ValueError("the packed projection does not run here")
        return packed

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        fetch: Fetch | None = None,
        lora: BoundLoRA | None = None,
    ) -> torch.Tensor:
        """x [..., k] -> [..., n] of the projection's dtype; the memory ranges of `fetch` (only
        where `fetches`) brought into cache meanwhile; then the LoRA call `lora` on (x, y) in
        the same native call (x 2-D)."""
        flat = x.dim() == 2  # a decode step's rows: no reshaping either way (about 1.5 us)
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        rows, k = x2.shape
        y = torch.empty(rows, n, dtype=self.dtype)
        if rows:
            projection = (
                x2.data_ptr(), x2.stride(0), rows, k, packed.data_ptr(), n,
                bias.data_ptr() if bias is not None else None, y.data_ptr(), n,
                *(fetch.pointers if fetch else _NO_FETCH),
            )  # fmt: skip
            if lora is not None and lora.takes(x2, y):
                status = self._fused[self.dtype](*projection, lora.binding)
            else:
                status = self._functions[self.dtype](*projection, torch.get_num_threads())
            if status != 0:
                raise ValueError(f"the packed projection cannot run here ({status})")
        return y if flat else y.view(*x.shape[:-1], n)


class CpuLinearBf16(_NativeLinear):
    """bfloat16 dense projections on CPUs with AMX or AVX512-BF16 (cpu/linear.c). It supports
    bfloat16 only where the library was compiled for either (and, with AMX, Linux grants the
    tiles), and nothing elsewhere. It fetches but with AMX, where the products are bound by
    memory themselves; it takes any rows with AMX, in its FMA build, and on Zen 4 and 5
    (amd_bf16)."""

    dtype = torch.bfloat16

    def __init__(self, lib: ctypes.CDLL) -> None:
        native = bool(lib.linear_native_bf16())
        super().__init__(lib, native)
        self.fetches = native and bool(lib.linear_fetches_bf16())
        self.any_rows = native and (bool(lib.linear_any_rows_bf16()) or amd_bf16())


class CpuLinearF32(_NativeLinear):
    """float32 dense projections for decode steps (cpu/linear_f32.c), in the builds with
    AVX-512 or AVX2 and FMA, where they were measured faster than oneDNN's
    (benchmarks/prompt_projection.py --dtype float32, SmolLM2's projections over 30 layers at 32
    rows):
    - on AMD's (amd), where it fetches the LoRA call's rows meanwhile: all of them, or only the A
      rows of the call it makes itself (fetches_shrinks), as the engine times them step by step
      (fetch_placement.py), the A rows alone first on Zen 3 (shrinks_first, as on Intel with
      AVX512-FP16 below) from the figures here.
      Zen 3 (a 2-core EPYC, family 25, model 1; the AVX2 build): 0.70x oneDNN's time at 32 rows,
      0.80x at 64; whole decode steps (benchmarks/projection_ab.py, medians of 30 rounds) of
      170.8 against oneDNN's 232.1 ms on 32 q,v adapters and 202.5 against 270.1 ms on 32
      all-module ones, with the fetch; without it 172.0 and 208.5 ms, fetching the A rows alone
      170.6 and 206.3 ms. On a slower Zen 3 host (memory read at 16-26 GB/s), extra over base
      fetching the A rows alone against all the rows: q,v 8.66 and 7.36 against 11.20 and 11.45
      ms, all-module 30.49 and 32.78 against 42.89 and 36.15 ms (fetching nothing: q,v 4.49 and
      11.96, all-module 35.43 and 38.10 ms). Zen 2
      (a 2-core EPYC, family 23, model 49; the AVX2 build): 0.74x oneDNN's time at 32 rows, and
      whole decode steps of 99.7 and 103.3 against oneDNN's 134.7 and 129.1 ms on 32 q,v
      adapters, 115.2 against 151.6 ms on 32 all-module ones, with the fetch; extra over base
      14.1 ms all-module against 25.5 without it and 18.8 fetching the A rows alone, on q,v
      5.9 and 6.9 against 6.0 and 6.7 without, 4.1 and 6.0 fetching the A rows alone. Zen 4,
      0.80x oneDNN's time; Zen 5 (a 2-core EPYC, family 26, model 2), 0.78x at 32 rows and
      0.80x at 64, and whole decode steps (benchmarks/projection_ab.py, medians of 30-40 rounds)
      of 42.27 against oneDNN's 53.66 ms on 32 q,v adapters and 50.64 against 62.16 ms on 32
      all-module ones, with the fetch; without it 43.03 and 51.75 ms, fetching the A rows alone
      43.28 and 51.45 ms;
    - on Intel with AVX512-FP16 (intel_fp16; a 2-core Xeon, family 6, model 207): 0.78x with tiles
      of 4 by 96, 0.68x at 32 rows and 0.74x at 64 with 8 by 48 (level at 256); it fetches only the
      A rows of the LoRA call it makes itself there until timed (shrinks_first), spread over the
      whole projection, ahead of the shrinks (in its second half when the figures here were taken;
      now at the fetch's own pace, two tokens behind: linear_f32.c; against the old pace on such a
      Xeon, benchmarks/kernel_ab.py --dtype float32 --against e401e57, q,v -2.14 and -0.11 ms,
      all-module -1.62 ms). In decode steps of 32 sequences on 32 adapters, all the call's rows made
      the step slower (q,v +3.2 ms, all-module +7.0 ms of 110-140 ms, engines stepped in turn), and
      so, on q,v, did its B rows alone (+0.17 ms over the whole projection, +0.76 ms over its second
      half) and its A rows over the first half alone (+1.46 ms; scratch builds against the one
      without, benchmarks/kernel_ab.py). The A rows over all of it: q,v extra over base 5.44, 5.88
      and 5.44 against 6.40, 6.54 and 6.56 ms in three such runs (medians; paired medians of the
      differences -0.55, +0.13 and -1.03 ms), and in the engine with the fetch on and off step by
      step 0.84 and 0.53 ms less (paired medians of 60); all-module level (-0.08, +0.44, -0.27 and
      +0.35 ms, paired medians).
    - on Intel's other CPUs with AVX-512 (intel_avx512; a 2-core Xeon, family 6, model 85,
      Cascade Lake): 0.86x, 0.89x and 0.99x in three runs; it fetches nothing there. Whole
      steps of 32 sequences on 32 adapters (benchmarks/projection_ab.py, engines stepped in
      turn, medians of 30 rounds) took 129.3 against oneDNN's 140.9 ms on q,v and 154.0
      against 176.1 ms all-module; extra over base 6.77 and 44.18 ms, where fetching all the
      call's rows gave 12.29 and 62.45 ms, and its A rows alone 10.96 and 50.61 ms. The Xeon of
      model 207 whose hypervisor offers neither AVX512-FP16 nor AVX512-BF16 nor AMX lands here
      too, and measured the same order on 32 q,v adapters: extra over base 5.55 ms fetching
      nothing, 6.16 fetching the A rows alone, 8.20 fetching all the rows (medians of 30).
    Prompt chunks keep oneDNN's (256 rows on Zen 4: 1.08-1.13x its time by the median of 15
    passes, 0.96x by the best of 7; on Zen 3, 1.13x / 1.23x / 1.13x at 128 / 256 / 512 rows by
    the best of 7, and on a faster Zen 3, where this projection was the faster alone at every
    size, whole prefills took 1.09x the time on the base model and 1.12x on 32 adapters with it:
    benchmarks/prompt_chunks.py), but on Zen 2 (zen2), where this projection takes batches of
    any size (`any_rows`) and the model keeps no oneDNN copy of its weights: there it took
    0.77-0.93x oneDNN's time at 33-512 rows (0.89-0.91x at a prompt chunk's 256). On the
    prompts of benchmarks/side_by_side.py (32 of 64 tokens, 256 a chunk), runs of one new token
    each took 0.92x the time on the base model and 0.96x on 32 all-module adapters, engines
    alternated (medians of 3); whole runs of 64 new tokens gave the same tokens, 1.01x the
    throughput, in 566 MiB less memory (1,511 against 2,077 MiB resident after loading
    SmolLM2). On Zen 5 (zen5) too, with the 8 by 48 tile (family 26, model 2): 0.70x / 0.80x /
    0.89x / 0.97x oneDNN's time at 32 / 64 / 128 / 256 rows, 1.05x and 1.04x at 512 and 1,024
    (best of 7); on the same prompts, paired runs of each engine (prompt_chunks.py --rounds 6)
    took 0.82-0.98x the time in 11 of 12 prefills (medians 0.97x on the base model, 0.98x on 32
    all-module adapters), and whole runs 0.961-1.084x (medians level: 0.99x and 1.01x), the
    same tokens, keeping 513 against 1,026 MiB of weights. With `any_cpu`, wherever the build
    has it, fetching (the tests and benchmarks/prompt_projection.py measure it so)."""

    dtype = torch.float32

    def __init__(self, lib: ctypes.CDLL, any_cpu: bool = False) -> None:
        native = bool(lib.linear_native_f32()) and (any_cpu or amd() or intel_avx512())
        super().__init__(lib, native)
        self.fetches = self.fetches_shrinks = native and (any_cpu or amd() or intel_fp16())
        self.shrinks_first = self.fetches and (intel_fp16() or zen3())
        self.any_rows = native and (zen2() or zen5())


class DecoderLayer(ctypes.Structure):
    """One layer as cpu/layers.c takes it: its packed projections (the q,k,v bias or NULL), the
    norm after attention, the next layer's input norm (NULL after the last) and its KV cache."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "qkv", "qkv_bias", "o", "gate_up", "down", "post_attention_norm",
            "next_input_norm", "kv",
        )
    ]  # fmt: skip


class DecoderShape(ctypes.Structure):
    """The model's shapes, KV page layout and rotary tables, as cpu/layers.c takes them."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in (
            "hidden", "heads", "kv_heads", "dim", "inter", "page_size", "page_stride",
            "max_positions",
        )),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
    ]  # fmt: skip


class DecoderStep(ctypes.Structure):
    """A step's rows (positions, KV slots, attention tables) and its buffers, as cpu/layers.c
    takes them."""

    _fields_ = [
        ("m", ctypes.c_int64), ("table_stride", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in (
            "positions", "slot_pages", "slot_offsets", "tables", "lens", "x", "hidden", "qkv",
            "q", "attended", "o", "gate_up", "act", "down",
        )),
    ]  # fmt: skip


class StepProjection(ctypes.Structure):
    """What a projection does in a step besides its product, as cpu/layers.c takes it: its LoRA,
    one call in its own native call (a LoRABinding's address, or None) or `calls` calls after
    it (`after`, an array of their addresses), and the memory ranges it fetches meanwhile
    (Fetch.pointers, or none)."""

    _fields_ = [
        ("lora", ctypes.c_void_p), ("after", ctypes.c_void_p), ("calls", ctypes.c_int64),
        ("fetch_at", ctypes.c_void_p), ("fetch_bytes", ctypes.c_void_p),
        ("fetches", ctypes.c_int64),
    ]  # fmt: skip

    @classmethod
    def of(
        cls, lora: BoundLoRA | None, after: ctypes.Array | None, fetch: Fetch | None
    ) -> StepProjection:
        """`lora`, none where it has no rows (as _NativeLinear makes none); `after`, an array of
        the non-empty calls' bindings (after_calls); `fetch`: all held by the caller as long as
        the structure is used."""
        binding = lora.binding if lora is not None and not lora.empty else None
        calls = len(after) if after is not None else 0
        after_at = ctypes.addressof(after) if calls else None
        return cls(binding, after_at, calls, *(fetch.pointers if fetch else _NO_FETCH))


def after_calls(calls: Iterable[BoundLoRA]) -> ctypes.Array:
    """The bindings of the calls with rows, in order, for StepProjection.of."""
    bindings = [call.binding for call in calls if not call.empty]
    return (ctypes.c_void_p * len(bindings))(*bindings)


class LayerLoRA(ctypes.Structure):
    """A layer's projections in a step with adapters, as cpu/layers.c takes them."""

    _fields_ = [(name, StepProjection) for name in ("qkv", "o", "gate_up", "down")]


class StridedFetch(ctypes.Structure):
    """Memory ranges of every layer, as cpu/layers.c takes them: layer i's `fetches` ranges
    start at at + i * stride (in ranges), their lengths the same in every layer."""

    _fields_ = [("at", ctypes.c_void_p), ("bytes", ctypes.c_void_p)]
    _fields_ += [("fetches", ctypes.c_int64), ("stride", ctypes.c_int64)]

    @classmethod
    def of(cls, fetch: LayerFetch | None) -> StridedFetch:
        """`fetch`'s ranges (none for None), held by the caller as long as the structure."""
        if fetch is None:
            return cls(None, None, 0, 0)
        at, nbytes = fetch.at, fetch.bytes
        return cls(at.data_ptr(), nbytes.data_ptr(), at.shape[1], at.stride(0))


class StridedProjection(ctypes.Structure):
    """A projection's LoRA in every layer, as cpu/layers.c takes it: one call in the
    projection's own native call (layer 0's binding, or None), layer i's with its row tables
    rows_stride bytes on per layer, and the ranges it fetches meanwhile."""

    _fields_ = [("lora", ctypes.c_void_p), ("rows_stride", ctypes.c_int64)]
    _fields_ += [("fetch", StridedFetch)]


class StridedLoRA(ctypes.Structure):
    """A step's LoRA where each projection's is the same in every layer but for where its
    tables and ranges are, as cpu/layers.c takes it; with `ahead` ranges, each layer's gate_up
    fetches the next layer's and that q,k,v projection none of its own."""

    _fields_ = [(name, StridedProjection) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [("ahead", StridedFetch)]


class CpuDecoderLayers(_PerDtype):
    """A bfloat16 or float32 step's decoder layers in one native call (cpu/layers.c): the calls
    CausalLM.forward otherwise makes one by one, with the same bits."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_int]
        self._functions = _bind(lib, "decode_layers", argtypes, ctypes.c_int)

    def __call__(
        self, dtype: torch.dtype, layers, shape: DecoderShape, step: DecoderStep, lora=None
    ) -> None:
        """Runs `layers` (a ctypes array of DecoderLayer, of `dtype`) on `step`, with `lora`: an
        array of LayerLoRA as long, a StridedLoRA for every layer, or None (no adapters); raises
        ValueError where a call refused (a position past the rotary table, a shape a kernel does
        not take)."""
        strided = isinstance(lora, StridedLoRA)
        if lora is not None and not strided and len(lora) != len(layers):
            raise ValueError("one LayerLoRA a layer")
        at = ctypes.addressof(lora) if lora is not None else None
        status = self._functions[dtype](
            ctypes.addressof(layers), len(layers), ctypes.addressof(shape),
            ctypes.addressof(step), None if strided else at, at if strided else None,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"the native decoder layers cannot run this step ({status})")


load = _loader(CpuLoRAKernel)
load_attention = _loader(CpuAttentionKernel)
load_ops = _loader(CpuOps)
load_argmax = _loader(CpuArgmax)
load_packer = _loader(CpuPacker)
load_decoder_layers = _loader(CpuDecoderLayers)
load_linear = _loader(CpuLinearBf16)
load_linear_f32 = _loader(CpuLinearF32)
