"""Shared pytest fixtures: the PostgreSQL server started for the session."""

from pg_fixture import postgres_server, postgres_url  # noqa: F401
