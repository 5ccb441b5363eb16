"""How the MIG spawner refuses a spawn: one message for the user, a status for the API.

No JupyterHub import beyond ``SpawnException``: every refusal a user can meet goes
through :func:`spawn_error`, so the spawn page, the progress stream and the REST API
all show the same plain sentence.
"""

from __future__ import annotations

from jupyterhub.spawner import SpawnException

from mig_spawner.core.refusal import Reason


def spawn_error(message: str, reason: Reason, log_message: str = "") -> SpawnException:
    """A SpawnException whose page and API message is ``message`` alone, answered with
    the HTTP status its ``reason`` carries (the one list of reasons says which).

    JupyterHub shows ``str(exception)`` (status, class and reason included) unless
    the exception carries ``jupyterhub_message``.
    """
    error = SpawnException(
        message, reason=reason, status_code=Reason(reason).status, log_message=log_message
    )
    error.jupyterhub_message = message
    return error


def admin_error(problem: str, reason: str, detail: str) -> SpawnException:
    """A 500 for what only a hub admin can fix: ``problem`` for the user (who is told to
    tell an admin), ``detail`` (what is wrong and how to fix it) for the hub log."""
    return spawn_error(f"{problem}; tell a hub admin.", reason, log_message=detail)


def refusal(reason: Reason, message: str) -> SpawnException:
    """A refusal with the HTTP status its reason carries (503: try later or elsewhere)."""
    return spawn_error(message, reason)
