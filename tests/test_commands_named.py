"""Every `llmgw ...` command a doc or a message names is a command there is, with the
options it names: `llmgw key revoke nobody` once advised `llmgw apikey ls`, which is not.

Read: the README, docs/, deploy/, nats/ and examples/ (inline `llmgw ...` and the lines of
their code blocks and units), and every backquoted `llmgw ...` in llmgw/'s sources (the
messages a person is told)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import click

from llmgw.cli.main import main

ROOT = Path(__file__).parent.parent
# backquoted, as messages and prose name a command: `llmgw key ls`, `.venv/bin/llmgw up`
INLINE = re.compile(r"`(?:[\w./~-]*/)?llmgw ([^`]+)`")
# a command a code block or a unit runs: first on its line (or after `sudo`, `&&`, `;`,
# `ExecStart=`), to the end of its line or shell command
RUN = re.compile(r"(?:^\s*|[;&|=]\s*|\bsudo\s+)(?:[\w./~-]*/)?llmgw ([^#;&|\n]+)", re.M)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# a command's name built at run time, from the command that runs: nothing to check
DYNAMIC_OK = {"llmgw node {verb}"}


def _named_in_docs() -> list[tuple[str, str]]:
    found = []
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in docs:
        text = path.read_text()
        found += [(path.name, m.group(1)) for m in INLINE.finditer(FENCE.sub("", text))]
        for block in FENCE.finditer(text):
            if block.group(1) in ("", "sh", "bash", "console"):
                found += _runs(path.name, block.group(2))
    for folder in ("deploy", "nats", "examples"):
        for path in sorted((ROOT / folder).iterdir()):
            if path.is_file() and path.suffix in (".service", ".conf", ".toml", ".yml"):
                text = path.read_text()
                found += [(path.name, m.group(1)) for m in INLINE.finditer(text)]
                if path.suffix == ".service":
                    found += [
                        (path.name, m) for m in re.findall(r"^ExecStart=\S*llmgw (.*)", text, re.M)
                    ]
    return found


def _runs(where: str, text: str) -> list[tuple[str, str]]:
    # `\` continues a shell line
    return [(where, m.group(1)) for m in RUN.finditer(text.replace("\\\n", " "))]


def _named_in_sources() -> list[tuple[str, str]]:
    found = []
    for path in sorted((ROOT / "llmgw").rglob("*.py")):
        text = path.read_text()
        found += [(str(path.relative_to(ROOT)), m.group(1)) for m in INLINE.finditer(text)]
    return found


def _words(text: str) -> list[list[str]]:
    """The commands `text` names: `key|team create|set` is four, `rollout status/undo` two."""
    words = [w.strip("[](),.:;'\"") for w in text.split()]
    choices = [
        re.split(r"[|/]", w) if re.fullmatch(r"[a-z-]+([|/][a-z-]+)+", w) else [w]
        for w in words
        if w
    ]
    return [list(p) for p in itertools.product(*choices)]


def _placeholder(word: str) -> bool:
    return (
        word.isupper()
        or word[0] in "<{$.~/"
        or word in ("...", "FLEET.toml", "FILE.toml", "MODEL", "NAME")
    )


def unknown_in(text: str) -> list[str]:
    """What `llmgw <text>` names that is not there (empty: every word is)."""
    problems = []
    for words in _words(text):
        problems += _unknown(words)
    return problems


def _unknown(words: list[str]) -> list[str]:
    command: click.Command = main
    ctx = click.Context(main, info_name="llmgw")
    path = ["llmgw"]
    rest = list(words)
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        word = rest.pop(0)
        if "{" in word and f"{' '.join(path)} {word}" in DYNAMIC_OK:
            return []
        if _placeholder(word):
            return [f"{' '.join(path)} {word}: a command's name is not a placeholder"]
        sub = command.get_command(ctx, word)
        if sub is None:
            known = ", ".join(command.list_commands(ctx))
            return [f"{' '.join(path)} has no command {word!r} (it has: {known})"]
        path.append(word)
        command = sub
    options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    options |= {"--help", "-h"} | ({"--version"} if command is main else set())
    return [
        f"{' '.join(path)} has no option {word.split('=')[0]}"
        for word in rest
        if word.startswith("-") and len(word) > 1 and word.split("=")[0] not in options
    ]


NAMED = _named_in_docs() + _named_in_sources()


def test_the_commands_are_found_where_they_are_named() -> None:
    """A scan that found nothing would pass anything."""
    texts = {text for _, text in NAMED}
    assert any(t.startswith("key create") for t in texts)
    assert any(t.startswith("place qwen2-5-7b --replicas 2 --dry-run") for t in texts)
    assert any(t.startswith("router --listen 0.0.0.0:8080") for t in texts)  # a unit
    assert len(NAMED) > 200, len(NAMED)


def test_the_check_refuses_what_is_not_a_command() -> None:
    assert unknown_in("apikey ls") == [
        "llmgw has no command 'apikey' (it has: up, status, controller, place, rollout, node, "
        "catalog, adapter, router, agent, sim, pki, key, team, usage, audit)"
    ]
    assert unknown_in("key revoke NAME --grace 1h") == ["llmgw key revoke has no option --grace"]
    assert unknown_in("key|team ls") == []
    assert unknown_in("node cordon node07 [--gpu 3]") == []


def test_every_command_named_is_a_command() -> None:
    problems = [f"{where}: `llmgw {text}`: {p}" for where, text in NAMED for p in unknown_in(text)]
    assert not problems, "\n".join(problems)
