"""Schema migrations with Alembic, from the migrations shipped in the package."""

from __future__ import annotations

import importlib.resources

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from loraplex.platform.db.models import Base
from loraplex.platform.db.session import make_engine, normalize_url


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(importlib.resources.files("loraplex.migrations")))
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head(url: str) -> str:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def drift(url: str) -> list:
    """Differences between the models and a database at head; empty when they agree."""
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
