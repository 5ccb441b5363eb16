"""Alembic scripts of the lease ledger (a package so that setuptools ships them)."""
