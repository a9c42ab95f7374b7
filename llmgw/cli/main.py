"""The `llmgw` group: every command of llmgw/cli/ under one name."""

from __future__ import annotations

import os

import click

from llmgw import __version__
from llmgw.cli.agent import agent
from llmgw.cli.catalog import catalog
from llmgw.cli.controller import controller
from llmgw.cli.pki import pki
from llmgw.cli.place import place
from llmgw.cli.router import router
from llmgw.cli.status import status
from llmgw.cli.up import up
from llmgw.errors import stated
from llmgw.logs import setup_logging


class _Commands(click.Group):
    """Errors llmgw states for a person become messages (exit 1); any other exception is a
    bug and keeps its traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BaseException as e:
            problem = stated(e)
            if problem is None:
                raise
            raise click.ClickException(str(problem)) from None


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__)
@click.option(
    "--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "WARNING"), show_default=True
)
def main(log_level: str) -> None:
    """llmgw: LLM engines on a GPU fleet behind one OpenAI-compatible endpoint."""
    setup_logging(log_level)


for command in (up, status, controller, place, catalog, router, agent, pki):
    main.add_command(command)
