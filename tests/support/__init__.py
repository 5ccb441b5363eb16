"""Helpers and stand-ins the tests (and benchmarks) share: a real hub harness, stand-ins
for a hub and the Kubernetes API, a PostgreSQL server, a hand-moved clock."""
