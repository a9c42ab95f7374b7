"""The `llmgw` group: every command of llmgw/cli/ under one name."""

from __future__ import annotations

import os

import click

from llmgw import __version__
from llmgw.cli.agent import agent
from llmgw.cli.catalog import catalog
from llmgw.cli.common import StatedErrors
from llmgw.cli.controller import controller
from llmgw.cli.node import node
from llmgw.cli.pki import pki
from llmgw.cli.place import place
from llmgw.cli.rollout import rollout
from llmgw.cli.router import router
from llmgw.cli.sim import sim
from llmgw.cli.status import status
from llmgw.cli.up import up
from llmgw.logs import setup_logging


@click.group(cls=StatedErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__)
@click.option(
    "--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "WARNING"), show_default=True
)
def main(log_level: str) -> None:
    """llmgw: LLM engines on a GPU fleet behind one OpenAI-compatible endpoint."""
    setup_logging(log_level)


for command in (up, status, controller, place, rollout, node, catalog, router, agent, sim, pki):
    main.add_command(command)
