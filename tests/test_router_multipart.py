"""Reading a route's body: a multipart form's model field (bounded, found wherever it is,
the file never read as a field), and the affinity keys of the routes beyond chat."""

from __future__ import annotations

import json

import pytest

from llmgw.router import multipart
from llmgw.router.request import Affinity, BadRequest, parse

CT = b"multipart/form-data; boundary=XyZ"


def _part(name: str, value: bytes, extra: str = "") -> bytes:
    return (
        f'--XyZ\r\nContent-Disposition: form-data; name="{name}"{extra}\r\n\r\n'.encode()
        + value
        + b"\r\n"
    )


def test_a_forms_fields_are_found_in_any_order_after_a_file_and_a_preamble():
    body = (
        b"a preamble to ignore\r\n"
        + _part("file", b"RIFF\r\n--XyZ-not-quite" * 100, '; filename="a.wav"')
        + _part("model", b"whisper")
        + _part("stream", b"true")
        + b"--XyZ--\r\n"
    )
    fields = multipart.form_fields(body, CT, frozenset((b"model", b"stream", b"file2")))
    assert fields == {b"model": b"whisper", b"stream": b"true"}
    parsed = parse(body, session=None, content_type=CT)
    assert (parsed.model, parsed.stream, parsed.affinity) == ("whisper", True, None)
    quoted = b'multipart/form-data; boundary="XyZ"'
    assert parse(body, session=b"s1", content_type=quoted).affinity is not None


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"no boundary anywhere", "does not contain its multipart boundary"),
        (_part("model", b"m"), "ends without its closing boundary"),
        (_part("model", b"m" * (multipart.MAX_VALUE + 1)) + b"--XyZ--", "over 1024 bytes"),
        (
            b"--XyZ\r\n" + b"X-Pad: " + b"a" * multipart.MAX_PART_HEAD + b"\r\n\r\nv\r\n--XyZ--",
            "headers do not end",
        ),
        (_part("a", b"1") * (multipart.MAX_PARTS + 1) + b"--XyZ--", "more than 256 parts"),
        (b"--XyZ garbage\r\n", "boundary line is malformed"),
        (_part("file", b"x") + b"--XyZ--", "no `model` field"),
        # the router would authorise the first while an engine's form parser may take the
        # last (starlette's does)
        (_part("model", b"allowed") + _part("model", b"other") + b"--XyZ--", "given twice"),
        (
            _part("model", b"m")
            + _part("stream", b"false")
            + _part("stream", b"true")
            + b"--XyZ--",
            "twice",
        ),
    ],
    ids=[
        "no-boundary",
        "unclosed",
        "long-value",
        "long-head",
        "many-parts",
        "bad-line",
        "no-model",
        "model-twice",
        "stream-twice",
    ],
)
def test_a_malformed_or_unbounded_form_is_the_clients_400_named(body, says):
    with pytest.raises(BadRequest) as e:
        parse(body, session=None, content_type=CT)
    assert says in str(e.value)


def test_a_form_whose_content_type_has_no_boundary_is_refused():
    with pytest.raises(BadRequest, match="no boundary"):
        parse(_part("model", b"m"), session=None, content_type=b"multipart/form-data")


def _body(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def test_a_responses_conversation_keeps_its_key_as_it_grows_and_others_differ():
    opening = [{"role": "user", "content": "plan a trip"}]
    later = opening + [
        {"role": "assistant", "content": "where to?"},
        {"role": "user", "content": "Rome"},
    ]
    first = parse(
        _body(input=opening, instructions="brief"), session=None, affinity=Affinity.RESPONSES
    )
    again = parse(
        _body(input=later, instructions="brief"), session=None, affinity=Affinity.RESPONSES
    )
    other = parse(
        _body(input=opening, instructions="verbose"), session=None, affinity=Affinity.RESPONSES
    )
    text = parse(_body(input="plan a trip"), session=None, affinity=Affinity.RESPONSES)
    assert first.affinity == again.affinity is not None
    assert other.affinity not in (None, first.affinity)
    assert text.affinity not in (None, first.affinity)


def test_infill_keeps_a_file_on_one_replica_and_rerank_has_no_affinity():
    a = parse(
        _body(input_prefix="import os\n", input_suffix="x"), session=None, affinity=Affinity.INFILL
    )
    b = parse(
        _body(input_prefix="import os\n", input_suffix="y"), session=None, affinity=Affinity.INFILL
    )
    assert a.affinity == b.affinity is not None
    rerank = parse(_body(query="q", documents=["d"]), session=None, affinity=Affinity.NONE)
    assert rerank.affinity is None
