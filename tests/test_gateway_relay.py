"""What the gateway reads of an answer as the router relays it: the engine's usage from a
whole answer or a stream's usage chunk, however the bytes are cut, a stream cut short
charged what it generated, and the meter equal to a real llama-server's own count."""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from real_llama import RunningLlamaServer, serving_tiny_model, tiny_gguf

from llmgw.bus import keys, records
from llmgw.gateway import credentials, usage
from llmgw.gateway.gateway import Admission, Gateway
from llmgw.gateway.relay import MAX_LINE, GatewayTicket, UsageReader

pytestmark = pytest.mark.anyio

STREAM = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,'
    b'"total_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
    b"data: [DONE]\n\n"
)


def _pieces(data: bytes, rng: random.Random) -> Iterator[bytes]:
    i = 0
    while i < len(data):
        n = rng.randint(1, 40)
        yield data[i : i + n]
        i += n


def test_a_stream_s_usage_is_read_however_its_bytes_are_cut() -> None:
    rng = random.Random(3)
    for _ in range(50):
        reader = UsageReader(stream=True)
        for piece in _pieces(STREAM, rng):
            reader.feed(piece)
        assert reader.usage() == usage.Usage(7, 2, 4)
        assert reader.events == 4  # the usage chunk is not output


def test_a_stream_cut_short_is_charged_what_it_generated() -> None:
    reader = UsageReader(stream=True)
    reader.feed(STREAM[: STREAM.index(b'data: {"choices":[{"index":0,"delta":{},')])
    assert reader.usage(prompt_estimate=5) == usage.Usage(5, 3)
    assert UsageReader(stream=True).usage() is None  # nothing came: nothing known


def test_a_whole_answer_s_usage_is_read_and_an_oversized_one_is_not_parsed() -> None:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 8}})
    reader = UsageReader(stream=False)
    for piece in _pieces(body.encode(), random.Random(1)):
        reader.feed(piece)
    assert reader.usage() == usage.Usage(3, 8)
    big = UsageReader(stream=False)
    big.feed(b"x" * (usage.MAX_USAGE_JSON + 1))
    assert big.usage() is None


def test_a_stream_line_longer_than_the_bound_is_counted_not_kept() -> None:
    reader = UsageReader(stream=True)
    reader.feed(b"data: " + b"x" * (MAX_LINE + 10))
    reader.feed(b"\n\n" + STREAM)
    assert reader.usage() == usage.Usage(7, 2, 4)
    assert reader.events == 5
    assert len(reader._line) == 0


def _stripping_ticket() -> GatewayTicket:
    """A ticket of a stream whose client did not ask for usage: the gateway asked the
    engine, and takes the usage chunk back out."""
    admitted = Admission(Gateway("r", _NoCounter()), None, None, "m", "", True, 0.0)
    return GatewayTicket(admitted, stream=True, strip=True)


def test_the_usage_chunk_asked_for_is_taken_out_however_the_stream_is_cut() -> None:
    without = STREAM.replace(STREAM[STREAM.index(b'data: {"choices":[],') :], b"data: [DONE]\n\n")
    rng = random.Random(7)
    for _ in range(50):
        ticket = _stripping_ticket()
        pieces = list(_pieces(STREAM, rng))
        relayed = b"".join(
            ticket.chunk(p, last=i == len(pieces) - 1) or b"" for i, p in enumerate(pieces)
        )
        assert relayed == without  # the client gets every event but the usage one
        assert ticket.usage() == usage.Usage(7, 2, 4)  # and the meter the engine's count


def test_a_stream_ending_inside_an_event_passes_on_what_was_held() -> None:
    """An engine whose last event lacks its blank line: what the ticket held back waiting
    for the event's end goes to the client with the answer's last bytes, not lost."""
    ticket = _stripping_ticket()
    first = ticket.chunk(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"cho', False)
    assert first == b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    rest = ticket.chunk(b'ices":[{"delta":{"content":"b"}}]}\n', True)
    assert rest == b'data: {"choices":[{"delta":{"content":"b"}}]}\n'


# what engines may put in a stream beside output: comments, blank data lines, CRLF line
# ends, [DONE] written without its space; 5 events of output, and a usage chunk
ODD_STREAM = (
    b": a comment the engine sends to keep the connection\n\n"
    b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\r\n\r\n'
    b"data:\n\n"
    b"data: \t\x0b\r\n\n"
    b'data:{"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n'
    b'event: message\ndata: {"choices":[{"index":0,"delta":{"content":"c"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"[DONE] is text here"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n'
    b"data:[DONE]\n\n"
)


def _events(data: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in data.split(b"\n\n")[:-1]]


@pytest.mark.parametrize("cut", ["events", "bytes", "whole"])
def test_a_stream_s_output_is_counted_alike_whether_it_comes_in_whole_events_or_cut(
    cut: str,
) -> None:
    """Whole events (an engine's writes, read on the fast path) and pieces cut anywhere
    (read line by line) give the same count of output, the same usage, and the client the
    same bytes, the usage chunk taken out."""
    without = ODD_STREAM.replace(
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n', b""
    )
    for seed in range(20):
        if cut == "events":
            pieces = _events(ODD_STREAM)
        elif cut == "bytes":
            pieces = list(_pieces(ODD_STREAM, random.Random(seed)))
        else:
            pieces = [ODD_STREAM]
        ticket = _stripping_ticket()
        relayed = b"".join(
            ticket.chunk(p, last=i == len(pieces) - 1) or b"" for i, p in enumerate(pieces)
        )
        assert ticket.events == 5
        assert ticket.usage() == usage.Usage(3, 4)
        assert relayed == without


class _NoCounter:
    async def add(self, subject: str, delta: int, msg_id: str | None = None) -> int:
        raise AssertionError("nothing limited here")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def llama_server(tiny_model: Path, tmp_path: Path) -> Iterator[RunningLlamaServer]:
    with serving_tiny_model(tiny_model, tmp_path) as server:
        yield server


@pytest.mark.parametrize("stream", [True, False])
async def test_the_meter_counts_what_a_real_llama_server_says_it_used(
    llama_server: RunningLlamaServer, stream: bool
) -> None:
    gateway = Gateway("r", _NoCounter())
    secret = credentials.new_secret("k")  # a key without limits: metered, nothing claimed
    gateway.apply(
        keys.apikey("k"), records.ApiKey(name="k", secrets=[credentials.hash_secret(secret)])
    )
    body: dict[str, object] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "count to ten"}],
        "max_tokens": 12,
        "stream": stream,
    }
    client_asked = usage.ask_for_usage(body)
    assert client_asked is False
    admitted = await gateway.admit(authorization=f"Bearer {secret}", model="tiny", stream=stream)
    assert isinstance(admitted, Admission)
    ticket = GatewayTicket(admitted, stream=stream)
    conn = http.client.HTTPConnection("127.0.0.1", llama_server.port, timeout=60)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"}
    )
    resp = conn.getresponse()
    raw = b""
    while piece := resp.read1(97):
        raw += piece
        ticket.chunk(piece)
    conn.close()
    ticket.settle(resp.status, "ok")
    if stream:
        last = [line for line in raw.split(b"\n") if b'"usage"' in line][-1]
        engine = usage.of_json(last[len(b"data: ") :])
    else:
        engine = usage.of_json(raw)
    assert engine is not None and engine.completion > 0
    assert gateway.tokens[("", "tiny")] == [engine.prompt, engine.completion, engine.cached]
    assert gateway.meter.pending() == 1 + engine.prompt + engine.completion + engine.cached
