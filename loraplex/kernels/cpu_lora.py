"""The CPU LoRA kernel (cpu_lora.c): built once per machine with its own C compiler, loaded with
ctypes, called once per (layer, module, group of runs).

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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_lora.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
MAX_RANK = 1024  # as in cpu_lora.c; a larger rank takes the torch path
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
_ARGTYPES += [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_ARGTYPES += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]


def cache_dir() -> Path:
    root = os.environ.get("LORAPLEX_KERNEL_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(root or Path.home() / ".cache") / "loraplex" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    digest.update(version.stdout.encode())
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            digest.update(next((ln for ln in cpuinfo if ln.startswith("flags")), "").encode())
    except OSError:
        pass
    return digest.hexdigest()[:16]


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename: concurrent builders are safe."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> CpuLoRAKernel | None:
    """The kernel, built if needed; None where it cannot be built on this machine."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: multi-adapter decode uses the slower torch LoRA path")
        return None
    target = cache_dir() / f"cpu_lora-{_build_key(compiler)}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        return CpuLoRAKernel(ctypes.CDLL(str(target)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("CPU LoRA kernel unavailable, using the torch path: %s", detail.strip()[:500])
        return None


class CpuLoRAKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._functions = {}
        for dtype, suffix in _DTYPES.items():
            function = getattr(lib, f"lora_apply_{suffix}")
            function.argtypes = _ARGTYPES
            function.restype = ctypes.c_int
            self._functions[dtype] = function

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._functions

    def apply(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        pool: torch.Tensor,
        a_rows: torch.Tensor,
        b_rows: torch.Tensor,
        slots: torch.Tensor,
        rank: int,
        scales: torch.Tensor,
    ) -> None:
        """y[t] += scales[s] * (x[t] @ A_s^T) @ B_s for every row t of x and y (2-D, unit column
        stride), s = slots[t], with run s's rows at a_rows[s*rank : (s+1)*rank] and b_rows[...]
        in the flat pool (int64, contiguous, as is slots); scales float32 [runs]. Same dtype for
        x, y and pool."""
        n, fin = x.shape
        if n == 0:
            return
        if x.stride(1) != 1 or y.stride(1) != 1:
            raise ValueError("x and y need unit column stride")
        status = self._functions[pool.dtype](
            x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), n, fin, y.shape[1],
            pool.data_ptr(), a_rows.data_ptr(), b_rows.data_ptr(), slots.data_ptr(), rank,
            scales.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"the CPU LoRA kernel takes ranks up to {MAX_RANK}, got {rank}")
