"""Alembic environment: the registry's metadata, and the connection `loraplex db` hands over (or
the URL in the Alembic config, for the `alembic` command)."""

from alembic import context

from loraplex.platform.db.models import Base
from loraplex.platform.db.session import make_engine

config = context.config
connection = config.attributes.get("connection")


def run() -> None:
    if connection is not None:
        _migrate(connection)
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    try:
        with engine.connect() as own_connection:
            _migrate(own_connection)
    finally:
        engine.dispose()


def _migrate(conn) -> None:
    context.configure(
        connection=conn,
        target_metadata=Base.metadata,
        render_as_batch=conn.dialect.name == "sqlite",  # SQLite alters tables by copying
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run()
