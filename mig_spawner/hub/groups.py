"""The group names a hub has, read from its config and its database (no REST API: the
hub is not running yet when its start-up check asks)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from traitlets.config import Config

from mig_spawner.config import setting_value

#: JupyterHub's own default for ``c.JupyterHub.db_url``.
HUB_DEFAULT_DB_URL = "sqlite:///jupyterhub.sqlite"


def hub_db_url(config: Config) -> str:
    """``c.JupyterHub.db_url``, or JupyterHub's default when the config leaves it unset."""
    return str(config.JupyterHub.get("db_url") or HUB_DEFAULT_DB_URL)


def configured_groups(config: Config) -> set[str]:
    """Groups the hub creates from its config: ``load_groups`` and the groups that
    ``load_roles`` entries name (the hub creates those too)."""
    hub = config.JupyterHub
    names = set(setting_value(hub, "load_groups", {}) or ())
    for role in setting_value(hub, "load_roles", []) or ():
        names.update(role.get("groups") or () if isinstance(role, dict) else ())
    return names


def database_groups(db_url: str) -> set[str] | None:
    """Groups in the hub's database; empty when it does not exist yet, ``None`` when it
    cannot be read (it is the hub's: we only ever read it, and do not create it)."""
    try:
        url = make_url(db_url)
        if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
            return set()
        # A hub database that does not answer must not hold up the hub's start.
        quick = {"connect_timeout": 5} if url.get_backend_name() == "postgresql" else {}
        engine = create_engine(url, connect_args=quick)
        try:
            with engine.connect() as connection:
                if not inspect(connection).has_table("groups"):
                    return set()
                return set(connection.execute(text("SELECT name FROM groups")).scalars())
        finally:
            engine.dispose()
    except (SQLAlchemyError, ValueError, ImportError):
        return None


def hub_groups(config: Config) -> set[str] | None:
    """Every group the hub will have at start: its config's and its database's
    (``None`` when the database cannot be read, so the answer would be a guess)."""
    in_db = database_groups(hub_db_url(config))
    return None if in_db is None else configured_groups(config) | in_db
