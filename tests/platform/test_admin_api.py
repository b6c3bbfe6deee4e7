"""Operators register tenants, keys and adapters over admin REST while the server runs."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from loraplex import LoRARequest, SamplingParams
from tests.factories import make_llm
from tests.platform.servers import start_server

QUESTION = [{"role": "user", "content": "a cat sleeps"}]


def answer(server, key: str, model: str, max_tokens: int = 10) -> str:
    sdk = OpenAI(base_url=server.api, api_key=key, max_retries=0)
    reply = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content


def engine_answer(model_dir, adapter_dir, max_tokens: int = 10) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    lora = [LoRARequest(str(adapter_dir), str(adapter_dir))]
    return make_llm(model_dir).chat(QUESTION, params, adapters=lora)[0].outputs[0].text


def test_admin_token_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong-token-of-some-length"}):
        reply = httpx.get(f"{server.url}/admin/v1/tenants", headers=headers)
        assert reply.status_code == 401
        assert reply.json()["error"]["code"] == "invalid_admin_token"


def test_register_use_delete_mid_stream_and_register_again(server, adapter_root, tiny_llama):
    tenant = server.tenant("hot")
    key = server.key(tenant)
    with pytest.raises(openai.NotFoundError):
        answer(server, key, "fresh")
    first = server.register("fresh", adapter_root / "alpha", tenant)
    assert (first["rank"], first["status"]) == (4, "registered")
    assert answer(server, key, "fresh") == engine_answer(tiny_llama, adapter_root / "alpha")

    # delete it while a long stream runs on it: the stream finishes, the next request is a 404
    sdk = OpenAI(base_url=server.api, api_key=key, max_retries=0)
    stream = sdk.chat.completions.create(
        model="fresh",
        messages=QUESTION,
        max_tokens=300,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    deleted = server.admin("DELETE", f"/adapters/{first['id']}")
    assert deleted.status_code == 200
    with pytest.raises(openai.NotFoundError):
        answer(server, key, "fresh")
    rest = [c for c in chunks if c.choices]
    assert rest[-1].choices[0].finish_reason == "length"

    # the same name with other weights: the new adapter's answer, never the old one's
    second = server.register("fresh", adapter_root / "gamma", tenant)
    assert second["id"] != first["id"] and second["content_hash"] != first["content_hash"]
    assert answer(server, key, "fresh") == engine_answer(tiny_llama, adapter_root / "gamma")


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        ("pickled", "never unpickles"),
        ("corrupt", "not a readable safetensors file"),
        ("wrong-base", "the base model needs"),
        ("outside", "outside the configured adapter roots"),
        ("missing", "is not a directory"),
    ],
)
def test_bad_registrations_are_refused_and_store_nothing(
    server, adapter_root, outside_adapter, adapter, message
):
    path = outside_adapter if adapter == "outside" else adapter_root / adapter
    before = server.admin_ok("GET", "/adapters")["data"]
    reply = server.admin("POST", "/adapters", json={"name": f"bad-{adapter}", "path": str(path)})
    assert reply.status_code == 400
    assert message in reply.json()["error"]["message"]
    assert server.admin_ok("GET", "/adapters")["data"] == before
    with sqlite3.connect(server.data_dir / "loraplex.db") as db:
        rows = db.execute("SELECT count(*) FROM adapters WHERE name = ?", (f"bad-{adapter}",))
        assert rows.fetchone()[0] == 0


def test_upload_registers_an_adapter(server, adapter_root, tiny_llama):
    tenant = server.tenant("uploader")
    files = {
        "adapter_config": (adapter_root / "beta" / "adapter_config.json").read_bytes(),
        "adapter_model": (adapter_root / "beta" / "adapter_model.safetensors").read_bytes(),
    }
    reply = server.admin_ok(
        "POST", "/adapters/upload", data={"name": "uploaded", "tenant_id": tenant}, files=files
    )
    assert reply["source_path"] == "upload" and reply["rank"] == 8
    key = server.key(tenant)
    assert answer(server, key, "uploaded") == engine_answer(tiny_llama, adapter_root / "beta")


def test_pin_and_residency(server, adapter_root):
    tenant = server.tenant("pinner")
    adapter = server.register("pinned-one", adapter_root / "alpha", tenant)
    pinned = server.admin_ok("POST", f"/adapters/{adapter['id']}/pin")
    assert (pinned["pinned"], pinned["status"]) == (True, "pinned")
    pool = server.admin_ok("GET", "/engine")["pool"]
    assert any(adapter["id"] in r["adapter_ids"] and r["pinned"] for r in pool["resident"])
    unpinned = server.admin_ok("POST", f"/adapters/{adapter['id']}/unpin")
    assert unpinned["pinned"] is False and unpinned["status"] in ("resident", "host-cached")


def test_vllm_load_and_unload_routes(server, adapter_root, tiny_llama):
    headers = {"Authorization": "Bearer " + server.env["LORAPLEX_ADMIN_TOKEN"]}
    loaded = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json={"lora_name": "vllm-style", "lora_path": str(adapter_root / "beta")},
        headers=headers,
    )
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    key = server.key(server.tenant("vllm-user"))
    assert answer(server, key, "vllm-style") == engine_answer(tiny_llama, adapter_root / "beta")
    unloaded = httpx.post(
        f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "vllm-style"}, headers=headers
    )
    assert unloaded.status_code == 200
    with pytest.raises(openai.NotFoundError):
        answer(server, key, "vllm-style")
    tenant_key = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": str(adapter_root / "beta")},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert tenant_key.status_code == 401


def test_keys_are_stored_as_hashes_and_revocation_is_immediate(server):
    tenant = server.tenant("hashed")
    created = server.admin_ok("POST", f"/tenants/{tenant}/keys", json={"name": "ci"})
    secret = created["key"]
    assert created["prefix"] == secret[:12]
    listed = server.admin_ok("GET", f"/tenants/{tenant}/keys")["data"]
    assert [k["key"] for k in listed] == [None]  # shown once, never again
    with sqlite3.connect(server.data_dir / "loraplex.db") as db:
        dump = "\n".join(db.iterdump())
        stored = db.execute("SELECT key_hash FROM api_keys WHERE id = ?", (created["id"],))
        assert stored.fetchone()[0] == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in dump and secret[12:] not in dump
    sdk = OpenAI(base_url=server.api, api_key=secret, max_retries=0)
    assert sdk.models.list().data
    server.admin_ok("DELETE", f"/keys/{created['id']}")
    with pytest.raises(openai.AuthenticationError):
        sdk.models.list()


def test_usage_rows_one_per_request_also_after_a_graceful_stop(tmp_path, tiny_llama):
    server = start_server(tiny_llama, tmp_path / "data", served_model_name="llama")
    try:
        key = server.key(server.tenant("metered"))
        sdk = OpenAI(base_url=server.api, api_key=key, max_retries=0)
        replies = []

        def call() -> None:
            replies.append(
                sdk.chat.completions.create(model="llama", messages=QUESTION, max_tokens=5)
            )

        threads = [threading.Thread(target=call) for _ in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with pytest.raises(openai.NotFoundError):
            sdk.chat.completions.create(model="nope", messages=QUESTION)
        time.sleep(1.5)  # flushed in the background meanwhile
        usage = server.admin_ok("GET", "/usage")["totals"]
        assert [u["requests"] for u in usage] == [13] and usage[0]["errors"] == 1
        assert usage[0]["completion_tokens"] == sum(r.usage.completion_tokens for r in replies)
        for _ in range(7):  # these rows are still in memory when the stop begins
            call()
    finally:
        assert server.stop() == 0
    with sqlite3.connect(tmp_path / "data" / "loraplex.db") as db:
        statuses = [row[0] for row in db.execute("SELECT status FROM usage")]
    assert sorted(statuses) == [200] * 19 + [404]
