"""The agent's readers of files it does not control: llmgw/files.py, shared since with the
CLI, the catalog, key files and the bus's TLS files."""

from llmgw.files import (
    NotRegularFile,
    TooLarge,
    bounded_lines,
    open_regular,
    open_regular_fd,
    open_regular_for_append,
    read_bounded,
    read_text_bounded,
)

__all__ = [
    "NotRegularFile",
    "TooLarge",
    "bounded_lines",
    "open_regular",
    "open_regular_fd",
    "open_regular_for_append",
    "read_bounded",
    "read_text_bounded",
]
