"""A stand-in for llama-server and vLLM that behaves like them where llmgw can tell.

Same flags (unknown ones refused the same way), same failure on a bad model path,
same HTTP surface (health while loading, OpenAI routes with SSE streaming, metrics,
llama-server's /slots), same signals. Tests install it on PATH under the real names
(`install_fake_engines`) so adapters run it through their real argv.

    python -m llmgw.sim.fake_engine llama-server -m model.gguf --port 8080 ...
    python -m llmgw.sim.fake_engine vllm serve MODEL --port 8000 ...

Behaviour knobs (environment):
    FAKE_ENGINE_LOAD_SECONDS      time spent "loading" (default 0)
    FAKE_ENGINE_FAIL_LOAD         message: fail at the end of loading, exit FAKE_ENGINE_EXIT_CODE
    FAKE_ENGINE_FAIL_ON_HOST      address: fail to load only when listening there
    FAKE_ENGINE_CRASH_AFTER_LOAD  seconds after ready to crash with FAKE_ENGINE_EXIT_CODE
    FAKE_ENGINE_EXIT_CODE         exit code of a failure or crash (default 1)
    FAKE_ENGINE_TOKENS            tokens per completion (default 8; max_tokens lowers it)
    FAKE_ENGINE_TOKEN_RATE        tokens per second (default 1000)
    FAKE_ENGINE_FIRST_TOKEN_SECONDS  time before the first token, besides prefill (default 0)
    FAKE_ENGINE_PREFILL_RATE      prompt tokens processed per second; cached ones are free
                                  (default 0: prefill takes no time)
    FAKE_ENGINE_EMBEDDING_SIZE    dimensions of each embedding (default 3; a real model's
                                  are 384 to 4,096, which makes a batch's answer megabytes)
    FAKE_ENGINE_CLOSE_AFTER_STREAM  llama-server only: seconds after a streamed answer at
                                  which the connection is closed, without `Connection:
                                  close`, as llama-server does (default 0; "never" keeps it)
    FAKE_ENGINE_IGNORE_SIGTERM=1  ignore SIGTERM (tests SIGKILL escalation)
    FAKE_ENGINE_RECORD            path: write args, pid, pgid and engine env there as JSON
    FAKE_ENGINE_REQUEST_LOG       path: append a line "<body's user> <pid>" for every
                                  completion request read (bench/chaos.py: sent twice?)
    FAKE_ENGINE_GPUS              GPUs on the "node" when CUDA_VISIBLE_DEVICES is unset (default 8)
    FAKE_ENGINE_WORKERS           child processes to start, like vLLM's workers (default 0)
    FAKE_ENGINE_WAITING           requests /metrics reports queued besides its own (default 0)
    FAKE_ENGINE_KV_USAGE          the KV cache fraction /metrics reports (default: busy slots)

Under load it runs at most what the real one runs at once, and the rest wait their turn in
arrival order: llama-server's slots (`-np`; 4 when not given, as its `auto`), whose extra
requests it defers, and vLLM's continuous batch of `--max-num-seqs` sequences (256 when not
given), beyond which requests queue; /metrics says which run and which wait.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import signal
import stat
import sys
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from llmgw.sim import engine_params, fake_lora, vllm_answers

LLAMA_VERSION = "version: 9439 (47f6423ed)\nbuilt with cc (GCC) 13.2.0 for x86_64-linux-gnu"
VLLM_VERSION = "0.11.2"
ENV_PREFIXES = ("CUDA_", "NCCL_", "GLOO_", "LLAMA_", "VLLM_", "HF_")


def log(line: str, *, err: bool = True) -> None:
    print(line, file=sys.stderr if err else sys.stdout, flush=True)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


# --- argument parsing: the real names, the real refusals ---------------------------------


class _LlamaParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # llama.cpp's common_params_parse: the message, then exit 1 (no argparse usage block)
        log(f"error: {message}")
        sys.exit(1)


def parse_llama(argv: list[str]) -> argparse.Namespace:
    if "--version" in argv:
        log(LLAMA_VERSION)
        sys.exit(0)
    p = _LlamaParser(prog="llama-server", add_help=False, allow_abbrev=False)
    p.add_argument("-m", "--model")
    p.add_argument("-hf", "-hfr", "--hf-repo")
    p.add_argument("-hff", "--hf-file")
    p.add_argument("-mu", "--model-url")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="ngl", default="auto")
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-np", "--parallel", type=int, default=-1)  # -1: auto, 4 slots
    p.add_argument("-a", "--alias")
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"))
    p.add_argument("-t", "--threads", type=int)
    p.add_argument("-b", "--batch-size", type=int)
    p.add_argument("-fa", "--flash-attn")
    p.add_argument("--jinja", action="store_true")
    p.add_argument("--no-slots", action="store_true")
    p.add_argument("--lora", action="append")
    p.add_argument("--lora-scaled", nargs=2, action="append")
    p.add_argument("--lora-init-without-apply", action="store_true")
    ns, unknown = p.parse_known_args(argv)
    if unknown:
        p.error(f"invalid argument: {unknown[0]}")
    if not ns.model and not ns.hf_repo and not ns.model_url:
        ns.model = "models/7B/ggml-model-f16.gguf"  # llama.cpp's default path, absent everywhere
    return ns


def _dashes(token: str) -> str:
    if not token.startswith("--"):
        return token
    name, eq, value = token.partition("=")
    return "--" + name[2:].replace("_", "-") + eq + value


def parse_vllm(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["--version"] or argv == ["-v"]:
        print(VLLM_VERSION, flush=True)
        sys.exit(0)
    if argv[:1] != ["serve"]:
        log("usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ...")
        log(f"vllm: error: argument subparser: invalid choice: {argv[:1]}")
        sys.exit(2)
    # vLLM's FlexibleArgumentParser reads --max_model_len as --max-model-len, -O3 as
    # --optimization-level 3
    args = []
    for a in argv[1:]:
        if a.startswith("-O") and len(a) > 2:
            args += ["--optimization-level", a[2:].lstrip("=")]
        else:
            args.append(_dashes(a))
    p = argparse.ArgumentParser(prog="vllm serve", allow_abbrev=False)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--host")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("-dp", "--data-parallel-size", type=int, default=1)
    p.add_argument("--download-dir")
    p.add_argument("-n", "--nnodes", type=int, default=1)
    p.add_argument("-r", "--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=int)
    p.add_argument("--optimization-level", type=int, default=2)
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    p.add_argument("--enforce-eager", action="store_true")
    # examples/catalog.toml's extra_args: the simulated fleet runs the README's catalog too
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction)
    p.add_argument("--max-lora-rank", type=int, default=16, choices=fake_lora.VLLM_LORA_RANKS)
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-cpu-loras", type=int)
    ns = p.parse_args(args)
    ns.model = ns.model_tag or ns.model or "Qwen/Qwen3-0.6B"
    return ns


# --- the engine ---------------------------------------------------------------------------


class Pace:
    """Tokens at `rate` a second on average, against the clock: a sleep of half a
    millisecond wakes about a millisecond later (the event loop's timer resolution), so
    sleeping 1/rate a token would cap a stream near 1,000 tokens a second whatever the
    rate. A token whose time has come goes at once; a late wake sends those due together,
    as an engine whose decode steps finish between two reads of its client does."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate
        self.due = time.monotonic()

    async def next(self) -> None:
        self.due += self.interval
        wait = self.due - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        else:
            await asyncio.sleep(0)  # let the loop write and read between tokens


# what each runs at once when its command line does not say: llama-server's `-np -1` (auto)
# makes 4 slots; vLLM's --max-num-seqs is 256 on most GPUs
LLAMA_AUTO_SLOTS = 4
VLLM_MAX_NUM_SEQS = 256


class Batch:
    """What an engine runs at once (llama-server's slots, vLLM's batch of --max-num-seqs); a
    request beyond it waits, first come first served, and a turn freed is handed to the
    oldest waiting request."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self.running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    async def take(self) -> None:
        """Wait for this request's turn (at once while the batch has room)."""
        if self.running < self.size and not self._waiting:
            self.running += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn  # handed over: `running` counts it already
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give()  # its client left as its turn came: the next one's
            else:
                self._waiting.remove(turn)
            raise

    def give(self) -> None:
        """A request that took its turn is over: the oldest waiting one runs."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1


@dataclass
class Engine:
    kind: str  # "llama-server" | "vllm"
    served_name: str
    api_key: str | None
    metrics: bool
    slots: int
    ctx: int
    loading: bool = True
    in_flight: int = 0
    busy_slots: set[int] = field(default_factory=set)
    tokens: int = 8
    token_rate: float = 1000.0
    first_token_seconds: float = 0.0
    prefill_rate: float = 0.0
    close_after_stream: float | None = None
    embedding_size: int = 3
    started: float = field(default_factory=time.time)
    # what /metrics says beside the real counts: requests queued, and the KV cache in use
    # (None: llama-server's busy slots over its slots, vLLM's 0)
    extra_waiting: int = 0
    kv_usage: float | None = None
    # per slot: the tokens its KV cache holds (prompt and answer of its last request)
    slot_tokens: dict[int, list[str]] = field(default_factory=dict)
    slot_used: dict[int, float] = field(default_factory=dict)
    # what it runs at once; a generating request beyond it waits its turn
    batch: Batch = field(default_factory=lambda: Batch(VLLM_MAX_NUM_SEQS))
    root: str = ""  # vLLM: the model as given (/v1/models says it)
    # vLLM's prefix-cache counters: prompt tokens looked up, and found cached
    prefix_queries: int = 0
    prefix_hits: int = 0
    # the engine's own count of what it read and generated, every route (its /metrics:
    # llama-server's prompt_tokens_total and tokens_predicted_total, vLLM's
    # prompt_tokens_total and generation_tokens_total)
    prompt_total: int = 0
    generated_total: int = 0
    # LoRA adapters (llmgw/sim/fake_lora.py): vLLM's loaded while it runs, llama-server's
    # given at start
    vllm_loras: fake_lora.VllmLoras = field(default_factory=fake_lora.VllmLoras)
    llama_loras: fake_lora.LlamaLoras = field(default_factory=fake_lora.LlamaLoras)

    def counted(self, prompt: int, generated: int) -> None:
        self.prompt_total += prompt
        self.generated_total += generated

    def take_slot(self, prompt: list[str]) -> tuple[int, int]:
        """llama-server's choice (server-context.cpp get_available_slot): the idle slot whose
        cache shares the longest prefix with the prompt if it covers at least 10% of it, else
        the least recently used idle slot. Returns (slot, cached tokens); slot -1 when every
        slot is busy (the request then runs uncached)."""
        idle = [i for i in range(self.slots) if i not in self.busy_slots]
        if not idle:
            return -1, 0
        best = max(idle, key=lambda i: _common_prefix(self.slot_tokens.get(i, []), prompt))
        cached = _common_prefix(self.slot_tokens.get(best, []), prompt)
        if not prompt or cached < 0.1 * len(prompt):
            best = min(idle, key=lambda i: self.slot_used.get(i, 0.0))
            cached = _common_prefix(self.slot_tokens.get(best, []), prompt)
        self.busy_slots.add(best)
        self.slot_used[best] = time.monotonic()
        # never the whole prompt: the last token is always evaluated, as in llama.cpp
        return best, min(cached, max(0, len(prompt) - 1))

    def authorized(self, request) -> bool:
        if not self.api_key:
            return True
        return request.headers.get("Authorization", "") == f"Bearer {self.api_key}"


def _fails_load_here(host: str) -> bool:
    """FAKE_ENGINE_FAIL_LOAD, on every host, or only on FAKE_ENGINE_FAIL_ON_HOST (the
    address it listens on: one node of several on one machine, a broken GPU's node)."""
    if not os.environ.get("FAKE_ENGINE_FAIL_LOAD"):
        return False
    only = os.environ.get("FAKE_ENGINE_FAIL_ON_HOST")
    return not only or only == host


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_text(body: dict, chat: bool) -> str:
    """The prompt as the engine would see it after its chat template: each message's role and
    content in order (so the next turn's prompt starts with this turn's prompt and answer)."""
    if chat:
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        return (
            "".join(
                f"<|{m.get('role')}|>{_text_of(m.get('content'))}"
                for m in messages
                if isinstance(m, dict)
            )
            + "<|assistant|>"
        )
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else "".join(str(p) for p in prompt)


def prompt_texts(body: dict, chat: bool) -> list[str]:
    """Each prompt a request's answers are generated from: a completions' list of strings
    (or of token lists) is several, answered alone; anything else is one."""
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt:
        if all(isinstance(p, str | list) for p in prompt):
            return [p if isinstance(p, str) else " ".join(map(str, p)) for p in prompt]
    return [prompt_text(body, chat)]


def tokenize(text: str) -> list[str]:
    """About four characters a token, as for English text with a real tokenizer."""
    return [text[i : i + 4] for i in range(0, len(text), 4)]


def _llama_error(status: int, message: str, kind: str) -> dict:
    return {"error": {"code": status, "message": message, "type": kind}}


def _vllm_error(status: int, message: str, kind: str) -> dict:
    return vllm_answers.error(status, message, kind)


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _vllm_stream(
    rid: str, created: int, model: str, n: int, finish: str, copies: int, *, chat: bool
) -> list[list[dict]]:
    """vLLM's events of a streamed answer of `n` tokens a choice, before its usage, a list
    a step: a chat's first step carries each choice's role; each later step a token of each
    choice, the last with its finish reason."""
    steps: list[list[dict]] = []
    if chat:
        steps.append(
            [
                vllm_answers.chunk(
                    rid,
                    created,
                    model,
                    vllm_answers.chat_delta(None, None, c, role=True),
                    chat=True,
                )
                for c in range(copies)
            ]
        )
    last = max(n, 1) - 1
    for i in range(last + 1):
        text = f"tok{i} " if i < n else ""
        done = finish if i == last else None
        step = []
        for c in range(copies):
            if chat:
                choice = vllm_answers.chat_delta(text, done, c)
            else:
                choice = vllm_answers.text_delta(text, done, c)
            step.append(vllm_answers.chunk(rid, created, model, choice, chat=chat))
        steps.append(step)
    return steps


def build_app(engine: Engine):
    from aiohttp import web

    @web.middleware
    async def gate(request, handler):
        if engine.kind == "llama-server":
            if engine.loading:
                return web.json_response(
                    _llama_error(503, "Loading model", "unavailable_error"), status=503
                )
            if request.path != "/health" and not engine.authorized(request):
                return web.json_response(
                    _llama_error(401, "Invalid API Key", "authentication_error"), status=401
                )
        elif request.path.startswith("/v1") and not engine.authorized(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def health(request):
        if engine.kind == "llama-server":
            return web.json_response({"status": "ok"})
        return web.Response(status=200)

    async def models(request):
        created = int(engine.started)
        if engine.kind == "vllm":
            entry = vllm_answers.model_entry(engine.served_name, engine.root, engine.ctx, created)
            loras = engine.vllm_loras.model_entries(engine.served_name, created)
            return web.json_response({"object": "list", "data": [entry, *loras]})
        else:
            entry = {
                "id": engine.served_name,
                "object": "model",
                "created": created,
                "owned_by": "llamacpp",
            }
        return web.json_response({"object": "list", "data": [entry]})

    async def metrics(request):
        if engine.kind == "llama-server":
            if not engine.metrics:
                return web.json_response(
                    _llama_error(
                        501,
                        "This server does not support metrics endpoint. Start it with `--metrics`",
                        "not_supported_error",
                    ),
                    status=501,
                )
            # requests beyond the slots wait for one (llama-server defers them)
            running = min(engine.in_flight, engine.batch.size)
            deferred = engine.in_flight - running + engine.extra_waiting
            kv = engine.kv_usage if engine.kv_usage is not None else running / engine.slots
            text = (
                "# HELP llamacpp:requests_processing Number of requests processing.\n"
                "# TYPE llamacpp:requests_processing gauge\n"
                f"llamacpp:requests_processing {running}\n"
                "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
                "# TYPE llamacpp:requests_deferred gauge\n"
                f"llamacpp:requests_deferred {deferred}\n"
                "# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.\n"
                "# TYPE llamacpp:kv_cache_usage_ratio gauge\n"
                f"llamacpp:kv_cache_usage_ratio {kv}\n"
                "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
                "# TYPE llamacpp:prompt_tokens_total counter\n"
                f"llamacpp:prompt_tokens_total {engine.prompt_total}\n"
                "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.\n"
                "# TYPE llamacpp:tokens_predicted_total counter\n"
                f"llamacpp:tokens_predicted_total {engine.generated_total}\n"
            )
        else:
            label = f'{{engine="0",model_name="{engine.served_name}"}}'
            running = min(engine.in_flight, engine.batch.size)
            waiting = engine.in_flight - running + engine.extra_waiting
            text = (
                "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{label} {float(running)}\n"
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{label} {float(waiting)}\n"
                "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f"vllm:kv_cache_usage_perc{label} {engine.kv_usage or 0.0}\n"
                "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
                "# TYPE vllm:prompt_tokens_total counter\n"
                f"vllm:prompt_tokens_total{label} {float(engine.prompt_total)}\n"
                "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
                "# TYPE vllm:generation_tokens_total counter\n"
                f"vllm:generation_tokens_total{label} {float(engine.generated_total)}\n"
                "# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number "
                "of queried tokens.\n"
                "# TYPE vllm:prefix_cache_queries counter\n"
                f"vllm:prefix_cache_queries_total{label} {float(engine.prefix_queries)}\n"
                "# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of "
                "cached tokens.\n"
                "# TYPE vllm:prefix_cache_hits counter\n"
                f"vllm:prefix_cache_hits_total{label} {float(engine.prefix_hits)}\n"
                + engine.vllm_loras.metrics()
            )
        return web.Response(text=text, content_type="text/plain")

    async def slots(request):
        return web.json_response(
            [
                {
                    "id": i,
                    "n_ctx": engine.ctx // engine.slots,
                    "is_processing": i in engine.busy_slots,
                }
                for i in range(engine.slots)
            ]
        )

    def refused(e: engine_params.Refused) -> web.Response:
        return web.json_response(_vllm_error(400, str(e), "BadRequestError"), status=400)

    def vllm_refused(refusal: vllm_answers.Refusal) -> web.Response:
        return web.json_response(refusal.body, status=refusal.status)

    async def completions(request):
        chat = request.path.endswith("/chat/completions")
        vllm = engine.kind == "vllm"
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            if vllm:
                return vllm_refused(vllm_answers.not_json(getattr(e, "pos", 0)))
            body = None
        lora = None
        if vllm:
            words = prompt_text(body, chat) if isinstance(body, dict) else ""
            asked = body.get("model") if isinstance(body, dict) else None
            lora = asked if engine.vllm_loras.serves(asked) else None
            refusal = vllm_answers.refusal(
                body,
                chat=chat,
                served=lora or engine.served_name,
                context=engine.ctx,
                prompt_chars=len(words),
            )
            if refusal is not None:
                return vllm_refused(refusal)
        elif not isinstance(body, dict):
            return web.json_response(
                _llama_error(400, "invalid JSON body", "invalid_request_error"), status=400
            )
        elif (problem := engine.llama_loras.apply(body)) is not None:
            return web.json_response(
                _llama_error(400, problem, "invalid_request_error"), status=400
            )
        _log_request(body)
        # what an adapter changes: its tokens (a test tells which ran by them)
        mark = engine.llama_loras.mark(body) if not vllm else ""
        # vLLM answers with the name asked for (a LoRA's own); llama-server with its alias
        model = (body.get("model") or engine.served_name) if vllm else engine.served_name
        try:  # what to generate, read as the engine reads it (odd forms included)
            cap = engine_params.cap(engine.kind, "chat" if chat else "completions", body)
            copies = engine_params.choices(engine.kind, body)
            stream = engine_params.streams(engine.kind, body)
        except engine_params.Refused as e:
            return refused(e)
        n = min(engine.tokens, cap or engine.tokens)
        finish = "length" if n < engine.tokens else "stop"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        text = "".join(f"{mark}tok{i} " for i in range(n))
        prompts = prompt_texts(body, chat)
        copies *= len(prompts)  # each prompt of a list is answered alone
        prompt = tokenize(prompt_text(body, chat))
        engine.in_flight += 1  # counted while it waits for its turn too (/metrics: waiting)
        try:
            await engine.batch.take()
        except BaseException:
            engine.in_flight -= 1
            raise
        slot, cached = engine.take_slot(prompt)
        engine.prefix_queries += len(prompt)
        engine.prefix_hits += cached
        prompt_tokens = sum(len(tokenize(p)) for p in prompts)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n * copies,
            "total_tokens": prompt_tokens + n * copies,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        prefill = (len(prompt) - cached) / engine.prefill_rate if engine.prefill_rate else 0.0
        timings = {
            "cache_n": cached,
            "prompt_n": len(prompt) - cached,
            "prompt_ms": prefill * 1000,
            "predicted_n": n,
            "predicted_ms": n / engine.token_rate * 1000,
        }
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        engine.counted(prompt_tokens, 0)
        if lora is not None:
            engine.vllm_loras.running[lora] += 1
        try:
            await asyncio.sleep(engine.first_token_seconds + prefill)
            if stream:
                resp = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await resp.prepare(request)
                if vllm:
                    steps = _vllm_stream(rid, created, model, n, finish, copies, chat=chat)
                    if not include_usage:
                        steps[-1][-1] = vllm_answers.last_chunk(steps[-1][-1])
                    pace = Pace(engine.token_rate)
                    for step, events in enumerate(steps):
                        tokens = step > 0 or not chat  # a chat's first events carry the role
                        if tokens:
                            await pace.next()
                        for event in events:
                            await resp.write(_sse(event))
                            if tokens and n:
                                engine.counted(0, 1)  # as each is written: a client may leave
                    if include_usage:
                        used = vllm_answers.stream_usage(prompt_tokens, n * copies)
                        event = vllm_answers.usage_chunk(rid, created, model, used, chat=chat)
                        await resp.write(_sse(event))
                    await resp.write(b"data: [DONE]\n\n")
                    await resp.write_eof()
                    return resp

                def chunk(
                    delta_text: str | None,
                    finish_reason: str | None,
                    role: bool = False,
                    index: int = 0,
                ) -> bytes:
                    if chat:
                        delta = {"role": "assistant", "content": ""} if role else {}
                        if delta_text is not None:
                            delta["content"] = delta_text
                        choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
                        obj = "chat.completion.chunk"
                    else:
                        choice = {
                            "index": index,
                            "text": delta_text or "",
                            "finish_reason": finish_reason,
                        }
                        obj = "text_completion"
                    data = {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                    return f"data: {json.dumps(data)}\n\n".encode()

                if chat:
                    for c in range(copies):
                        await resp.write(chunk(None, None, role=True, index=c))
                pace = Pace(engine.token_rate)
                for i in range(n):
                    await pace.next()
                    for c in range(copies):
                        await resp.write(chunk(f"{mark}tok{i} ", None, index=c))
                        engine.counted(0, 1)  # as each is written: a client may leave
                for c in range(copies):
                    last = json.loads(chunk(None if chat else "", finish, index=c)[6:])
                    if c == copies - 1:
                        last["timings"] = timings  # llama-server puts them on its last chunk
                    await resp.write(f"data: {json.dumps(last)}\n\n".encode())
                options = body.get("stream_options")
                if isinstance(options, dict) and options.get("include_usage"):
                    only_usage = {**last, "choices": [], "usage": usage}
                    only_usage.pop("timings")
                    await resp.write(f"data: {json.dumps(only_usage)}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                if engine.close_after_stream is not None and request.transport is not None:
                    # llama-server closes its connection after every streamed answer while its
                    # headers promised keep-alive, reading nothing more from it: a request sent
                    # on it meanwhile is never read
                    request.transport.pause_reading()
                    asyncio.get_running_loop().call_later(
                        engine.close_after_stream, request.transport.close
                    )
                return resp
            await asyncio.sleep(n / engine.token_rate)
            if vllm:
                engine.counted(0, n * copies)
                used = vllm_answers.usage(prompt_tokens, n * copies)
                return web.json_response(
                    vllm_answers.whole(rid, created, model, text, finish, used, copies, chat=chat)
                )
            if chat:
                answers = [
                    {
                        "index": c,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                    }
                    for c in range(copies)
                ]
                obj = "chat.completion"
            else:
                answers = [
                    {"index": c, "text": text, "finish_reason": finish} for c in range(copies)
                ]
                obj = "text_completion"
            engine.counted(0, n * copies)
            return web.json_response(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": answers,
                    "usage": usage,
                    "timings": timings,
                }
            )
        finally:
            engine.in_flight -= 1
            engine.batch.give()
            if lora is not None:
                engine.vllm_loras.running[lora] -= 1
            if slot >= 0:
                engine.busy_slots.discard(slot)
                # what the slot's KV cache holds now: this prompt and its answer
                engine.slot_tokens[slot] = tokenize(prompt_text(body, chat) + text)

    async def embeddings(request):
        try:
            body = await request.json()
        except ValueError:
            return web.json_response(
                _llama_error(400, "invalid JSON body", "invalid_request_error"), status=400
            )
        inputs = body.get("input", "")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        size = engine.embedding_size
        rest = [0.015625] * max(0, size - 3)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": [float(len(str(x)) % 7), 0.5, -0.5, *rest][:size],
            }
            for i, x in enumerate(inputs)
        ]
        n = sum(len(tokenize(str(x))) for x in inputs)
        engine.counted(n, 0)
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": body.get("model") or engine.served_name,
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )

    async def json_body(request):
        """The body as a dict, or the engine's own 400 (as a web.Response)."""
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            if engine.kind == "vllm":
                return web.json_response(
                    _vllm_error(400, "the body must be a JSON object", "BadRequestError"),
                    status=400,
                )
            return web.json_response(
                _llama_error(400, "invalid JSON body", "invalid_request_error"), status=400
            )
        return body

    def wrong_model(model) -> web.Response | None:
        """vLLM refuses a model it does not serve; llama-server serves whatever is asked."""
        if engine.kind == "vllm" and model != engine.served_name:
            return web.json_response(
                vllm_answers.error(
                    404,
                    f"The model `{model}` does not exist. Valid aliases: {engine.served_name}.",
                    "NotFoundError",
                    "model",
                ),
                status=404,
            )
        return None

    def scores(query: str, documents: list) -> list[float]:
        # a made-up relevance: shared words, so a test can tell the order is the engine's
        words = set(query.lower().split())
        return [len(words & set(str(d).lower().split())) / (1 + len(words)) for d in documents]

    async def rerank(request):
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        if (refused := wrong_model(body.get("model"))) is not None:
            return refused
        query = str(body.get("query", ""))
        documents = body.get("documents") if isinstance(body.get("documents"), list) else []
        results = [
            {"index": i, "relevance_score": score}
            for i, score in enumerate(scores(query, documents))
        ]
        results.sort(key=lambda r: -r["relevance_score"])
        top_n = body.get("top_n")
        if isinstance(top_n, int):
            results = results[:top_n]
        n = len(tokenize(query)) + sum(len(tokenize(str(d))) for d in documents)
        engine.counted(n, 0)
        if engine.kind == "vllm":
            for r in results:
                r["document"] = {"text": str(documents[r["index"]])}
            return web.json_response(
                {
                    "id": f"rerank-{uuid.uuid4().hex[:24]}",
                    "model": body.get("model"),
                    "usage": {"prompt_tokens": n, "total_tokens": n},
                    "results": results,
                }
            )
        return web.json_response(
            {
                "model": body.get("model") or engine.served_name,
                "object": "list",
                "usage": {"prompt_tokens": n, "total_tokens": n},
                "results": results,
            }
        )

    async def score(request):
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        if (refused := wrong_model(body.get("model"))) is not None:
            return refused
        first = str(body.get("text_1", ""))
        second = body.get("text_2", "")
        second = second if isinstance(second, list) else [second]
        n = len(second) * len(tokenize(first)) + sum(len(tokenize(str(t))) for t in second)
        engine.counted(n, 0)
        return web.json_response(
            {
                "id": f"score-{uuid.uuid4().hex[:24]}",
                "object": "list",
                "created": int(time.time()),
                "model": body.get("model"),
                "data": [
                    {"index": i, "object": "score", "score": s}
                    for i, s in enumerate(scores(first, second))
                ],
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )

    async def pooling(request):
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        if (refused := wrong_model(body.get("model"))) is not None:
            return refused
        inputs = body.get("input", "")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        classify = request.path.endswith("/classify")
        data = []
        for i, x in enumerate(inputs):
            if classify:
                p = (len(str(x)) % 10) / 10
                data.append(
                    {
                        "index": i,
                        "label": "positive" if p >= 0.5 else "negative",
                        "probs": [1 - p, p],
                        "num_classes": 2,
                    }
                )
            else:
                data.append({"index": i, "object": "pooling", "data": [float(len(str(x)))]})
        n = sum(len(tokenize(str(x))) for x in inputs)
        engine.counted(n, 0)
        return web.json_response(
            {
                "id": f"{'classify' if classify else 'pool'}-{uuid.uuid4().hex[:24]}",
                "object": "list",
                "created": int(time.time()),
                "model": body.get("model"),
                "data": data,
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )

    async def tokenize_route(request):
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        if (refused := wrong_model(body.get("model"))) is not None:
            return refused
        text = body.get("content") if engine.kind == "llama-server" else body.get("prompt")
        tokens = [sum(map(ord, t)) for t in tokenize(str(text or ""))]
        if engine.kind == "vllm":
            return web.json_response(
                {"count": len(tokens), "max_model_len": engine.ctx, "tokens": tokens}
            )
        return web.json_response({"tokens": tokens})

    async def detokenize(request):
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        if (refused := wrong_model(body.get("model"))) is not None:
            return refused
        tokens = body.get("tokens") if isinstance(body.get("tokens"), list) else []
        text = "".join(f"t{t}" for t in tokens)
        key = "prompt" if engine.kind == "vllm" else "content"
        return web.json_response({key: text})

    async def infill(request):
        """llama-server's fill-in-the-middle: its own (non-OpenAI) completion shape, its
        counts beside the answer (`tokens_evaluated`, `tokens_predicted`, in every event of
        a stream), no `usage`."""
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        cap = engine_params.cap(engine.kind, "infill", body)
        n = min(engine.tokens, cap or engine.tokens)
        prompt = len(
            tokenize(
                "".join(str(body.get(k) or "") for k in ("input_prefix", "input_suffix", "prompt"))
            )
        )
        engine.in_flight += 1
        engine.counted(prompt, 0)
        try:
            await asyncio.sleep(engine.first_token_seconds)
            if engine_params.streams(engine.kind, body):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                pace = Pace(engine.token_rate)
                for i in range(n):
                    await pace.next()
                    data = {
                        "index": 0,
                        "content": f"tok{i} ",
                        "tokens": [],
                        "stop": False,
                        "id_slot": -1,
                        "tokens_predicted": i + 1,
                        "tokens_evaluated": prompt,
                    }
                    await resp.write(f"data: {json.dumps(data)}\n\n".encode())
                    engine.counted(0, 1)
                last = {
                    "index": 0,
                    "content": "",
                    "tokens": [],
                    "stop": True,
                    "model": engine.served_name,
                    "tokens_predicted": n,
                    "tokens_evaluated": prompt,
                    "timings": {"prompt_n": prompt, "predicted_n": n},
                }
                await resp.write(f"data: {json.dumps(last)}\n\n".encode())
                await resp.write_eof()
                return resp
            await asyncio.sleep(n / engine.token_rate)
            engine.counted(0, n)
            return web.json_response(
                {
                    "index": 0,
                    "content": "".join(f"tok{i} " for i in range(n)),
                    "tokens": [],
                    "id_slot": 0,
                    "stop": True,
                    "model": engine.served_name,
                    "tokens_predicted": n,
                    "tokens_evaluated": prompt,
                    "timings": {"prompt_n": prompt, "predicted_n": n},
                }
            )
        finally:
            engine.in_flight -= 1

    async def responses(request):
        """vLLM's Responses API: a response object, or its events when streamed."""
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        model = body.get("model")
        if (refused := wrong_model(model)) is not None:
            return refused
        try:
            cap = engine_params.cap(engine.kind, "responses", body)
            stream = engine_params.streams(engine.kind, body)
        except engine_params.Refused as e:
            return refused(e)
        n = min(engine.tokens, cap or engine.tokens)
        source = body.get("input", "")
        prompt = tokenize(source if isinstance(source, str) else json.dumps(source))
        rid, mid = f"resp_{uuid.uuid4().hex[:24]}", f"msg_{uuid.uuid4().hex[:24]}"
        text = "".join(f"tok{i} " for i in range(n))

        def response(status: str, out: str) -> dict:
            content = [{"type": "output_text", "text": out, "annotations": [], "logprobs": []}]
            return {
                "id": rid,
                "object": "response",
                "created_at": int(time.time()),
                "model": model,
                "status": status,
                "output": [
                    {
                        "type": "message",
                        "id": mid,
                        "status": status,
                        "role": "assistant",
                        "content": content,
                    }
                ]
                if out
                else [],
                "parallel_tool_calls": True,
                "tool_choice": "auto",
                "tools": [],
                "usage": {
                    "input_tokens": len(prompt),
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": n,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": len(prompt) + n,
                }
                if status == "completed"
                else None,
            }

        engine.in_flight += 1
        engine.counted(len(prompt), 0)
        try:
            await asyncio.sleep(engine.first_token_seconds)
            if not stream:
                await asyncio.sleep(n / engine.token_rate)
                engine.counted(0, n)
                return web.json_response(response("completed", text))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            seq = 0

            async def event(kind: str, **data) -> None:
                nonlocal seq
                payload = {"type": kind, "sequence_number": seq, **data}
                seq += 1
                await resp.write(f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode())

            await event("response.created", response=response("in_progress", ""))
            pace = Pace(engine.token_rate)
            for i in range(n):
                await pace.next()
                await event(
                    "response.output_text.delta",
                    item_id=mid,
                    output_index=0,
                    content_index=0,
                    delta=f"tok{i} ",
                    logprobs=[],
                )
                engine.counted(0, 1)
            await event("response.completed", response=response("completed", text))
            await resp.write_eof()
            return resp
        finally:
            engine.in_flight -= 1

    async def audio(request):
        """vLLM's transcription and translation: a multipart form with `file` and `model`.
        The file's SHA-256 comes back in a header, for a test to see the bytes arrived
        unchanged."""
        if not (request.content_type or "").startswith("multipart/form-data"):
            return web.json_response(
                _vllm_error(400, "expected multipart/form-data", "BadRequestError"), status=400
            )
        form = await request.post()
        if (refused := wrong_model(form.get("model"))) is not None:
            return refused
        upload = form.get("file")
        if upload is None or not hasattr(upload, "file"):
            return web.json_response(
                _vllm_error(400, "the form has no `file`", "BadRequestError"), status=400
            )
        data = upload.file.read()
        text = "".join(f"tok{i} " for i in range(engine.tokens))
        headers = {"x-fake-file-sha256": hashlib.sha256(data).hexdigest()}
        fmt = form.get("response_format", "json")
        if fmt == "text":
            return web.Response(text=text, headers=headers)
        return web.json_response(
            {"text": text, "usage": {"type": "duration", "seconds": max(1, len(data) // 32000)}},
            headers=headers,
        )

    @web.middleware
    async def not_found(request, handler):
        """Routes an engine does not serve: llama-server's 404 body, vLLM's (FastAPI's)."""
        try:
            return await handler(request)
        except web.HTTPNotFound:
            if engine.kind == "llama-server":
                return web.json_response(
                    _llama_error(404, "File Not Found", "not_found_error"), status=404
                )
            return web.json_response({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed as e:
            if engine.kind == "llama-server":
                raise
            return web.json_response(
                {"detail": "Method Not Allowed"},
                status=405,
                headers={"Allow": ", ".join(e.allowed_methods)},
            )

    async def load_lora(request):
        status, answer = engine.vllm_loras.load(await _json_or_none(request), engine.served_name)
        return _lora_answer(status, answer)

    async def unload_lora(request):
        status, answer = engine.vllm_loras.unload(await _json_or_none(request))
        return _lora_answer(status, answer)

    def _lora_answer(status: int, answer: object) -> web.Response:
        if isinstance(answer, str):
            return web.Response(status=status, text=answer)
        return web.json_response(answer, status=status)

    async def lora_adapters(request):
        if request.method == "POST":
            problem = engine.llama_loras.set_scales(await _json_or_none(request))
            if problem is not None:
                return web.json_response(
                    _llama_error(400, problem, "invalid_request_error"), status=400
                )
            return web.json_response({"success": True})
        return web.json_response(engine.llama_loras.listed())

    app = web.Application(middlewares=[not_found, gate])
    app.router.add_get("/health", health)
    if engine.kind == "vllm" and engine.vllm_loras.runtime:
        app.router.add_post("/v1/load_lora_adapter", load_lora)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora)
    if engine.kind == "llama-server":
        app.router.add_get("/lora-adapters", lora_adapters)
        app.router.add_post("/lora-adapters", lora_adapters)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    if engine.kind == "llama-server":
        app.router.add_get("/slots", slots)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize)
    if engine.kind == "llama-server":
        for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
            app.router.add_post(path, rerank)
        app.router.add_post("/infill", infill)
    else:
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            app.router.add_post(path, rerank)
        for path in ("/v1/score", "/score"):
            app.router.add_post(path, score)
        app.router.add_post("/pooling", pooling)
        app.router.add_post("/classify", pooling)
        app.router.add_post("/v1/responses", responses)
        app.router.add_post("/v1/audio/transcriptions", audio)
        app.router.add_post("/v1/audio/translations", audio)
    return app


async def _json_or_none(request) -> object:
    try:
        return await request.json()
    except ValueError:
        return None


def _visible_gpus() -> int:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return int(_env_float("FAKE_ENGINE_GPUS", 8))
    return len([d for d in cvd.split(",") if d.strip()])


def _start_workers() -> list[int]:
    """Children in the engine's process group, as vLLM's worker processes are."""
    import subprocess

    n = int(_env_float("FAKE_ENGINE_WORKERS", 0))
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_DFL); time.sleep(3600)"
    return [subprocess.Popen([sys.executable, "-c", code]).pid for _ in range(n)]


def _log_request(body: object) -> None:
    path = os.environ.get("FAKE_ENGINE_REQUEST_LOG")
    if path and isinstance(body, dict):
        # one short write in append mode: lines of engines sharing the file never mix
        with open(path, "a") as f:
            f.write(f"{str(body.get('user', ''))[:64]} {os.getpid()}\n")


def _record(extra: dict) -> None:
    path = os.environ.get("FAKE_ENGINE_RECORD")
    if not path:
        return
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    # sys.argv: [module path, engine name, *the args the engine was given]
    data = {"args": sys.argv[2:], "pid": os.getpid(), "pgid": os.getpgid(0), "env": env, **extra}
    # written whole or not at all: a test polling for the file never reads half of it
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _fail(lines: list[str], *, err: bool = True) -> NoReturn:
    for line in lines:
        log(line, err=err)
    # at once, as a C++ engine does: no interpreter shutdown printing about pending tasks
    # (an open keep-alive connection's handler) after the engine's last line
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(_env_float("FAKE_ENGINE_EXIT_CODE", 1)))


def _llama_model_problem(ns: argparse.Namespace) -> list[str]:
    """llama.cpp's log when the model can't be loaded, or [] when it can."""
    if ns.hf_repo:
        cache = Path(os.environ.get("LLAMA_CACHE") or Path.home() / ".cache" / "llama.cpp")
        repo, _, quant = ns.hf_repo.partition(":")
        cache.mkdir(parents=True, exist_ok=True)
        target = cache / f"{repo.replace('/', '_')}_{quant or 'Q4_K_M'}.gguf"
        log(f"common_download_file_single: downloading to {target}")
        target.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 16)
        ns.model = str(target)
    elif ns.model_url:
        cache = Path(os.environ.get("LLAMA_CACHE") or Path.home() / ".cache" / "llama.cpp")
        cache.mkdir(parents=True, exist_ok=True)
        target = cache / ns.model_url.rstrip("/").rsplit("/", 1)[-1]
        log(f"common_download_file_single: downloading {ns.model_url} to {target}")
        target.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 16)
        ns.model = str(target)
    path = ns.model
    why = ""
    if not os.path.isfile(path):
        why = f"gguf_init_from_file: failed to open GGUF file '{path}'"
    else:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                why = "gguf_init_from_file_impl: invalid magic characters: 'xxxx', expected 'GGUF'"
    if not why:
        return []
    return [
        why,
        f"llama_model_load: error loading model: llama_model_loader: failed to load model from {path}",
        "llama_model_load_from_file_impl: failed to load model",
        f"common_init_from_params: failed to load model '{path}', try reducing --n-gpu-layers if you're running out of VRAM",
        f"srv    load_model: failed to load model, '{path}'",
        "srv   operator(): operator(): cleaning up before exit...",
        "main: exiting due to model loading error",
    ]


def _vllm_model_problem(ns: argparse.Namespace) -> list[str]:
    model = ns.model
    looks_local = model.startswith(("/", ".", "~")) or os.path.exists(model)
    if looks_local:
        if os.path.isfile(model) and model.endswith(".gguf"):
            return []
        if os.path.isfile(os.path.join(model, "config.json")):
            return []
    elif len(model.split("/")) == 2:
        # a Hugging Face id: "download" it where --download-dir says
        root = Path(
            ns.download_dir
            or os.environ.get("HF_HUB_CACHE")
            or Path.home() / ".cache" / "huggingface" / "hub"
        )
        snap = root / ("models--" + model.replace("/", "--")) / "snapshots" / "0000000"
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "config.json").write_text("{}")
        log(f"INFO [weight_utils.py:300] Downloading {model} to {root}", err=False)
        return []
    return [
        "Traceback (most recent call last):",
        '  File "/usr/local/bin/vllm", line 10, in <module>',
        "    sys.exit(main())",
        f"ValueError: Invalid repository ID or local directory specified: '{model}'.",
        "Please verify the following requirements:",
        "1. Provide a valid Hugging Face repository ID.",
        "2. Specify a local directory that contains a recognized configuration file.",
    ]


def engine_for(
    kind: str,
    ns: argparse.Namespace,
    *,
    tokens: int = 8,
    token_rate: float = 1000.0,
    first_token_seconds: float = 0.0,
    prefill_rate: float = 0.0,
    close_after_stream: float | None = None,
    env: Mapping[str, str] | None = None,
) -> Engine:
    """The engine the parsed command line `ns` (parse_llama / parse_vllm) starts: its served
    name, key, slots and context as the real one takes them from its flags. Also how
    llmgw.sim serves many engines in one process (build_app of each)."""
    vllm = kind == "vllm"
    served = (
        (ns.served_model_name[0] if ns.served_model_name else ns.model)
        if vllm
        else (ns.alias or Path(ns.model or ns.hf_repo or ns.model_url).stem)
    )
    return Engine(
        kind=kind,
        served_name=served,
        api_key=ns.api_key,
        metrics=True if vllm else ns.metrics,
        slots=1 if vllm else _llama_slots(ns),
        ctx=(ns.max_model_len or 4096) if vllm else ns.ctx_size,
        root=ns.model if vllm else "",
        tokens=tokens,
        token_rate=max(0.001, token_rate),
        first_token_seconds=max(0.0, first_token_seconds),
        prefill_rate=max(0.0, prefill_rate),
        close_after_stream=close_after_stream,
        batch=Batch((ns.max_num_seqs or VLLM_MAX_NUM_SEQS) if vllm else _llama_slots(ns)),
        vllm_loras=fake_lora.vllm_loras(ns, os.environ if env is None else env)
        if vllm
        else fake_lora.VllmLoras(),
        llama_loras=fake_lora.llama_loras(ns) if not vllm else fake_lora.LlamaLoras(),
    )


def _llama_slots(ns: argparse.Namespace) -> int:
    return ns.parallel if ns.parallel > 0 else LLAMA_AUTO_SLOTS


def listen_host(kind: str, ns: argparse.Namespace) -> str:
    """Where the engine listens when its command line says no --host: as the real ones."""
    return ns.host or ("0.0.0.0" if kind == "vllm" else "127.0.0.1")


async def serve(kind: str, ns: argparse.Namespace) -> int:
    from aiohttp import web

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if os.environ.get("FAKE_ENGINE_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    load_seconds = _env_float("FAKE_ENGINE_LOAD_SECONDS", 0.0)
    workers = _start_workers()
    vllm = kind == "vllm"
    engine = engine_for(
        kind,
        ns,
        tokens=int(_env_float("FAKE_ENGINE_TOKENS", 8)),
        token_rate=_env_float("FAKE_ENGINE_TOKEN_RATE", 1000.0),
        first_token_seconds=_env_float("FAKE_ENGINE_FIRST_TOKEN_SECONDS", 0.0),
        prefill_rate=_env_float("FAKE_ENGINE_PREFILL_RATE", 0.0),
        close_after_stream=(
            None
            if vllm or os.environ.get("FAKE_ENGINE_CLOSE_AFTER_STREAM") == "never"
            else max(0.0, _env_float("FAKE_ENGINE_CLOSE_AFTER_STREAM", 0.0))
        ),
    )
    engine.extra_waiting = int(_env_float("FAKE_ENGINE_WAITING", 0))
    engine.embedding_size = max(1, int(_env_float("FAKE_ENGINE_EMBEDDING_SIZE", 3)))
    if "FAKE_ENGINE_KV_USAGE" in os.environ:
        engine.kv_usage = min(1.0, max(0.0, _env_float("FAKE_ENGINE_KV_USAGE", 0.0)))
    served = engine.served_name
    host = listen_host(kind, ns)
    runner = web.AppRunner(
        build_app(engine),
        shutdown_timeout=0.5,
        handle_signals=False,
        access_log=None,
        # like llama-server and vLLM: a client that leaves stops its generation
        handler_cancellation=True,
    )
    await runner.setup()

    async def listen() -> None:
        site = web.TCPSite(runner, host, ns.port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            lines = [
                f"couldn't bind HTTP server socket, hostname: {host}, port: {ns.port}: {e.strerror}"
            ]
            if vllm:
                lines = [
                    f"OSError: [Errno {e.errno}] error while attempting to bind on address ('{host}', {ns.port}): {e.strerror}"
                ]
            else:
                lines.append("main: exiting due to HTTP server error")
            _fail(lines, err=not vllm)

    async def wait_or_stop(seconds: float) -> bool:
        """Sleep; True when a stop signal came first."""
        try:
            await asyncio.wait_for(stop.wait(), timeout=seconds)
            return True
        except TimeoutError:
            return False

    def record() -> None:
        # before the engine can be seen ready: a test that saw it ready reads a whole record
        _record({"served_name": served, "host": host, "port": ns.port, "workers": workers})

    if vllm:
        local_world = (
            ns.tensor_parallel_size
            * ns.pipeline_parallel_size
            * ns.data_parallel_size
            // max(1, ns.nnodes)
        )
        log(f"INFO [api_server.py:1800] vLLM API server version {VLLM_VERSION}", err=False)
        log(f"INFO [utils.py:300] non-default args: {sys.argv[2:]}", err=False)
        gpus = _visible_gpus()
        # on the CPU platform a rank is a process on the node's cores, not a GPU
        if local_world > gpus and os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
            _fail(
                [
                    f"ValueError: World size ({local_world}) is larger than the number of available GPUs ({gpus}) in this node."
                ],
                err=False,
            )
        if ns.nnodes > 1:
            log(
                f"INFO [multiproc_executor.py:100] node rank {ns.node_rank} of {ns.nnodes}, master {ns.master_addr}:{ns.master_port}",
                err=False,
            )
        problem = _vllm_model_problem(ns) or engine.vllm_loras.startup_problem()
        if problem:
            _fail(problem, err=False)
        log(f"INFO [model_runner.py:1000] Starting to load model {ns.model}...", err=False)
        # vLLM opens its port only after loading
        if await wait_or_stop(load_seconds):
            return 0
        if _fails_load_here(host):
            _fail(
                [
                    "ERROR [core.py:700] EngineCore failed to start.",
                    f"RuntimeError: {os.environ['FAKE_ENGINE_FAIL_LOAD']}",
                ],
                err=False,
            )
        log(
            f"INFO [gpu_model_runner.py:2000] Model loading took 1.00 GiB and {load_seconds:.2f} seconds",
            err=False,
        )
        record()
        engine.loading = False
        if ns.headless:
            log(
                f"INFO [core.py:800] headless node rank {ns.node_rank}: engine core running",
                err=False,
            )
        else:
            await listen()
            log(
                f"INFO [launcher.py:30] Starting vLLM API server 0 on http://{host}:{ns.port}",
                err=False,
            )
            log("INFO:     Application startup complete.", err=False)
    else:
        log("build: 9439 (47f6423ed) with cc (GCC) 13.2.0 for x86_64-linux-gnu")
        gpus = _visible_gpus()
        if ns.ngl not in ("0", "auto") and gpus == 0:
            log("warning: no usable GPU found, --gpu-layers option will be ignored")
        else:
            log(f"ggml_cuda_init: found {gpus} CUDA devices")
        log(
            f"system info: n_threads = {ns.threads or os.cpu_count()}, n_threads_batch = {ns.threads or os.cpu_count()}"
        )
        # llama-server listens first and answers 503 while loading
        await listen()
        log(f"main: HTTP server is listening, hostname: {host}, port: {ns.port}, http threads: 3")
        log("main: loading model")
        problem = _llama_model_problem(ns) or engine.llama_loras.startup_problem(ns.model)
        if problem:
            _fail(problem)
        log(f"srv    load_model: loading model '{ns.model}'")
        if await wait_or_stop(load_seconds):
            return 0
        if _fails_load_here(host):
            _fail(
                [
                    f"llama_model_load: error loading model: {os.environ['FAKE_ENGINE_FAIL_LOAD']}",
                    "llama_model_load_from_file_impl: failed to load model",
                    "main: exiting due to model loading error",
                ]
            )
        record()
        engine.loading = False
        log("main: model loaded")
        log(f"main: server is listening on http://{host}:{ns.port} - starting the main loop")
        log("srv  update_slots: all slots are idle")

    crash_after = os.environ.get("FAKE_ENGINE_CRASH_AFTER_LOAD")
    if crash_after is not None:
        if not await wait_or_stop(float(crash_after)):
            code = int(_env_float("FAKE_ENGINE_EXIT_CODE", 1))
            log("CUDA error: an illegal memory access was encountered", err=not vllm)
            log(f"fake engine: crashing with exit code {code}", err=not vllm)
            os._exit(code)  # a crash does not clean up
    await stop.wait()
    log(
        "srv    operator(): received SIGTERM, cleaning up before exit..."
        if not vllm
        else "INFO:     Shutting down",
        err=not vllm,
    )
    await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("llama-server", "vllm"):
        log("usage: python -m llmgw.sim.fake_engine {llama-server|vllm} ...")
        return 2
    kind, rest = argv[0], argv[1:]
    ns = parse_llama(rest) if kind == "llama-server" else parse_vllm(rest)
    return asyncio.run(serve(kind, ns))


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_fake_gguf(path: Path) -> Path:
    """A small, structurally complete GGUF (v3, one string key, one 32-byte f32 tensor): it
    passes the agent's header and size checks and the fake engine loads it; a real engine
    would refuse its architecture-less contents."""
    import struct

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    header += text("general.architecture") + struct.pack("<I", 8) + text("fake")
    # tensor info: name, n_dims, dims, ggml type (0 = F32), offset into the data section
    header += (
        text("w")
        + struct.pack("<I", 1)
        + struct.pack("<Q", 8)
        + struct.pack("<I", 0)
        + struct.pack("<Q", 0)
    )
    header += bytes(-len(header) % 32)  # data starts aligned to general.alignment (32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + bytes(8 * 4))
    return path


def install_fake_engines(bin_dir: Path, *, vllm_cpu: bool = False) -> dict[str, Path]:
    """Write executable `llama-server` and `vllm` into `bin_dir`, running this module.

    `exec` keeps the engine's pid the wrapper's, so process groups and signals behave
    as with the real binaries. `vllm` is laid out as pip installs it (a console script whose
    shebang names its environment's python, a `vllm-*.dist-info` in that environment), so
    discovery reads its version without running it, as on a real node. `vllm_cpu`: a CPU
    build's version (0.11.2+cpu), which validation lets run only CPU profiles.
    """
    version = f"{VLLM_VERSION}+cpu" if vllm_cpu else VLLM_VERSION
    bin_dir.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[2]
    pythonpath = f'PYTHONPATH="{root}${{PYTHONPATH:+:$PYTHONPATH}}"'
    llama = bin_dir / "llama-server"
    llama.write_text(
        f'#!/bin/sh\n{pythonpath} exec "{sys.executable}" -m llmgw.sim.fake_engine llama-server "$@"\n'
    )
    env = bin_dir.parent / f"{bin_dir.name}-vllm-env"
    python = env / "bin" / "python3"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f'#!/bin/sh\n{pythonpath} exec "{sys.executable}" "$@"\n')
    dist = env / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for old in dist.glob("vllm-*.dist-info"):
        shutil.rmtree(old)  # installed again as the other build
    (dist / f"vllm-{version}.dist-info").mkdir(parents=True, exist_ok=True)
    (dist / f"vllm-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    )
    vllm = bin_dir / "vllm"
    vllm.write_text(
        f"#!{python}\nimport sys\nfrom llmgw.sim.fake_engine import main\n"
        "# argv as `python -m llmgw.sim.fake_engine vllm ...` has it\n"
        'sys.argv = [sys.argv[0], "vllm", *sys.argv[1:]]\n'
        "sys.exit(main())\n"
    )
    for path in (llama, python, vllm):
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return {"llama-server": llama, "vllm": vllm}


if __name__ == "__main__":
    sys.exit(main())
