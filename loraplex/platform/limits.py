"""Per-key limits: requests per minute, tokens per minute, concurrent requests.

Requests and tokens are token buckets that refill continuously (a full minute's allowance at
most). A request is admitted when the key has a request left, its estimated tokens (prompt plus
max_tokens) fit, and it is under its concurrency limit; it is charged the estimate then, and
settled against what it really used when it ends. The reply carries OpenAI's headers:

    x-ratelimit-limit-requests / -tokens       the per-minute limits
    x-ratelimit-remaining-requests / -tokens   what is left now
    x-ratelimit-reset-requests / -tokens       until the bucket is full again ("1s", "6m0s")

`LocalLimiter` keeps the buckets in this process; `RedisLimiter` keeps them in Redis (one Lua
script per decision, with Redis's clock), so that every server process shares one budget.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from loraplex.platform.errors import APIError
from loraplex.platform.tenancy import Caller

WINDOW = 60.0  # seconds: limits are per minute
CONCURRENCY_LEASE = 900.0  # a crashed process's in-flight requests stop counting after this


@dataclass(frozen=True)
class Grant:
    key_id: str
    request_id: str
    tokens: int  # charged at admission
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """One admission decision, whichever store made it."""

    admitted: bool
    refused: str | None  # "requests", "tokens", "concurrency" or "too_large"
    remaining_requests: float
    reset_requests: float  # seconds
    remaining_tokens: float
    reset_tokens: float
    retry_after: float


def duration(seconds: float) -> str:
    """OpenAI's reset format: 250ms, 1s, 6m0s, 1h2m3s."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    seconds = math.ceil(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def headers(caller: Caller, decision: Decision) -> dict[str, str]:
    out = {}
    limits = caller.limits
    if limits.requests_per_minute:
        out["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
        out["x-ratelimit-remaining-requests"] = str(max(0, math.floor(decision.remaining_requests)))
        out["x-ratelimit-reset-requests"] = duration(decision.reset_requests)
    if limits.tokens_per_minute:
        out["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
        out["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(decision.remaining_tokens)))
        out["x-ratelimit-reset-tokens"] = duration(decision.reset_tokens)
    return out


def refusal(caller: Caller, decision: Decision, tokens: int) -> APIError:
    limits = caller.limits
    retry = max(decision.retry_after, 0.001)
    messages = {
        "requests": f"Rate limit reached for requests per minute (limit "
        f"{limits.requests_per_minute}). Please try again in {duration(retry)}.",
        "tokens": f"Rate limit reached for tokens per minute (limit {limits.tokens_per_minute}, "
        f"this request needs {tokens}). Please try again in {duration(retry)}.",
        "concurrency": f"Too many concurrent requests (limit {limits.max_concurrent}). "
        "Please try again when one of them has finished.",
        "too_large": f"Request too large for tokens per minute (limit "
        f"{limits.tokens_per_minute}, this request needs {tokens}). Lower max_tokens or the "
        "prompt.",
    }
    reply_headers = headers(caller, decision)
    if decision.refused != "too_large":
        reply_headers["retry-after"] = str(math.ceil(retry))
        reply_headers["retry-after-ms"] = str(math.ceil(retry * 1000))
    return APIError(
        429,
        messages[decision.refused or "requests"],
        type="tokens" if decision.refused in ("tokens", "too_large") else "requests",
        code="rate_limit_exceeded",
        headers=reply_headers,
    )


class Limiter:
    """Admission and settlement; subclasses decide where the buckets live."""

    async def acquire(self, caller: Caller, tokens: int) -> Grant:
        """Raises APIError 429 naming the limit."""
        request_id = uuid.uuid4().hex
        decision = await self._decide(caller, tokens, request_id)
        if not decision.admitted:
            raise refusal(caller, decision, tokens)
        return Grant(caller.key_id, request_id, tokens, headers(caller, decision))

    async def settle(self, caller: Caller, grant: Grant, tokens_used: int) -> None:
        await self._settle(caller, grant, tokens_used - grant.tokens)

    async def _decide(self, caller: Caller, tokens: int, request_id: str) -> Decision:
        raise NotImplementedError

    async def _settle(self, caller: Caller, grant: Grant, extra_tokens: int) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        return None


@dataclass
class _Bucket:
    level: float
    at: float

    def refill(self, capacity: float, now: float) -> None:
        self.level = min(capacity, self.level + (now - self.at) * capacity / WINDOW)
        self.at = now

    def reset_after(self, capacity: float) -> float:
        return max(0.0, (capacity - self.level) * WINDOW / capacity)

    def wait_for(self, amount: float, capacity: float) -> float:
        return max(0.0, (amount - self.level) * WINDOW / capacity)


@dataclass
class _KeyState:
    requests: _Bucket
    tokens: _Bucket
    in_flight: set[str] = field(default_factory=set)


class LocalLimiter(Limiter):
    """Buckets in this process (requests of one key are decided on the event loop, in order)."""

    def __init__(self) -> None:
        self._keys: dict[str, _KeyState] = {}

    async def _decide(self, caller: Caller, tokens: int, request_id: str) -> Decision:
        limits, now = caller.limits, time.monotonic()
        state = self._state(caller.key_id, limits, now)
        rpm = limits.requests_per_minute or math.inf
        tpm = limits.tokens_per_minute or math.inf
        state.requests.refill(rpm, now)
        state.tokens.refill(tpm, now)
        refused, retry = None, 0.0
        if limits.max_concurrent and len(state.in_flight) >= limits.max_concurrent:
            refused = "concurrency"
        elif state.requests.level < 1:
            refused, retry = "requests", state.requests.wait_for(1, rpm)
        elif tokens > tpm:
            refused = "too_large"
        elif state.tokens.level < tokens:
            refused, retry = "tokens", state.tokens.wait_for(tokens, tpm)
        else:
            state.requests.level -= 1
            state.tokens.level -= tokens
            state.in_flight.add(request_id)
        return Decision(
            admitted=refused is None,
            refused=refused,
            remaining_requests=state.requests.level,
            reset_requests=state.requests.reset_after(rpm) if rpm < math.inf else 0.0,
            remaining_tokens=state.tokens.level,
            reset_tokens=state.tokens.reset_after(tpm) if tpm < math.inf else 0.0,
            retry_after=retry,
        )

    async def _settle(self, caller: Caller, grant: Grant, extra_tokens: int) -> None:
        state = self._keys.get(caller.key_id)
        if state is None:
            return
        state.tokens.level -= extra_tokens
        state.in_flight.discard(grant.request_id)

    def _state(self, key_id: str, limits, now: float) -> _KeyState:
        state = self._keys.get(key_id)
        if state is None:
            state = self._keys[key_id] = _KeyState(
                _Bucket(limits.requests_per_minute or math.inf, now),
                _Bucket(limits.tokens_per_minute or math.inf, now),
            )
        return state


# KEYS: buckets hash, in-flight sorted set. ARGV: rpm, tpm, max_concurrent (0 = none), tokens,
# request id, lease ms. Returns: admitted, refusal, remaining requests, reset requests ms,
# remaining tokens, reset tokens ms, retry ms (numbers as strings: Lua floats would be cut).
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, lease = tonumber(ARGV[4]), tonumber(ARGV[6])
local s = redis.call('HMGET', KEYS[1], 'rl', 'rt', 'tl', 'tt')
local function refill(level, at, cap)
  if cap <= 0 then return 0 end
  if not level then return cap end
  return math.min(cap, tonumber(level) + (now - tonumber(at)) * cap / 60000)
end
local rl = refill(s[1], s[2], rpm)
local tl = refill(s[3], s[4], tpm)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - lease)
local refused, retry = '', 0
if conc > 0 and redis.call('ZCARD', KEYS[2]) >= conc then
  refused = 'concurrency'
elseif rpm > 0 and rl < 1 then
  refused = 'requests'; retry = (1 - rl) * 60000 / rpm
elseif tpm > 0 and tokens > tpm then
  refused = 'too_large'
elseif tpm > 0 and tl < tokens then
  refused = 'tokens'; retry = (tokens - tl) * 60000 / tpm
else
  if rpm > 0 then rl = rl - 1 end
  if tpm > 0 then tl = tl - tokens end
  redis.call('ZADD', KEYS[2], now, ARGV[5])
  redis.call('PEXPIRE', KEYS[2], lease)
end
redis.call('HSET', KEYS[1], 'rl', tostring(rl), 'rt', tostring(now), 'tl', tostring(tl),
  'tt', tostring(now))
redis.call('PEXPIRE', KEYS[1], 120000)
local rreset, treset = 0, 0
if rpm > 0 then rreset = (rpm - rl) * 60000 / rpm end
if tpm > 0 then treset = (tpm - tl) * 60000 / tpm end
return {refused == '' and 1 or 0, refused, tostring(rl), tostring(rreset), tostring(tl),
  tostring(treset), tostring(retry)}
"""

# KEYS: buckets hash, in-flight set. ARGV: tpm, extra tokens, request id.
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local tpm = tonumber(ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[3])
if tpm > 0 then
  local s = redis.call('HMGET', KEYS[1], 'tl', 'tt')
  local level = tpm
  if s[1] then level = math.min(tpm, tonumber(s[1]) + (now - tonumber(s[2])) * tpm / 60000) end
  redis.call('HSET', KEYS[1], 'tl', tostring(level - tonumber(ARGV[2])), 'tt', tostring(now))
end
return 1
"""


class RedisLimiter(Limiter):
    """Buckets in Redis, shared by every server process that points at it."""

    def __init__(self, url: str, namespace: str = "loraplex:limits") -> None:
        import redis.asyncio as redis

        self._redis = redis.from_url(url)
        self._namespace = namespace
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._settle_script = self._redis.register_script(_SETTLE)

    def _keys(self, key_id: str) -> list[str]:
        return [f"{self._namespace}:{key_id}", f"{self._namespace}:{key_id}:in-flight"]

    async def _decide(self, caller: Caller, tokens: int, request_id: str) -> Decision:
        limits = caller.limits
        reply = await self._acquire(
            keys=self._keys(caller.key_id),
            args=[
                limits.requests_per_minute or 0,
                limits.tokens_per_minute or 0,
                limits.max_concurrent or 0,
                tokens,
                request_id,
                int(CONCURRENCY_LEASE * 1000),
            ],
        )
        admitted, refused, *numbers = reply
        remaining_requests, reset_requests, remaining_tokens, reset_tokens, retry = (
            float(n) for n in numbers
        )
        return Decision(
            admitted=bool(admitted),
            refused=(refused.decode() if isinstance(refused, bytes) else refused) or None,
            remaining_requests=remaining_requests,
            reset_requests=reset_requests / 1000,
            remaining_tokens=remaining_tokens,
            reset_tokens=reset_tokens / 1000,
            retry_after=retry / 1000,
        )

    async def _settle(self, caller: Caller, grant: Grant, extra_tokens: int) -> None:
        await self._settle_script(
            keys=self._keys(caller.key_id),
            args=[caller.limits.tokens_per_minute or 0, extra_tokens, grant.request_id],
        )

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


def make_limiter(redis_url: str | None) -> Limiter:
    return RedisLimiter(redis_url) if redis_url else LocalLimiter()
