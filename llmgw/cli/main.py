"""The `llmgw` group: every command of llmgw/cli/ under one name."""

from __future__ import annotations

import importlib
import os

import click

from llmgw import __version__
from llmgw.cli.common import StatedErrors
from llmgw.logs import setup_logging

# Each command's module, imported when that command runs (or when --help lists them all):
# `llmgw controller` does not load the router, the agent or the PKI. Importing every
# command was 0.6 s of each start, a seventh of a controller's first pass at 10,000 nodes.
COMMANDS = {
    "up": "llmgw.cli.up",
    "status": "llmgw.cli.status",
    "controller": "llmgw.cli.controller",
    "place": "llmgw.cli.place",
    "rollout": "llmgw.cli.rollout",
    "node": "llmgw.cli.node",
    "catalog": "llmgw.cli.catalog",
    "adapter": "llmgw.cli.adapter",
    "router": "llmgw.cli.router",
    "agent": "llmgw.cli.agent",
    "sim": "llmgw.cli.sim",
    "pki": "llmgw.cli.pki",
    "key": "llmgw.cli.key",
    "team": "llmgw.cli.team",
    "usage": "llmgw.cli.usage",
    "audit": "llmgw.cli.audit",
}


class _Commands(StatedErrors):
    """`llmgw`: its commands loaded on first use (COMMANDS), in the order listed there."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMANDS.get(cmd_name)
        if module is None:
            return None
        # each module defines its command under the command's own name
        command = getattr(importlib.import_module(module), cmd_name)
        assert isinstance(command, click.Command)
        return command


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__)
@click.option(
    "--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "WARNING"), show_default=True
)
def main(log_level: str) -> None:
    """llmgw: LLM engines on a GPU fleet behind one OpenAI-compatible endpoint."""
    setup_logging(log_level)
