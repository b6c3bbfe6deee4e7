"""The demo tenant the serve-on-defaults command sets up: the two demo adapters, a fresh key."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from loraplex.platform import registry
from loraplex.platform.adapters import Adapters
from loraplex.platform.db.models import Tenant
from loraplex.platform.errors import APIError
from loraplex.platform.state import Platform

logger = logging.getLogger(__name__)

DEMO_TENANT = "demo"
# in a checkout of the repository; a wheel ships no demo adapters
DEMO_ADAPTERS = Path(__file__).resolve().parents[2] / "demo" / "adapters"


@dataclass(frozen=True)
class Demo:
    tenant: str
    key: str
    adapters: list[str]


async def set_up_demo(platform: Platform) -> Demo:
    """Idempotent but for the key: each start prints a new one (secrets are never stored)."""

    def tenant(session) -> Tenant:
        return registry.find_tenant(session, DEMO_TENANT) or registry.create_tenant(
            session, DEMO_TENANT
        )

    demo = await platform.db.run(tenant)
    names = []
    for path in sorted(DEMO_ADAPTERS.glob("*/adapter_config.json")):
        name = path.parent.name
        existing = await platform.db.run(lambda s, n=name: registry.find_adapter(s, demo.id, n))
        if existing is None:
            try:
                await Adapters(platform).register_path(name, str(path.parent), demo.id)
            except APIError as error:
                logger.warning("demo adapter %s not registered: %s", name, error.message)
                continue
        names.append(name)
    _, secret = await platform.db.run(lambda s: registry.create_key(s, demo.id, "demo"))
    return Demo(tenant=DEMO_TENANT, key=secret, adapters=names)
