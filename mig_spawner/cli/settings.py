"""The hub's config as the ``mig-spawner`` subcommands read it: ``--config-dir`` with
the command line's options over its shared settings (``c.MIGSettings``)."""

from __future__ import annotations

import argparse

from traitlets.config import Config

from ..config import load_config_files


def hub_config(args: argparse.Namespace) -> Config:
    """The hub's config from ``--config-dir`` (empty without it), with the command
    line's ``--simulate``, ``--sim-state`` and ``--ledger-url`` over its ``c.MIGSettings``."""
    config = load_config_files(args.config_dir) if args.config_dir else Config()
    given = {"simulate": args.simulate, "sim_state_file": args.sim_state,
             "ledger_url": getattr(args, "ledger_url", None)}
    config.MIGSettings.merge({name: value for name, value in given.items() if value})
    return config
