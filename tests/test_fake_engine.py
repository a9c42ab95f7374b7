"""The fake engine behaves like the real ones where llmgw can tell: flags, failures,
HTTP while loading, OpenAI streaming, metrics, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

import pytest

from llmgw.sim.fake_engine import free_port, write_fake_gguf


def run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=20
    )


def get(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except HTTPError as e:
        return e.code, e.read()


@contextmanager
def engine(argv: list[str], **env: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def read_until(proc: subprocess.Popen[bytes], text: str) -> str:
    """The engine's output line holding `text`; fails if the engine exits first."""
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        if text in line:
            return line
    raise AssertionError(f"the engine exited ({proc.wait()}) without printing {text!r}")


def wait_for(port: int, path: str, status: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if get(f"http://127.0.0.1:{port}{path}")[0] == status:
                return
        except (URLError, ConnectionError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{path} never answered {status}")


def test_unknown_flags_are_refused_like_the_real_engines(bins):
    llama = run([str(bins["llama-server"]), "--no-such-flag"])
    assert (llama.returncode, llama.stderr.strip()) == (
        1,
        "error: invalid argument: --no-such-flag",
    )
    vllm = run([str(bins["vllm"]), "serve", "org/m", "--no-such-flag"])
    assert vllm.returncode == 2
    assert vllm.stderr.strip().endswith("vllm serve: error: unrecognized arguments: --no-such-flag")


def test_the_example_catalogs_engine_arguments_are_taken_as_the_real_engines_take_them():
    """The README applies examples/catalog.toml, also to the simulated fleet: its llama3-70b
    rollout stopped there on `unrecognized arguments: --enable-prefix-caching`."""
    import tomllib
    from pathlib import Path

    from llmgw.sim.fake_engine import parse_llama, parse_vllm

    example = Path(__file__).resolve().parent.parent / "examples" / "catalog.toml"
    models = tomllib.loads(example.read_text())["models"]
    profiles = [p for m in models for p in m.get("profiles", [])]
    given = [p for p in profiles if p.get("extra_args")]
    assert given
    for p in given:
        parse = parse_vllm if p["engine"] == "vllm" else parse_llama
        parse(["serve", "m", *p["extra_args"]] if p["engine"] == "vllm" else p["extra_args"])


def test_versions_print_where_the_real_ones_do(bins):
    llama = run([str(bins["llama-server"]), "--version"])
    assert llama.returncode == 0 and llama.stdout == ""
    assert llama.stderr.splitlines()[0] == "version: 9439 (47f6423ed)"
    assert run([str(bins["vllm"]), "--version"]).stdout.strip() == "0.11.2"


def test_bad_model_paths_fail_with_the_engines_messages(bins, tmp_path):
    port = str(free_port())
    llama = run([str(bins["llama-server"]), "-m", str(tmp_path / "x.gguf"), "--port", port])
    assert llama.returncode == 1
    assert f"gguf_init_from_file: failed to open GGUF file '{tmp_path / 'x.gguf'}'" in llama.stderr
    assert llama.stderr.splitlines()[-1] == "main: exiting due to model loading error"
    vllm = run([str(bins["vllm"]), "serve", str(tmp_path / "nope"), "--port", port])
    assert vllm.returncode == 1
    assert "Invalid repository ID or local directory specified" in vllm.stdout


def test_llama_answers_503_while_loading_then_serves_streams_and_counts_in_flight(bins, tmp_path):
    port = free_port()
    model = write_fake_gguf(tmp_path / "m.gguf")
    argv = [str(bins["llama-server"]), "-m", str(model), "--port", str(port), "-a", "m1"]
    with engine([*argv, "--metrics", "-np", "2"], FAKE_ENGINE_LOAD_SECONDS="1") as proc:
        wait_for(port, "/health", 503, proc)
        status, body = get(f"http://127.0.0.1:{port}/health")
        assert json.loads(body)["error"]["message"] == "Loading model"
        wait_for(port, "/health", 200, proc)
        assert json.loads(get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"] == "m1"
        status, body = get(
            f"http://127.0.0.1:{port}/v1/completions",
            {"prompt": "x", "stream": True, "max_tokens": 2},
        )
        chunks = body.decode().split("\n\n")
        assert chunks[-2:] == ["data: [DONE]", ""]
        texts = [json.loads(c[6:])["choices"][0]["text"] for c in chunks[:-2]]
        assert texts == ["tok0 ", "tok1 ", ""]
        metrics = get(f"http://127.0.0.1:{port}/metrics")[1].decode()
        assert "llamacpp:requests_processing 0" in metrics.splitlines()
        slots = json.loads(get(f"http://127.0.0.1:{port}/slots")[1])
        assert [s["is_processing"] for s in slots] == [False, False]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 0


def test_llama_without_metrics_flag_refuses_the_metrics_endpoint(bins, tmp_path):
    port = free_port()
    model = write_fake_gguf(tmp_path / "m.gguf")
    with engine([str(bins["llama-server"]), "-m", str(model), "--port", str(port)]) as proc:
        wait_for(port, "/health", 200, proc)
        assert get(f"http://127.0.0.1:{port}/metrics")[0] == 501


def test_vllm_does_not_listen_while_loading_and_lists_its_served_name(bins, tmp_path):
    port = free_port()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = [
        str(bins["vllm"]),
        "serve",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        "m2",
    ]
    with engine(argv, FAKE_ENGINE_LOAD_SECONDS="2", CUDA_VISIBLE_DEVICES="GPU-a") as proc:
        read_until(proc, "Starting to load model")  # what vLLM prints as loading begins
        with pytest.raises(URLError):
            get(f"http://127.0.0.1:{port}/health")
        wait_for(port, "/health", 200, proc)
        assert json.loads(get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"] == "m2"
        status, body = get(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {"model": "m2", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"]
        hi = [{"role": "user", "content": "hi"}]
        assert (
            get(f"http://127.0.0.1:{port}/v1/chat/completions", {"model": "other", "messages": hi})[
                0
            ]
            == 404
        )
        assert "vllm:num_requests_running" in get(f"http://127.0.0.1:{port}/metrics")[1].decode()


def test_vllm_refuses_more_parallelism_than_visible_gpus(bins, tmp_path):
    out = run([str(bins["vllm"]), "serve", "org/m", "-tp", "4"], CUDA_VISIBLE_DEVICES="GPU-a,GPU-b")
    assert out.returncode == 1
    assert "World size (4) is larger than the number of available GPUs (2)" in out.stdout


def _gauges(port: int, *names: str) -> list[int]:
    text = get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    values = {line.split("{")[0].split()[0]: line.split()[-1] for line in text.splitlines()}
    return [int(float(values[n])) for n in names]


@pytest.mark.parametrize(
    ("kind", "flag", "running", "waiting"),
    [
        ("llama-server", "-np", "llamacpp:requests_processing", "llamacpp:requests_deferred"),
        ("vllm", "--max-num-seqs", "vllm:num_requests_running", "vllm:num_requests_waiting"),
    ],
)
def test_under_load_the_engines_run_their_slots_or_batch_and_the_rest_wait_in_arrival_order(
    bins, tmp_path, kind, flag, running, waiting
):
    from concurrent.futures import ThreadPoolExecutor

    port = free_port()
    if kind == "vllm":
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        argv = [str(bins["vllm"]), "serve", str(model), "--served-model-name", "m"]
    else:
        argv = [str(bins["llama-server"]), "-m", str(write_fake_gguf(tmp_path / "m.gguf"))]
        argv += ["-a", "m", "--metrics"]
    argv += ["--port", str(port), flag, "2"]
    # each answer takes 2 s (40 tokens at 20 a second): all four arrive well within it, and
    # the last are answered within the client's 5 s
    with engine(argv, FAKE_ENGINE_TOKENS="40", FAKE_ENGINE_TOKEN_RATE="20") as proc:
        wait_for(port, "/health", 200, proc)
        url = f"http://127.0.0.1:{port}/v1/completions"
        finished: list[int] = []

        def one(n: int) -> None:
            assert get(url, {"model": "m", "prompt": f"p{n}"})[0] == 200
            finished.append(n)

        with ThreadPoolExecutor(4) as pool:
            futures = []
            for n in range(4):
                futures.append(pool.submit(one, n))
                deadline = time.monotonic() + 5
                while sum(_gauges(port, running, waiting)) < n + 1:  # it arrived
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            # two run at once; the two that came last wait for them
            assert _gauges(port, running, waiting) == [2, 2]
            for f in futures:
                f.result()
        assert sorted(finished[:2]) == [0, 1] and sorted(finished[2:]) == [2, 3]
