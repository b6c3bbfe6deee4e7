"""Per-key limits with OpenAI's headers, in one process and shared by two through Redis; keys
revoked and tenants disabled are refused by every process within a second."""

from __future__ import annotations

import time

import openai
import pytest
import redis
from openai import OpenAI

from tests.platform.servers import REDIS_URL, start_server

QUESTION = [{"role": "user", "content": "hello"}]


def ask(server, key: str, **options):
    sdk = OpenAI(base_url=server.api, api_key=key, max_retries=0)
    options.setdefault("max_tokens", 3)
    return sdk.chat.completions.with_raw_response.create(
        model="llama", messages=QUESTION, **options
    )


def test_requests_per_minute_with_openai_headers(server):
    key = server.key(server.tenant("rpm"), requests_per_minute=3)
    remaining = []
    for _ in range(3):
        reply = ask(server, key)
        assert reply.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(reply.headers["x-ratelimit-remaining-requests"]))
        assert reply.headers["x-ratelimit-reset-requests"].endswith("s")
    assert remaining == [2, 1, 0]
    with pytest.raises(openai.RateLimitError) as error:
        ask(server, key)
    body, headers = error.value.body, error.value.response.headers
    assert body["code"] == "rate_limit_exceeded" and body["type"] == "requests"
    assert "requests per minute (limit 3)" in body["message"]
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(headers["retry-after"]) <= 20


def test_tokens_per_minute_and_concurrency(server):
    key = server.key(server.tenant("tpm"), tokens_per_minute=400)
    first = ask(server, key, max_tokens=100)
    assert first.headers["x-ratelimit-limit-tokens"] == "400"
    left = int(first.headers["x-ratelimit-remaining-tokens"])
    assert left < 400
    with pytest.raises(openai.RateLimitError) as error:
        ask(server, key, max_tokens=390)  # more than is left
    assert error.value.body["type"] == "tokens"
    with pytest.raises(openai.RateLimitError) as error:
        ask(server, key, max_tokens=500)  # more than a whole minute's worth
    assert "Request too large" in error.value.body["message"]

    key = server.key(server.tenant("one-at-a-time"), max_concurrent=1)
    sdk = OpenAI(base_url=server.api, api_key=key, max_retries=0)
    stream = sdk.chat.completions.create(
        model="llama",
        messages=QUESTION,
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as error:
        ask(server, key)
    assert "concurrent requests (limit 1)" in error.value.body["message"]
    for _ in stream:
        pass
    assert ask(server, key).http_response.status_code == 200


@pytest.fixture
def two_servers(tmp_path, tiny_llama):
    """Two server processes with one registry (SQLite, shared file) and one Redis."""
    redis.Redis.from_url(REDIS_URL).flushdb()
    database = f"sqlite:///{tmp_path / 'shared.db'}"
    options = dict(served_model_name="llama", database_url=database, redis_url=REDIS_URL)
    first = start_server(tiny_llama, tmp_path / "one", **options)
    second = start_server(tiny_llama, tmp_path / "two", **options)
    yield first, second
    first.stop()
    second.stop()


def test_two_processes_share_one_budget_and_see_revocations(two_servers):
    first, second = two_servers
    tenant = first.tenant("shared-budget")
    key = first.key(tenant, requests_per_minute=4)
    for server in (first, second, first, second):
        assert ask(server, key).http_response.status_code == 200
    for server in (first, second):
        with pytest.raises(openai.RateLimitError):
            ask(server, key)

    # a key revoked through one process is refused by the other within a second
    other = first.key(tenant)
    assert ask(second, other).http_response.status_code == 200
    key_id = first.admin_ok("GET", f"/tenants/{tenant}/keys")["data"][-1]["id"]
    first.admin_ok("DELETE", f"/keys/{key_id}")
    time.sleep(1.0)
    with pytest.raises(openai.AuthenticationError):
        ask(second, other)

    # and so is a disabled tenant
    third = first.key(tenant)
    assert ask(second, third).http_response.status_code == 200
    first.admin_ok("PATCH", f"/tenants/{tenant}", json={"disabled": True})
    time.sleep(1.0)
    with pytest.raises(openai.PermissionDeniedError):
        ask(second, third)
