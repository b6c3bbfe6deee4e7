"""Greedy picks without all of a step's float32 logits (cpu/screen_f32.c): every token's logit
screened in 8-bit integers with a proven bound on the screen's error, and computed in float32,
as the packed LM head computes it, only where the bound cannot rule the token out. The pick is
the full head's and argmax's, ties included.

Why: in a float32 decode step of 32 sequences on SmolLM2 the LM head (49,152 x 576) is about a
fifth of the step on a 2-core Zen 3. There the screen and its picks took 0.72-0.75x the time of
the native head and argmax on 32 rows (0.28x on one), and decode steps of 32 sequences were
4.5-5.4 ms shorter (benchmarks/greedy_screen.py; docs/performance.md, "Zen 3: the LM head
screened in 8-bit integers"). Its integer products went at about the rate of float32 FMAs there,
not twice it: it wins by running near that rate where the float32 head runs at about half of it.
With AVX512-VNNI one instruction makes 64 products and adds them: on a 2-core Xeon with AMX in
float32 the screen took 0.51-0.56x the time of the head and argmax on 32 rows, and decode steps of
32 sequences were 3.9-4.5 ms shorter (docs/performance.md, "The screen through AVX512-VNNI"),
where the AVX2 tile, which CPUs with AVX-512 but not VNNI have, took 1.19x.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from loraplex.kernels import cpu_lora


class CpuScreenF32:
    """The library's screen, where it runs (the AVX2 and AVX-512 builds, beside the float32
    projection); `wide`: whether it has the AVX512-VNNI tile, which takes a step of any number of
    rows (the AVX2 tile those the native head takes, device.NATIVE_LINEAR_MAX_ROWS);
    `by_default`: whether the engine takes it without being asked. That is Zen 3's AVX2 tile,
    measured faster there, and the AVX512-VNNI tile wherever it builds: measured on a Xeon with
    AMX in float32 (0.51-0.56x the time of the head and argmax on 32 rows, 0.33-0.40x oneDNN's
    on 48-128; docs/performance.md), and taken on the other CPUs with VNNI, not measured there,
    since one of its instructions makes 64 products where a float32 FMA makes 16."""

    # float32 logits a thread may compute a step before the screen declines (the full head then
    # runs): `budget` for up to 32 rows, `budget_per_row` a row beyond (SmolLM2's rows left 7 a
    # row at the median, 114 at most: docs/performance.md)
    budget, budget_per_row = 2048, 64
    # the integer sums stay exact (127 * 127 * k within int32) for k up to about 133,000
    max_k = 100_000

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.native = bool(lib.screen_native_f32())
        self.wide = bool(lib.screen_wide())
        self.by_default = self.native and (self.wide or cpu_lora.zen3())
        self._meta = lib.screen_meta_floats
        self._meta.argtypes, self._meta.restype = [ctypes.c_int64], ctypes.c_int64
        self._bytes = lib.screen_packed_bytes
        self._bytes.argtypes, self._bytes.restype = [ctypes.c_int64] * 2, ctypes.c_int64
        self._work = lib.screen_work_floats
        self._work.argtypes, self._work.restype = [ctypes.c_int64] * 2, ctypes.c_int64
        self._pack = lib.screen_pack_f32
        self._pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self._pack.argtypes += [ctypes.c_void_p] * 2
        self._pack.restype = ctypes.c_int
        self._weight_norm = lib.screen_weight_norm
        self._weight_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self._weight_norm.restype = ctypes.c_float
        if self.native:
            self._greedy = lib.screen_greedy_f32
            self._greedy.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3
            self._greedy.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_float, ctypes.c_void_p]
            self._greedy.argtypes += [ctypes.c_int64] * 2
            self._greedy.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int]
            self._greedy.restype = ctypes.c_int

    def prepare(self, weight: torch.Tensor) -> ScreenedHead | None:
        """The screen of an LM head's weight [vocab, hidden] (float32, kept as it is: the
        tokens it cannot rule out are computed from it). None where the screen does not take it
        (no native screen, weights not all finite, too many to index in int32)."""
        if not self.native or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        if not weight.is_contiguous() or weight.numel() >= 2**31 or weight.shape[1] > self.max_k:
            return None
        n, k = weight.shape
        q = torch.empty(int(self._bytes(n, k)), dtype=torch.int8)
        # per token: step, |w - w~|, |w~|, 2 gamma_k |w|, then the offset's start as int32 bits
        # (cpu/screen_f32.c): the last row's floats are not numbers to read
        meta = torch.empty(int(self._meta(n)), dtype=torch.float32)
        if self._pack(weight.data_ptr(), n, k, q.data_ptr(), meta.data_ptr()) != 0:
            return None
        weight_norm = self._weight_norm(meta.data_ptr(), n, k)  # the largest |w_v|
        return ScreenedHead(self, q, meta, weight_norm, weight)


class ScreenedHead:
    """An LM head's screen (CpuScreenF32.prepare): `greedy(x)` picks each row's token, or says
    None where it declines (a row of x not all finite, or too many tokens left to compute in
    float32); `picked` and `declined` count the calls of each kind. Rows that keep leaving too
    many tokens would pay for the screen and then for the full head: after `streak` declines in
    a row it rests, saying None without trying, for the next `rest` calls."""

    streak, rest = 8, 256

    def __init__(
        self,
        screen: CpuScreenF32,
        q: torch.Tensor,
        meta: torch.Tensor,
        weight_norm: float,
        weight: torch.Tensor,
    ) -> None:
        self._screen, self._q, self._meta, self._weight = screen, q, meta, weight
        self._weight_norm = weight_norm
        self.n, self.k = weight.shape
        self.any_rows = screen.wide  # a step of any number of rows, not only the native head's
        self._work, self._work_rows = torch.empty(0, dtype=torch.float32), 0  # kept between steps
        self.picked = self.declined = 0
        self._declines_in_a_row = self._resting = 0

    def _budget(self, rows: int) -> int:
        screen = self._screen
        return max(screen.budget, screen.budget_per_row * rows)

    def greedy(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [rows, k] float32 (unit column stride) -> int64 [rows], each row's greedy token."""
        rows = x.shape[0]
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.stride(1) != 1:
            raise ValueError(f"the screen takes float32 [rows, {self.k}], got {tuple(x.shape)}")
        if rows == 0:
            return torch.empty(0, dtype=torch.int64)
        if self._resting > 0:
            self._resting -= 1
            return None
        if self._work_rows < rows:
            self._work = torch.empty(int(self._screen._work(rows, self.n)), dtype=torch.float32)
            self._work_rows = rows
        out = torch.empty(rows, dtype=torch.int64)
        status = self._screen._greedy(
            x.data_ptr(), x.stride(0), rows, self.k, self._q.data_ptr(), self._meta.data_ptr(),
            self._weight_norm, self._weight.data_ptr(), self.n, self._budget(rows),
            self._work.data_ptr(), out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            self.declined += 1
            self._declines_in_a_row += 1
            if self._declines_in_a_row == self.streak:
                self._declines_in_a_row, self._resting = 0, self.rest
            return None
        self.picked += 1
        self._declines_in_a_row = 0
        return out


@functools.cache
def load() -> CpuScreenF32 | None:
    """The screen of the kernels' library; None where the library cannot be built."""
    lib = cpu_lora.library()
    return CpuScreenF32(lib) if lib is not None else None
