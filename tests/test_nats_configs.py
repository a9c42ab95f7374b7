"""The shipped nats-server configs are valid for the nats-server the wheel installs."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.bus.server import find_nats_server

NATS_DIR = Path(__file__).parent.parent / "nats"
CONFIGS = sorted(NATS_DIR.glob("*.conf"))


def test_there_are_configs_to_check() -> None:
    assert CONFIGS


@pytest.mark.parametrize("conf", CONFIGS, ids=lambda p: p.name)
def test_nats_config_is_valid(conf: Path) -> None:
    out = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=conf.parent,
    )
    assert out.returncode == 0, out.stderr + out.stdout


DOCS = Path(__file__).parent.parent / "docs" / "security.md"
ETC = "/etc/nats/"  # where docs/security.md puts the server's files


def _documented_setup() -> tuple[list[str], str, str]:
    """From docs/security.md: the generator's arguments, the file it writes, and the include
    line of step 5, as written."""
    text = DOCS.read_text()
    command = re.search(r"python -m llmgw\.bus\.permissions (.*?)\n   ```", text, re.S)
    assert command, "docs/security.md lost the generator command"
    words = shlex.split(command.group(1).replace("\\\n", " "))
    assert words[-2] == ">", words
    include = re.search(r"^\s*(include \S+)", text, re.M)
    assert include, "docs/security.md lost step 5's include line"
    return words[:-2], words[-1], include.group(1)


def test_the_documented_mtls_setup_is_valid_as_written(tmp_path: Path) -> None:
    args, users_file, include = _documented_setup()
    etc = tmp_path / "etc-nats"
    etc.mkdir()
    assert users_file.startswith(ETC)
    generated = subprocess.run(
        [sys.executable, "-m", "llmgw.bus.permissions", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    (etc / users_file.removeprefix(ETC)).write_text(generated.stdout)
    # nats/mtls.conf with step 5 applied: absolute TLS paths, the include for the block
    conf = (NATS_DIR / "mtls.conf").read_text()
    conf = re.sub(
        r"# BEGIN generated.*# END generated",
        include.replace(ETC, str(etc) + "/"),
        conf,
        flags=re.S,
    )
    conf = conf.replace('"example-certs/', f'"{NATS_DIR / "example-certs"}/')
    conf = re.sub(r'store_dir: "[^"]*"', f'store_dir: "{tmp_path / "js"}"', conf)
    (etc / "nats-server.conf").write_text(conf)
    out = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(etc / "nats-server.conf")],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",  # not the config's directory: what the docs say must hold from anywhere
    )
    assert out.returncode == 0, out.stderr + out.stdout
