"""A field of a multipart/form-data body (RFC 7578), found without copying the body.

The audio routes (`/v1/audio/transcriptions`, `/v1/audio/translations`) name their model
in a form field beside the file. The router reads that one field and forwards the body as
it came: parts are located by offsets in the bytes already read (the file is never copied,
nor decoded), and the scan is bounded in parts, in the size of a part's head and in the
size of the value read. Anything malformed is the client's 400, named.
"""

from __future__ import annotations

import re

MAX_PARTS = 256  # form fields and files in one request
MAX_PART_HEAD = 8 * 1024  # a part's headers
MAX_VALUE = 1024  # the value of a field read (a model name)
MAX_BOUNDARY = 70  # RFC 2046

_BOUNDARY = re.compile(rb'boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))', re.IGNORECASE)
_NAME = re.compile(rb'\bname="([^"]*)"|\bname=([^\s;"]+)', re.IGNORECASE)


class FormError(ValueError):
    """The body is not the multipart/form-data its Content-Type says."""


def is_multipart(content_type: bytes | None) -> bool:
    return content_type is not None and content_type[:19].lower() == b"multipart/form-data"


def boundary(content_type: bytes) -> bytes:
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise FormError("its Content-Type is multipart/form-data with no boundary")
    value = m.group(1) or m.group(2)
    if len(value) > MAX_BOUNDARY:  # (the pattern stops at 70; kept for clarity)
        raise FormError("its multipart boundary is over 70 characters")
    return value


def form_fields(body: bytes, content_type: bytes, names: frozenset[bytes]) -> dict[bytes, bytes]:
    """The values of the text fields `names`, as bytes, at most MAX_VALUE each; raises
    FormError for a body that is not a form, or that gives one of `names` twice (which of
    the two an engine takes is its form parser's choice: the router must not authorise one
    and send the other)."""
    delimiter = b"--" + boundary(content_type)
    found: dict[bytes, bytes] = {}
    at = _first_delimiter(body, delimiter)
    for _ in range(MAX_PARTS):
        at += len(delimiter)
        if body.startswith(b"--", at):
            return found  # the close delimiter: the form is complete
        at = _line_end(body, at)
        head_end = body.find(b"\r\n\r\n", at, at + MAX_PART_HEAD + 4)
        if head_end < 0:
            raise FormError(
                f"a part's headers do not end within {MAX_PART_HEAD} bytes (or the body ends)"
            )
        name = _part_name(body[at:head_end])
        content = head_end + 4
        end = _next_delimiter(body, delimiter, content)
        if name in names:
            if name in found:
                raise FormError(f"form field {name.decode()!r} is given twice: send it once")
            if end - content > MAX_VALUE:
                raise FormError(
                    f"form field {name.decode(errors='replace')!r} is over {MAX_VALUE} bytes"
                )
            found[name] = body[content:end]
        at = end + 2
    raise FormError(f"the form has more than {MAX_PARTS} parts")


def _next_delimiter(body: bytes, delimiter: bytes, at: int) -> int:
    """Where the part that starts at `at` ends: the CRLF before the next delimiter line
    (the delimiter then "--", or spaces and CRLF; content that merely starts like one is
    content)."""
    marker = b"\r\n" + delimiter
    while True:
        end = body.find(marker, at)
        if end < 0:
            raise FormError("the form ends without its closing boundary")
        after = end + len(marker)
        rest = body[after : after + 2]
        if rest == b"--" or rest == b"\r\n" or rest[:1] in (b" ", b"\t"):
            return end
        at = end + 1


def _first_delimiter(body: bytes, delimiter: bytes) -> int:
    if body.startswith(delimiter):
        return 0
    at = body.find(b"\r\n" + delimiter)  # after a preamble, which is ignored
    if at < 0:
        raise FormError("the body does not contain its multipart boundary")
    return at + 2


def _line_end(body: bytes, at: int) -> int:
    """Past the delimiter line's CRLF (transport padding, spaces or tabs, allowed before it)."""
    end = body.find(b"\r\n", at, at + 256)
    if end < 0 or body[at:end].strip(b" \t"):
        raise FormError("a multipart boundary line is malformed")
    return end + 2


def _part_name(head: bytes) -> bytes | None:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-disposition":
            m = _NAME.search(value)
            if m is not None:
                return m.group(1) if m.group(1) is not None else m.group(2)
    return None
