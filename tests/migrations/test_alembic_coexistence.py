"""An application with an alembic history of its own, in the database the toolkit migrated:
``alembic revision --autogenerate`` run with ``outbox.migrate.include_name`` (or
``include_object``) in the application's ``env.py`` proposes nothing for the toolkit's tables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from outbox import migrate

# The application: env.py reads its metadata from app_models.py; `hook` picks the filter.
ENV_PY = """
from alembic import context
import app_models
from outbox import migrate

config = context.config
hook = config.attributes["hook"]
options = {}
if hook == "include_name":
    options["include_name"] = migrate.include_name
elif hook == "include_object":
    options["include_object"] = migrate.include_object
context.configure(
    connection=config.attributes["connection"], target_metadata=app_models.metadata, **options
)
with context.begin_transaction():
    context.run_migrations()
"""
MODELS_PY = """
import sqlalchemy as sa

metadata = sa.MetaData()
customers = sa.Table("customers", metadata, sa.Column("id", sa.Integer, primary_key=True))
invoices = sa.Table("invoices", metadata, sa.Column("id", sa.Integer, primary_key=True))
"""
FIRST_REVISION = '''
"""customers"""
from alembic import op
import sqlalchemy as sa

revision = "a1"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table("customers", sa.Column("id", sa.Integer, primary_key=True))


def downgrade():
    op.drop_table("customers")
'''
MAKO = '''"""${message}"""
from alembic import op
import sqlalchemy as sa
${imports if imports else ""}
revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = None
depends_on = None


def upgrade():
    ${upgrades if upgrades else "pass"}


def downgrade():
    ${downgrades if downgrades else "pass"}
'''
OUTBOX_NAMES = re.compile(r"idempotency_keys|outbox_cache_secret|outbox_alembic_version|'outbox'")


def _app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "versions").mkdir()
    (tmp_path / "env.py").write_text(ENV_PY)
    (tmp_path / "script.py.mako").write_text(MAKO)
    (tmp_path / "app_models.py").write_text(MODELS_PY)
    (tmp_path / "versions" / "a1_customers.py").write_text(FIRST_REVISION)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _autogenerate(app: Path, engine: sa.Engine, hook: str) -> str:
    """Upgrade the application to its head, then autogenerate its next revision's upgrade()."""
    with engine.begin() as conn:
        cfg = Config()
        cfg.set_main_option("script_location", str(app))
        cfg.attributes.update(connection=conn, hook=hook)
        command.upgrade(cfg, "head")
        script = command.revision(cfg, message="next", autogenerate=True, rev_id=f"b_{hook}")
    assert script is not None
    text = Path(script.path).read_text()
    return text.split("def upgrade", 1)[1].split("def downgrade", 1)[0]


@pytest.mark.parametrize("hook", ["include_name", "include_object"])
def test_autogenerate_with_the_hook_leaves_the_outbox_tables_alone(
    hook: str, engine: sa.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _app(tmp_path, monkeypatch)
    upgrade = _autogenerate(app, engine, hook)
    assert "create_table('invoices'" in upgrade  # the application's own change is seen
    assert OUTBOX_NAMES.findall(upgrade) == []
    assert set(sa.inspect(engine).get_table_names()) >= migrate.OUTBOX_TABLES | {"alembic_version"}


def test_autogenerate_without_the_hook_would_drop_all_four(
    engine: sa.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Why the hook exists: the outbox tables are not in the application's metadata.
    upgrade = _autogenerate(_app(tmp_path, monkeypatch), engine, "none")
    dropped = set(re.findall(r"op\.drop_table\('(\w+)'\)", upgrade))
    assert dropped == set(migrate.OUTBOX_TABLES)
