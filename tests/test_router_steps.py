"""The handler's steps against real (fake) engines: one in-flight account that the balancer,
/metrics and the load records read alike, and the gate's slot (authenticate, admit before
an engine is picked, a ticket told every chunk and settled once)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from router_helpers import chat_body, running_router, static_model
from waiting import until

from llmgw.bus.server import free_port
from llmgw.priority import EVERYONE
from llmgw.router.refusal import Refusal

pytestmark = pytest.mark.anyio

SLOW = {"FAKE_ENGINE_TOKENS": "400", "FAKE_ENGINE_TOKEN_RATE": "40"}  # 10 s of tokens


async def _true(value: bool) -> bool:
    return value


async def _in_flight_metric(http: aiohttp.ClientSession, url: str, replica: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("llmgw_router_in_flight{") and f'replica="{replica}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no in-flight series for {replica} in {text}")


async def test_one_in_flight_account_is_read_alike_by_balancer_metrics_and_load(engines):
    engine = engines.start(SLOW)
    dead = f"http://127.0.0.1:{free_port()}"  # refused: the request goes to the other engine
    model = static_model(engine)
    model.endpoints.insert(0, dead)
    async with running_router([model]) as r, aiohttp.ClientSession() as http:
        r.load.snapshot()  # a fresh interval
        streams = []
        for i in range(6):  # some meet the dead engine first and are sent again
            resp = await http.post(
                f"{r.url}/v1/chat/completions", json=chat_body(f"q{i}", stream=True)
            )
            assert resp.status == 200
            await resp.content.readline()  # its answer has begun
            streams.append(resp)
        live = next(b for b in r.table.backends() if b.id == engine.url)
        gone = next(b for b in r.table.backends() if b.id == dead)
        assert (live.in_flight, gone.in_flight) == (6, 0)
        assert await _in_flight_metric(http, r.url, engine.url) == 6
        assert r.flights.model("tiny") == 6
        assert engine.in_flight() == 6  # what the engine itself says
        for resp in streams:
            resp.close()  # the clients leave mid-stream
        await until(lambda: _true(live.in_flight == 0), timeout=10)
        assert await _in_flight_metric(http, r.url, engine.url) == 0
        assert r.flights.model("tiny") == 0
        load = r.load.snapshot()["tiny"]
        assert 0 < load.in_flight <= 6
        assert load.requests == 6  # sent once each, whatever the retries
        await until(lambda: _true(engine.in_flight() == 0), timeout=10)


class RecordingGate:
    """A gate as the keys and metering helper will plug in: refuses the key `no`, refuses
    admission of model `tiny` for the key `broke` with a 429, meters the rest."""

    def __init__(self) -> None:
        self.tickets: list[Ticket] = []

    def authenticate(self, req):
        key = req.header(b"authorization")
        if key == b"Bearer no":
            return Refusal(401, "unknown key", kind="unauthorized")
        return key

    def admit(self, identity, parsed, model, req):
        if identity == b"Bearer broke":
            return Refusal(
                429,
                f"key over its budget for {model}",
                code="insufficient_quota",
                kind="rate_limited",
                model=model,
                headers=((b"retry-after", b"7"), (b"x-ratelimit-remaining-tokens", b"0")),
            )
        ticket = Ticket(model)
        self.tickets.append(ticket)
        return ticket

    def models(self, identity, names):
        return names

    def standing(self, identity):
        return EVERYONE


class Ticket:
    rewrites = False

    def __init__(self, model: str) -> None:
        self.model = model
        self.relayed = b""
        self.settled: list[tuple[int, str]] = []

    def answering(self, replica: str) -> tuple[tuple[bytes, bytes], ...]:
        return ()

    def chunk(self, data: bytes, last: bool) -> bytes:
        assert not self.settled
        self.relayed += data
        return data

    def settle(self, status: int, outcome: str, refused: str | None = None) -> None:
        self.settled.append((status, outcome))


async def test_the_gate_refuses_before_an_engine_is_picked_and_settles_each_ticket_once(
    engines,
):
    engine = engines.start()
    gate = RecordingGate()
    async with running_router([static_model(engine)], gate=gate) as r:
        async with aiohttp.ClientSession() as http:
            url = f"{r.url}/v1/chat/completions"
            async with http.post(
                url, json=chat_body(), headers={"authorization": "Bearer no"}
            ) as a:
                assert a.status == 401
            broke = {"authorization": "Bearer broke"}
            async with http.post(url, json=chat_body(), headers=broke) as b:
                assert b.status == 429
                assert b.headers["retry-after"] == "7"
                assert b.headers["x-ratelimit-remaining-tokens"] == "0"
                assert (await b.json())["error"]["code"] == "insufficient_quota"
            assert gate.tickets == []  # neither was admitted
            ok = {"authorization": "Bearer ok"}
            async with http.post(url, json=chat_body(stream=True), headers=ok) as c:
                body = await c.read()
                assert c.status == 200
        ticket = gate.tickets[0]
        assert ticket.relayed == body  # every chunk, as the client got it
        assert ticket.settled == [(200, "ok")]
        # a client that leaves mid-stream: settled once, as a disconnect
        slow = engines.start(SLOW)
        r.table.set_static([static_model(slow)])
        async with aiohttp.ClientSession() as http:
            resp = await http.post(
                f"{r.url}/v1/chat/completions", json=chat_body(stream=True), headers=ok
            )
            await resp.content.readline()
            resp.close()
        await until(lambda: _true(len(gate.tickets[1].settled) == 1), timeout=10)
        await asyncio.sleep(0.2)
        assert gate.tickets[1].settled == [(0, "client_disconnect")]
        metrics = json.dumps(r.metrics.render().decode())
        assert 'kind=\\"rate_limited\\"' in metrics
