"""The options `vllm serve --help=all` lists, and whether an argv uses only those.

Read from the help's option lines (`  --tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp
TENSOR_PARALLEL_SIZE`): each line is one option, all its spellings, and whether it takes a
value. tests/samples/vllm-0.32.0-serve-options.txt holds those lines of vLLM 0.32.0, so the
argv checks run where no vLLM is installed; with one, the same checks run on its own help.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RECORDED = Path(__file__).parent / "samples" / "vllm-0.32.0-serve-options.txt"
_SPELLINGS = re.compile(r", (?=-)")  # choices lists have ", " inside brackets, never ", -"
_NUMBER = re.compile(r"^-\d+(\.\d+)?$")


@dataclass(frozen=True)
class Option:
    names: tuple[str, ...]  # every spelling: --x and -x, or --x and --no-x
    takes_value: bool


def parse_options(help_text: str) -> dict[str, Option]:
    """Each spelling -> its option, from the help's option lines (two spaces, then -)."""
    by_name: dict[str, Option] = {}
    for line in help_text.splitlines():
        if not line.startswith("  -"):
            continue
        # the help text may follow on the same line, two spaces or more after the signature
        signature = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        parts = _SPELLINGS.split(signature)
        names = tuple(p.split(" ", 1)[0] for p in parts)
        option = Option(names, takes_value=any(" " in p for p in parts))
        for name in names:
            by_name[name] = option
    return by_name


def recorded_options() -> dict[str, Option]:
    return parse_options(RECORDED.read_text())


def canonical(token: str) -> str:
    """The spelling vLLM's FlexibleArgumentParser looks up: `--max_model_len=5` is
    `--max-model-len`, `-O0` is `--optimization-level`."""
    name = token.split("=", 1)[0]
    if name.startswith("--"):
        return "--" + name[2:].replace("_", "-")
    if name.startswith("-O"):  # -O 3 and -O3 alike
        return "--optimization-level"
    return name


def argv_problems(argv: Sequence[str], options: dict[str, Option]) -> list[str]:
    """What in `vllm serve ...` argv (argv[0] the binary, argv[1] "serve") vLLM would not
    take: a flag it does not have, a flag without its value, a value where none is taken."""
    assert list(argv[1:2]) == ["serve"], argv
    problems: list[str] = []
    rest = list(argv[2:])
    if rest and not rest[0].startswith("-"):
        rest = rest[1:]  # the model, positional
    i = 0
    while i < len(rest):
        token = rest[i]
        i += 1
        if not token.startswith("-") or _NUMBER.match(token):
            problems.append(f"{token!r} stands where a flag should")
            continue
        option = options.get(canonical(token))
        if option is None:
            problems.append(f"{token} is not an option of vllm serve")
            continue
        inline = "=" in token or (token.startswith("-O") and token != "-O")
        if option.takes_value and not inline:
            if i >= len(rest) or (rest[i].startswith("-") and not _NUMBER.match(rest[i])):
                problems.append(f"{token} takes a value and has none")
            i += 1
        elif not option.takes_value and inline:
            problems.append(f"{token} takes no value")
    return problems
