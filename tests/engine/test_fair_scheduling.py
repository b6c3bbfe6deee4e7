"""Fair scheduling between tenants on the real engine (tiny model), driven step by step the way
the async engine's thread drives it: a flooding tenant does not starve a light one, the machine
stays fully used by a lone tenant, and served tokens follow the tenants' weights."""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from loraplex.engine.api import EngineConfig, Fairness, SamplingParams
from loraplex.engine.engine import LLMEngine

SLOTS = 8


def make_engine(model, policy: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            memory_budget="64MiB",
            max_num_seqs=SLOTS,
            max_num_batched_tokens=128,
            scheduling_policy=policy,
        )
    )


def prompt(n: int, salt: int) -> list[int]:
    """n token ids of distinct text (no shared prefix between requests)."""
    return [3 + (salt * 7 + i * 13) % 300 for i in range(n)]


@dataclass
class Tenant:
    key: str
    prompt_tokens: int
    max_tokens: int
    weight: float = 1.0
    sent: list[str] = field(default_factory=list)
    submitted: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    waited_steps: dict[str, int] = field(default_factory=dict)  # steps sent -> first token
    served: int = 0  # prompt tokens + 2 x output tokens, VTC's measure
    output_tokens: int = 0


class Driver:
    """Adds requests between steps and records, per tenant, what it was served."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.ids = itertools.count()
        self.live: dict[str, Tenant] = {}
        self.steps = 0

    def send(self, tenant: Tenant) -> str:
        request_id = f"{tenant.key}-{next(self.ids)}"
        params = SamplingParams(temperature=0.0, max_tokens=tenant.max_tokens, ignore_eos=True)
        request = self.engine.make_request(
            prompt(tenant.prompt_tokens, next(self.ids)),
            params,
            request_id,
            fairness=Fairness(tenant.key, tenant.weight),
        )
        self.engine.add_request(request)
        tenant.sent.append(request_id)
        tenant.submitted[request_id] = time.perf_counter()
        tenant.waited_steps[request_id] = -self.steps
        self.live[request_id] = tenant
        return request_id

    def step(self) -> set[str]:
        """One engine step; the ids of the requests that finished in it."""
        deltas = self.engine.step()
        now = time.perf_counter()
        self.steps += 1
        done = set()
        for delta in deltas:
            tenant = self.live[delta.request_id]
            new = len(delta.outputs[0].token_ids)
            if new and delta.request_id not in tenant.first_token:
                tenant.first_token[delta.request_id] = now
                tenant.waited_steps[delta.request_id] += self.steps
                tenant.served += tenant.prompt_tokens
            tenant.served += 2 * new
            tenant.output_tokens += new
            if delta.finished:
                done.add(delta.request_id)
                del self.live[delta.request_id]
        return done

    def outstanding(self, tenant: Tenant) -> int:
        return sum(1 for t in self.live.values() if t is tenant)


def mean_ttft(tenant: Tenant) -> float:
    waits = [tenant.first_token[r] - tenant.submitted[r] for r in tenant.sent]
    return sum(waits) / len(waits)


def light_tenant_alone(model) -> Tenant:
    driver = Driver(make_engine(model, "fair"))
    b = Tenant("b", prompt_tokens=96, max_tokens=8)
    driver.send(b)  # a first request warms the engine up: not counted
    while driver.live:
        driver.step()
    b = Tenant("b", prompt_tokens=96, max_tokens=8)
    for _ in range(8):
        driver.send(b)
        while driver.live:
            driver.step()
    return b


def noisy_neighbour(model, policy: str):
    """Tenant a keeps 64 requests outstanding; tenant b sends 8 requests one after another,
    idling 24 steps between them. -> (a, b, a's output tokens per step while b idled)"""
    driver = Driver(make_engine(model, policy))
    a = Tenant("a", prompt_tokens=24, max_tokens=32)
    b = Tenant("b", prompt_tokens=96, max_tokens=8)
    idle_tokens = idle_steps = 0
    for _ in range(8):
        idle = 24
        while idle:  # b has nothing in flight
            while driver.outstanding(a) < 64:
                driver.send(a)
            before = a.output_tokens
            driver.step()
            if driver.steps > 40:  # past the first prompts of a's flood
                idle_tokens += a.output_tokens - before
                idle_steps += 1
            idle -= 1
        request_id = driver.send(b)
        while request_id in driver.live:
            while driver.outstanding(a) < 64:
                driver.send(a)
            driver.step()
    return a, b, idle_tokens / idle_steps


def a_alone_tokens_per_step(model) -> float:
    driver = Driver(make_engine(model, "fair"))
    a = Tenant("a", prompt_tokens=24, max_tokens=32)
    tokens = steps = 0
    for _ in range(240):
        while driver.outstanding(a) < 64:
            driver.send(a)
        before = a.output_tokens
        driver.step()
        if driver.steps > 40:
            tokens += a.output_tokens - before
            steps += 1
    return tokens / steps


def test_a_flooding_tenant_does_not_starve_a_light_one(tiny_llama, report):
    """Counted in engine steps, which the scheduler decides, not in milliseconds, which the host
    does: under fair scheduling b's first token comes within a step of when it would come with the
    machine to itself (on a 2-core Zen 4, the next step in both), under FCFS behind a's queue
    (225-233 steps there). b's wall-clock TTFT against alone is reported, not asserted: it moved
    between 1.45x and 2.29x with the host, b's first step under fair also carrying a's decodes."""
    a_alone = a_alone_tokens_per_step(tiny_llama)
    alone = light_tenant_alone(tiny_llama)
    _, fair, fair_idle = noisy_neighbour(tiny_llama, "fair")
    _, fcfs, _ = noisy_neighbour(tiny_llama, "fcfs")
    waits = {
        name: list(t.waited_steps.values())
        for name, t in (("alone", alone), ("fair", fair), ("fcfs", fcfs))
    }
    report(
        f"noisy neighbour (tiny model, {SLOTS} slots, a keeps 64 requests outstanding): b's "
        f"first token at most {max(waits['fair'])} step(s) after it was sent under fair, "
        f"{max(waits['alone'])} alone, a mean of {statistics.mean(waits['fcfs']):.0f} under fcfs; "
        f"b's mean TTFT fair {mean_ttft(fair) * 1e3:.1f} ms, alone {mean_ttft(alone) * 1e3:.1f} "
        f"ms, fcfs {mean_ttft(fcfs) * 1e3:.1f} ms; a's output tokens per step while b idles "
        f"{fair_idle:.2f} against {a_alone:.2f} alone"
    )
    assert max(waits["fair"]) <= max(waits["alone"]) + 1
    assert statistics.mean(waits["fcfs"]) >= 10 * statistics.mean(waits["alone"])
    assert fair_idle >= 0.97 * a_alone  # work-conserving: a lone tenant gets the machine


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def backlogged_share(model, weights: dict[str, float]) -> dict[str, int]:
    """Three tenants with different request shapes, each keeping 24 requests outstanding:
    what each is served over 240 steps after a warm-up."""
    driver = Driver(make_engine(model, "fair"))
    shapes = {"a": (48, 8), "b": (8, 32), "c": (24, 16)}  # prompt tokens, max tokens
    tenants = [Tenant(k, *shapes[k], weight=w) for k, w in weights.items()]
    start: dict[str, int] = {}
    for step in range(300):
        for tenant in tenants:
            while driver.outstanding(tenant) < 24:
                driver.send(tenant)
        if step == 60:
            start = {t.key: t.served for t in tenants}
        driver.step()
    return {t.key: t.served - start[t.key] for t in tenants}


@pytest.mark.parametrize(
    "weights", [{"a": 1, "b": 1, "c": 1}, {"a": 2, "b": 1, "c": 1}], ids=["1:1:1", "2:1:1"]
)
def test_backlogged_tenants_share_served_tokens_by_weight(tiny_llama, report, weights):
    served = backlogged_share(tiny_llama, weights)
    per_weight = [served[k] / w for k, w in weights.items()]
    index = jain(per_weight)
    shown = ", ".join(f"{k} {v}" for k, v in served.items())
    report(
        f"fair share, 3 backlogged tenants, weights {':'.join(map(str, weights.values()))}: "
        f"served tokens (prompt + 2 x output) {shown}; Jain's index of served/weight {index:.3f}"
    )
    assert index >= 0.95


def test_fcfs_is_what_the_fair_policy_replaces(tiny_llama, report):
    """The same backlog under first come, first served: shares follow request shapes, not
    tenants (the measure above is not fair by accident)."""
    driver = Driver(make_engine(tiny_llama, "fcfs"))
    shapes = {"a": (48, 8), "b": (8, 32), "c": (24, 16)}
    tenants = [Tenant(k, *shapes[k]) for k in shapes]
    for _ in range(300):
        for tenant in tenants:
            while driver.outstanding(tenant) < 24:
                driver.send(tenant)
        driver.step()
    index = jain([t.served for t in tenants])
    shown = ", ".join(f"{t.key} {t.served}" for t in tenants)
    report(f"fcfs, the same 3 backlogged tenants: served tokens {shown}; Jain's index {index:.3f}")
    assert index < 0.95


def test_every_request_of_every_tenant_finishes(tiny_llama):
    driver = Driver(make_engine(tiny_llama, "fair"))
    tenants = [Tenant(k, 16, 12) for k in "abcde"]
    for tenant in tenants:
        for _ in range(10):
            driver.send(tenant)
    steps = 0
    while driver.live and steps < 2000:
        driver.step()
        steps += 1
    assert not driver.live
    assert Counter(len(t.first_token) for t in tenants) == {10: 5}
    assert driver.engine.scheduler.policy._live == Counter()  # nothing left behind
