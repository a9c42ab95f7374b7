"""Reading API keys from files: how keys reach engines and routers, never through the bucket
(every identity on the bus can read it)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from llmgw.errors import LlmgwError
from llmgw.files import NotRegularFile, open_regular

log = logging.getLogger(__name__)

MAX_SECRET_FILE = 64 * 1024  # a key file is a few lines; anything larger is not one


class SecretFileError(LlmgwError):
    pass


def read_keys(path: str | Path, what: str) -> list[str]:
    """The non-empty, non-comment lines of a key file: one key per line."""
    path = Path(path)
    try:
        # a FIFO is refused, never opened: a plain open() waits for a writer forever
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            data = f.read(MAX_SECRET_FILE + 1)
    except NotRegularFile as e:
        raise SecretFileError(f"{what} file {path} is {e.kind}, not a regular file") from None
    except OSError as e:
        raise SecretFileError(
            f"cannot read the {what} file {path}: {e.strerror or e}; check the path and that "
            "this user may read it"
        ) from None
    if len(data) > MAX_SECRET_FILE:
        raise SecretFileError(f"{what} file {path} is over {MAX_SECRET_FILE} bytes: not a key file")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s file %s can be read by other users: chmod 600 %s", what, path, path)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise SecretFileError(
            f"{what} file {path} is not ASCII text: write one key per line"
        ) from None
    found = [
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    ]
    for k in found:
        if any(c.isspace() for c in k) or not k.isprintable():
            raise SecretFileError(
                f"{what} file {path}: a key contains spaces or control characters"
            )
    if not found:
        raise SecretFileError(f"{what} file {path} holds no key: write one key per line")
    return found


def read_key(path: str | Path, what: str) -> str:
    """The one key in a key file."""
    found = read_keys(path, what)
    if len(found) > 1:
        raise SecretFileError(f"{what} file {path} holds {len(found)} keys; it must hold one")
    return found[0]
