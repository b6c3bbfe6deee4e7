"""Alembic migrations of the registry (shipped in the wheel as `loraplex.migrations`)."""
