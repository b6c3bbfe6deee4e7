"""Service tiers and the Batch API: a key's default tier and batch token budget, usage rows
marked by batch job, and the files and batches tables.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as table:
        table.add_column(
            sa.Column("service_tier", sa.String(16), nullable=False, server_default="interactive")
        )
        table.add_column(sa.Column("batch_tokens_per_day", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("api_keys") as table:
        table.alter_column("service_tier", server_default=None)
    with op.batch_alter_table("usage") as table:
        table.add_column(sa.Column("batch_id", sa.String(32), nullable=True))
    op.create_table(
        "files",
        sa.Column("id", sa.String(32)),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("storage_path", sa.String(1024), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_files_tenant_id_tenants", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_files_tenant_id", "files", ["tenant_id"])
    stamps = (
        "in_progress_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    )
    op.create_table(
        "batches",
        sa.Column("id", sa.String(32)),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(32), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("output_file_id", sa.String(32), nullable=True),
        sa.Column("error_file_id", sa.String(32), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        *(sa.Column(name, sa.Float(), nullable=True) for name in stamps),
        sa.Column("runner", sa.String(64), nullable=True),
        sa.Column("heartbeat_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_batches_tenant_id_tenants", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_batches_tenant_id", "batches", ["tenant_id"])
    op.create_index("ix_batches_status", "batches", ["status"])


def downgrade() -> None:
    op.drop_table("batches")
    op.drop_table("files")
    with op.batch_alter_table("usage") as table:
        table.drop_column("batch_id")
    with op.batch_alter_table("api_keys") as table:
        table.drop_column("batch_tokens_per_day")
        table.drop_column("service_tier")
