"""Pages always come back: the allocator alone, and the engine under aborts and preemption."""

from __future__ import annotations

import ctypes
import mmap
import random

import pytest
import torch

from loraplex import SamplingParams
from loraplex.engine.pool import PagePool
from tests.factories import make_llm, sample_text


def test_page_pool_random_allocate_and_free():
    rng = random.Random(0)
    pool = PagePool(num_pages=50, page_numel=8, dtype=torch.float32, device="cpu")
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.45 or not pool.can_allocate(1)):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            want = rng.randint(1, 6)
            if pool.can_allocate(want):
                held.append(pool.allocate(want))
            else:
                with pytest.raises(MemoryError):
                    pool.allocate(want)
        owned = [p for pages in held for p in pages]
        assert len(owned) == len(set(owned)), "a page was handed out twice"
        assert pool.num_free + len(owned) == pool.num_pages
    for pages in held:
        pool.free(pages)
    assert pool.num_free == pool.num_pages
    assert sorted(pool.allocate(pool.num_pages)) == list(range(pool.num_pages))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_returns_every_page_after_finishes_and_aborts(tiny_llama, seed):
    rng = random.Random(seed)
    llm = make_llm(tiny_llama, num_pages=24, max_num_batched_tokens=48, max_num_seqs=8)
    engine = llm.engine
    live: set[str] = set()
    finished_reasons = []
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 20:
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                n=rng.choice([1, 1, 2]),
                max_tokens=rng.randint(1, 40),
                seed=rng.randint(0, 9),
                stop=rng.choice([[], ["the"]]),
            )
            request = engine.make_request(sample_text(rng, rng.randint(1, 60)), params)
            engine.add_request(request)
            live.add(request.request_id)
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
        for delta in engine.step():
            if delta.finished:
                live.discard(delta.request_id)
                finished_reasons += [o.finish_reason for o in delta.outputs if o.finish_reason]
        if step > 300 and not live:
            break
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_available == engine.pool.num_pages
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert set(finished_reasons) <= {"stop", "length"}
    assert engine.num_preemptions > 0, "the pool was meant to be too small for the load"


def _advised_huge(address: int) -> bool:
    """Whether the mapping holding `address` carries the huge-page advice (VmFlags "hg"): the
    kernel then backs it with 2 MiB pages whenever it has them free."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


def _transparent_huge_pages() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
            return mode.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.skipif(
    _transparent_huge_pages() == "never", reason="this kernel gives no transparent huge pages"
)
def test_the_pool_asks_for_huge_pages_and_holds_zeros():
    pool = PagePool(num_pages=512, page_numel=65536, dtype=torch.float32, device="cpu")
    assert torch.count_nonzero(pool.data) == 0
    middle = pool.data.data_ptr() + pool.data.numel() * pool.data.element_size() // 2
    assert _advised_huge(middle)
    # memory nobody advised reads as such: a fresh anonymous mapping (not a torch tensor, which
    # malloc may carve from heap memory an earlier, freed pool of this process had advised)
    plain = mmap.mmap(-1, 8 << 20)
    try:
        assert not _advised_huge(ctypes.addressof(ctypes.c_char.from_buffer(plain)) + (4 << 20))
    finally:
        plain.close()
