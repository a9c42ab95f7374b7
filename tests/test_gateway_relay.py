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
from llmgw.gateway.relay import MAX_LINE, NATIVE_KEY, GatewayTicket, UsageReader

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


def test_a_whole_answer_s_usage_is_read_whatever_its_size() -> None:
    """Over 1 MiB an answer is not kept whole: its usage is found in its last bytes (chat,
    completions, responses) or its first (llama-server's embeddings), however it is cut."""
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 8}})
    reader = UsageReader(stream=False)
    for piece in _pieces(body.encode(), random.Random(1)):
        reader.feed(piece)
    assert reader.usage() == usage.Usage(3, 8)
    text = "tok " * (usage.MAX_USAGE_JSON // 2)
    last = json.dumps(
        {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": len(text) // 4},
        }
    ).encode()
    first = json.dumps(
        {"usage": {"prompt_tokens": 9, "total_tokens": 9}, "data": [{"embedding": [0.5] * 10**6}]}
    ).encode()
    for answer, said in ((last, usage.Usage(5, len(text) // 4)), (first, usage.Usage(9, 0))):
        assert len(answer) > usage.MAX_USAGE_JSON
        for size in (1000, 65536, len(answer)):
            big = UsageReader(stream=False)
            for i in range(0, len(answer), size):
                big.feed(answer[i : i + size])
            assert big.usage() == said
    nothing = UsageReader(stream=False)
    nothing.feed(b"x" * (usage.MAX_USAGE_JSON + 1))
    assert nothing.usage() is None


def test_a_stream_line_longer_than_the_bound_is_counted_not_kept() -> None:
    reader = UsageReader(stream=True)
    reader.feed(b"data: " + b"x" * (MAX_LINE + 10))
    reader.feed(b"\n\n" + STREAM)
    assert reader.usage() == usage.Usage(7, 2, 4)
    assert reader.events == 5
    assert len(reader._line) == 0


def test_a_responses_stream_s_last_event_is_read_however_long() -> None:
    """The responses API ends its stream with all its text and its usage in one event: past
    MAX_LINE its usage is searched for, not lost."""
    text = "tok " * MAX_LINE
    done = {
        "type": "response.completed",
        "response": {
            "output": [{"content": [{"type": "output_text", "text": text}]}],
            "usage": {"input_tokens": 6, "output_tokens": 3, "total_tokens": 9},
        },
    }
    stream = (
        b'event: response.created\ndata: {"type":"response.created","response":{"usage":null}}\n\n'
        + b"".join(
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"delta":"tok "}\n\n'
            for _ in range(3)
        )
        + b"event: response.completed\ndata: "
        + json.dumps(done).encode()
        + b"\n\n"
    )
    reader = UsageReader(stream=True)
    for i in range(0, len(stream), 50000):
        reader.feed(stream[i : i + 50000])
    assert reader.usage() == usage.Usage(6, 3)


# each route's usage in its engine's own names (as llama-server and vLLM write them)
ROUTE_ANSWERS = [
    (
        b'{"object":"response","usage":{"input_tokens":5,"input_tokens_details":'
        b'{"cached_tokens":2},"output_tokens":7,"total_tokens":12}}',
        usage.Usage(5, 7, 2),
    ),
    (b'{"id":"rerank-1","usage":{"total_tokens":11},"results":[]}', usage.Usage(11, 0)),
    (b'{"usage":{"prompt_tokens":4,"total_tokens":4},"results":[]}', usage.Usage(4, 0)),
    (
        b'{"object":"list","data":[],"usage":{"prompt_tokens":3,"total_tokens":3,'
        b'"completion_tokens":null}}',
        usage.Usage(3, 0),
    ),
    (
        b'{"index":0,"content":"x","stop":true,"tokens_predicted":6,"tokens_evaluated":9}',
        usage.Usage(9, 6),
    ),
]


@pytest.mark.parametrize(("answer", "said"), ROUTE_ANSWERS)
def test_each_route_s_usage_is_read_in_its_own_names(answer: bytes, said: usage.Usage) -> None:
    reader = UsageReader(stream=False)
    reader.feed(answer)
    assert reader.usage() == said


def test_llama_server_s_own_stream_is_charged_its_counts_also_when_cut() -> None:
    """/infill streams llama-server's own events, each with the counts so far and no
    `usage`: they are what it is charged, and what a limit charges as it goes."""
    events = [
        b'data: {"content":"t%d","stop":false,"tokens_predicted":%d,"tokens_evaluated":9}\n\n'
        % (i, i + 1)
        for i in range(4)
    ]
    last = b'data: {"content":"","stop":true,"tokens_predicted":4,"tokens_evaluated":9}\n\n'
    reader = UsageReader(stream=True)
    for e in events[:2]:
        reader.feed(e)
    assert reader.usage() == usage.Usage(9, 2) and reader.events == 2  # cut here
    for e in [*events[2:], last]:
        reader.feed(e)
    assert reader.usage() == usage.Usage(9, 4) and reader.events == 4
    # as the router relays it: a piece at a time, each marked by the route's counts
    admitted = Admission(Gateway("r", _NoCounter()), None, None, "m", "", True, 0.0)
    ticket = GatewayTicket(admitted, stream=True, usage_key=NATIVE_KEY)
    assert b"".join(ticket.chunk(e) or b"" for e in [*events, last]) == b"".join([*events, last])
    assert ticket.usage() == usage.Usage(9, 4)


def test_an_answer_is_read_as_what_it_is_not_as_the_request_said() -> None:
    """A stream the request did not ask for (an engine that took an odd `stream` as true)
    is read as a stream, and a whole answer to a stream request (an engine's error, a
    route that does not stream) as a whole answer: neither is metered as nothing."""
    for pieces in ([STREAM], list(_pieces(STREAM, random.Random(5)))):
        reader = UsageReader(stream=False)
        for p in pieces:
            reader.feed(p)
        assert reader.usage() == usage.Usage(7, 2, 4)
    whole = b'  {"choices":[{"text":"x"}],"usage":{"prompt_tokens":2,"completion_tokens":1}}'
    reader = UsageReader(stream=True)
    for p in _pieces(whole, random.Random(2)):
        reader.feed(p)
    assert reader.usage() == usage.Usage(2, 1)


def test_an_answer_whose_usage_does_not_read_is_metered_by_an_estimate() -> None:
    """Never as nothing: its prompt's estimate, and for a route that generates a token for
    every 4 bytes of a whole answer (or every event of a stream); an error answer, that
    generated nothing, is metered nothing and hands its reservation back."""
    gateway = Gateway("r", _NoCounter())
    for generates, answer, status, want in (
        (True, b'{"content":"' + b"x" * 386 + b'"}', 200, (10, 100, 0)),  # 400 bytes
        (False, b'[{"index":0,"score":0.5}]', 200, (10, 0, 0)),
        (True, b'{"error":{"message":"no"}}', 400, (0, 0, 0)),
    ):
        admitted = Admission(gateway, None, None, "m", "", False, 0.0)
        ticket = GatewayTicket(admitted, stream=False, prompt_estimate=10, generates=generates)
        ticket.chunk(answer, True)
        ticket.settle(status, "ok")
        assert tuple(gateway.tokens.pop(("", "m"))) == want


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


class _Allowing:
    """A limit's hold that allows a stream `most` tokens of output."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.asked: list[int] = []

    def progress_now(self, completion_tokens: int) -> bool:
        self.asked.append(completion_tokens)
        return completion_tokens <= self.most

    def header_pairs(self) -> tuple[tuple[bytes, bytes], ...]:
        return ()


@pytest.mark.parametrize("cut", ["events", "bytes"])
def test_a_limit_ends_a_stream_at_the_event_past_it_however_the_stream_is_cut(cut: str) -> None:
    """An engine's writes of one event each (read on the fast path) and pieces cut anywhere
    are charged alike: the piece that carries the limit's next token is not relayed, and
    nothing after it."""
    tokens = b"".join(
        b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i for i in range(10)
    )
    for seed in range(10):
        pieces = _events(tokens) if cut == "events" else list(_pieces(tokens, random.Random(seed)))
        hold = _Allowing(most=6)
        admitted = Admission(Gateway("r", _NoCounter()), None, hold, "m", "", True, 0.0)  # type: ignore[arg-type]
        ticket = GatewayTicket(admitted, stream=True)
        relayed = b""
        for piece in pieces:
            out = ticket.chunk(piece)
            if out is None:
                break
            relayed += out
        assert ticket.over
        # an event is counted when its line ends: a piece may carry the 7th's first bytes
        # on, never its end, and nothing after it
        assert relayed.count(b"\n\n") == 6
        assert b'"t6"}}]}\n' not in relayed and b'"t7"' not in relayed
        if cut == "events":
            assert relayed == b"".join(_events(tokens)[:6])
            assert hold.asked == [1, 2, 3, 4, 5, 6, 7]


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
