"""The SQL registry on SQLite and on the local PostgreSQL server: migrations up, down and up again
with no drift from the models, and the registry's operations on both."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import inspect, text

from loraplex.platform import registry
from loraplex.platform.db import migrate
from loraplex.platform.db.models import Adapter
from loraplex.platform.db.session import Database
from tests.platform.servers import create_database


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'registry.db'}"
        return
    url, drop = create_database()
    yield url
    drop()


@pytest.fixture
def db(database_url):
    migrate.upgrade(database_url)
    database = Database(database_url)
    yield database
    database.close()


def tables(url: str) -> set[str]:
    database = Database(url)
    try:
        return set(inspect(database.engine).get_table_names()) - {"alembic_version"}
    finally:
        database.close()


def test_migrations_up_down_up_without_drift(database_url):
    migrate.upgrade(database_url)
    assert migrate.current(database_url) == migrate.head(database_url)
    assert tables(database_url) == {
        "tenants",
        "api_keys",
        "adapters",
        "usage",
        "audit_log",
        "registry_revision",
        "files",
        "batches",
    }
    assert migrate.drift(database_url) == []
    migrate.downgrade(database_url, "base")
    assert migrate.current(database_url) is None and tables(database_url) == set()
    migrate.upgrade(database_url)
    assert migrate.drift(database_url) == []


def adapter(tenant_id: str | None, name: str) -> Adapter:
    return Adapter(
        tenant_id=tenant_id,
        name=name,
        source_path="/adapters/x",
        storage_path="/store/abc",
        content_hash="ab" * 32,
        rank=8,
        target_modules=["q_proj", "v_proj"],
        size_bytes=1024,
        base_model="llama",
    )


def test_tenants_keys_and_adapters(db):
    acme = db.transaction(lambda s: registry.create_tenant(s, "acme"))
    other = db.transaction(lambda s: registry.create_tenant(s, "other"))
    with pytest.raises(registry.Conflict):
        db.transaction(lambda s: registry.create_tenant(s, "acme"))

    key, secret = db.transaction(lambda s: registry.create_key(s, acme.id, "ci"))
    found = db.transaction(lambda s: registry.key_with_tenant(s, registry.hash_key(secret)))
    assert found[0].id == key.id and found[1].name == "acme"
    assert db.transaction(lambda s: registry.key_with_tenant(s, registry.hash_key("lpx-x"))) is None
    with db.engine.connect() as connection:
        stored = connection.execute(text("SELECT prefix, key_hash FROM api_keys")).all()
    assert stored == [(secret[:12], registry.hash_key(secret))]

    db.transaction(lambda s: registry.add_adapter(s, adapter(acme.id, "helper")))
    db.transaction(lambda s: registry.add_adapter(s, adapter(other.id, "helper")))
    db.transaction(lambda s: registry.add_adapter(s, adapter(None, "everyone")))
    db.transaction(lambda s: registry.add_adapter(s, adapter(None, "helper")))
    with pytest.raises(registry.Conflict):
        db.transaction(lambda s: registry.add_adapter(s, adapter(acme.id, "helper")))
    with pytest.raises(registry.Conflict):
        db.transaction(lambda s: registry.add_adapter(s, adapter(None, "everyone")))

    # a tenant's own adapter wins over a shared one of the same name; others' stay hidden
    mine = db.transaction(lambda s: registry.visible_adapter(s, acme.id, "helper"))
    assert mine.tenant_id == acme.id
    visible = db.transaction(lambda s: registry.visible_adapters(s, acme.id))
    assert sorted((a.name, a.tenant_id) for a in visible) == [
        ("everyone", None),
        ("helper", acme.id),
    ]
    stranger = db.transaction(lambda s: registry.create_tenant(s, "stranger"))
    seen = db.transaction(lambda s: registry.visible_adapter(s, stranger.id, "helper"))
    assert seen.tenant_id is None

    revoked = db.transaction(lambda s: registry.revoke_key(s, key.id))
    assert revoked.revoked_at is not None
    actions = [e.action for e in db.transaction(registry.list_audit)]
    assert actions[0] == "key.revoke" and "adapter.register" in actions
    # every committed change, and only those (the refused duplicates rolled back), moved the
    # revision that other server processes watch
    assert db.transaction(registry.revision) == len(actions)


def test_usage_summary_and_series(db):
    now = time.time()
    rows = [
        dict(
            request_id=f"r{i}",
            tenant_id="tnt_a" if i % 3 else "tnt_b",
            key_id="key_1",
            adapter_id=None if i % 2 else "adp_1",
            model="m",
            prompt_tokens=10,
            completion_tokens=5,
            latency_ms=1.0,
            status=200 if i % 5 else 429,
            created_at=now - i,
        )
        for i in range(30)
    ]
    db.transaction(lambda s: registry.add_usage(s, rows))
    by_tenant = {
        t.group: t for t in db.transaction(lambda s: registry.usage_summary(s, now - 60, "tenant"))
    }
    assert by_tenant["tnt_a"].requests == 20 and by_tenant["tnt_b"].requests == 10
    assert by_tenant["tnt_a"].prompt_tokens == 200
    assert sum(t.errors for t in by_tenant.values()) == 6
    by_adapter = db.transaction(lambda s: registry.usage_summary(s, now - 60, "adapter"))
    assert {t.group: t.requests for t in by_adapter} == {None: 15, "adp_1": 15}
    series = db.transaction(lambda s: registry.usage_series(s, now - 60, 60, "tenant"))
    assert sum(point[2] for point in series) == 30
    assert sum(point[3] for point in series) == 30 * 15
