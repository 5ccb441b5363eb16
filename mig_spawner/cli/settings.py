"""The hub's config as the ``mig-spawner`` subcommands read it: ``--config-dir`` with
the command line's options over its shared settings (``c.MIGSettings``), and what the
subcommands open through it (the ledger's URL, the GPUs, the groups' policies)."""

from __future__ import annotations

import argparse

from traitlets.config import Config

from ..config import MIGPolicyConfig, MIGSettings, load_config_files


def hub_config(args: argparse.Namespace) -> Config:
    """The hub's config from ``--config-dir`` (empty without it), with the command
    line's ``--simulate``, ``--sim-state`` and ``--ledger-url`` over its ``c.MIGSettings``."""
    config = load_config_files(args.config_dir) if args.config_dir else Config()
    given = {"simulate": args.simulate, "sim_state_file": args.sim_state,
             "ledger_url": getattr(args, "ledger_url", None)}
    config.MIGSettings.merge({name: value for name, value in given.items() if value})
    return config


def ledger_url(args: argparse.Namespace) -> str:
    """The ledger the hub uses, as its config says (``--ledger-url`` wins)."""
    from ..hub.groups import hub_db_url  # reads SQLAlchemy: only when asked

    config = hub_config(args)
    return MIGSettings(config=config).ledger_location(hub_db_url(config))


def connect_gpus(args: argparse.Namespace):
    """The GPU adapter the hub's config names (the simulator or the driver)."""
    from ..gpu import connect

    shared = MIGSettings(config=hub_config(args))
    return connect(simulate=shared.simulate, state_file=shared.sim_state_file)


def read_inventory(args: argparse.Namespace):
    """The inventory (read-only); a GpuError reaches ``mig-spawner``'s main, which prints it."""
    adapter = connect_gpus(args)
    try:
        return adapter.inventory()
    finally:
        adapter.close()


def allowed_by(config_dir: str | None) -> dict[str, list[str]]:
    """Profile -> the groups whose policy in ``config_dir`` allows it (a class counts
    for each profile it names); empty without a config."""
    if config_dir is None:
        return {}
    policies = MIGPolicyConfig(config=load_config_files(config_dir)).build()
    found: dict[str, list[str]] = {}
    for group in (*policies.groups.values(), policies.default):
        for key in group.allowed:
            offer = policies.offers[key]
            for profile in offer.profiles.values() if offer.is_class else (key,):
                found.setdefault(profile, []).append(group.name)
    return found
