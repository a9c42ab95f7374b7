"""Which models this node holds: complete weight files in the weights directories.

Observes, never manages: how the files got there (Lustre, an rsync, a fetch) is nobody's
business here, and nothing is ever written into a weights directory. Blocking and
deterministic: the agent runs it in a worker thread on an interval and on request, and
rewrites nodes.<id> only when `weights_equal_for_resend` says what is held changed.

Recognised under each directory, up to two levels down:
- a Hugging Face cache repo `models--org--name/snapshots/<rev>/` (key "org/name");
- a directory of safetensors, single or sharded (key: its name, or "org/name" one level
  deeper);
- GGUF files, single or split `x-00001-of-0000N.gguf` (key: the file stem without the
  split suffix), at any of those levels and inside snapshots;
- LoRA adapters: a PEFT directory (adapter_config.json and its weights) and a GGUF whose
  header says it is an adapter, each where a model would be (weights/adapters.py).
An empty directory is not weights, because a half-finished download looks exactly like
one and would send placement to a node whose engine then fails to load.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from llmgw.agent.discovery.weights.adapters import check_peft, is_peft, peft_config
from llmgw.agent.discovery.weights.formats import (
    SAFETENSORS_INDEX_SUFFIX,
    Check,
    GgufSplit,
    check_gguf,
    check_gguf_split,
    check_safetensors,
    check_safetensors_dir,
    gguf_part_names,
    gguf_split,
    index_files,
)
from llmgw.agent.discovery.weights.mounts import (
    MountTable,
    RealPaths,
    is_under,
    read_share_id,
    resolve_store,
)
from llmgw.agent.files import TooLarge, read_text_bounded
from llmgw.bus.records import (
    HeldAdapter,
    HeldModel,
    IncompleteModel,
    Store,
    Weights,
    WeightsDir,
)

# companions download tools leave beside a file still being written
DOWNLOAD_MARKS = (".incomplete", ".part", ".tmp", ".aria2", ".crdownload")
# rsync writes `.<name>.XXXXXX` and renames it when done
_RSYNC_TEMP = re.compile(r"^\.(?P<name>.+\..+)\.[A-Za-z0-9]{6}$")
MAX_DEPTH = 2  # dir/model, dir/org/model, dir/hub/models--org--name
_NOT_MODELS = frozenset({"lost+found"})

log = logging.getLogger(__name__)
T = TypeVar("T")
H = TypeVar("H", HeldModel, HeldAdapter)


class _Timeout(Exception):
    """The scan's deadline passed inside one model: that model is left unjudged."""


# --- what a scan finds


@dataclass(frozen=True, slots=True)
class Found:
    """What one part of a scan found: models held, things that look like models but are not
    weights yet, and whether the deadline cut it short (then what is here was verified, and
    the rest of that part was not looked at)."""

    held: tuple[HeldModel, ...] = ()
    incomplete: tuple[IncompleteModel, ...] = ()
    timed_out: bool = False
    adapters: tuple[HeldAdapter, ...] = ()

    def __add__(self, other: Found) -> Found:
        return Found(
            self.held + other.held,
            self.incomplete + other.incomplete,
            self.timed_out or other.timed_out,
            self.adapters + other.adapters,
        )

    @property
    def anything(self) -> bool:
        """Something that looks like a model (or an adapter), complete or not."""
        return bool(self.held or self.incomplete or self.adapters)


_NOTHING = Found()
_STOPPED = Found(timed_out=True)


def _not_weights(key: str, path: Path, reason: str) -> Found:
    return Found(incomplete=(IncompleteModel(key=key, path=str(path), reason=reason),))


# --- caching header checks between scans


class FileCheckCache:
    """Header checks (and safetensors indexes read) keyed by (path, device, inode, size,
    mtime, ctime): a scan every few minutes then costs a stat per file and a lookup instead
    of an open and a read, which matters on Lustre or NFS with thousands of shards. A file
    whose size or times changed is read again. Keeps only what the last scan used."""

    def __init__(self) -> None:
        self._old: dict[tuple[object, ...], object] = {}
        self._new: dict[tuple[object, ...], object] = {}

    def check(self, path: str, fn: Callable[[str, os.stat_result | None], T]) -> T:
        return next(self.check_all((path,), fn, _nothing))

    def check_all(
        self,
        paths: Iterable[str],
        fn: Callable[[str, os.stat_result | None], T],
        tick: Callable[[], None],
    ) -> Iterator[T]:
        """fn(path, st) for each path new or changed since the last scan, else what it said
        then; `st` is the stat just taken, so fn need not take another before opening.
        `tick` is called before each path (the scan's deadline). Lazy: a caller that stops
        at the first incomplete file stats no further. One loop for a model's thousands of
        shards: a cached rescan costs a stat and a lookup per file, little more."""
        old, new = self._old, self._new
        for path in paths:
            tick()
            try:
                st = os.stat(path)
            except OSError:
                yield fn(path, None)  # fn reports the missing or unreadable file itself
                continue
            key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            hit = new.get(key)
            if hit is None:
                hit = old.get(key)
                if hit is None:
                    hit = fn(path, st)
                new[key] = hit
            yield hit  # type: ignore[misc]

    def end_scan(self) -> None:
        self._old, self._new = self._new, {}


def _nothing() -> None:
    pass


def _index_names(path: str, st: os.stat_result | None = None) -> tuple[str, ...]:
    return tuple(index_files(path))  # (read whole and bounded: `st` is not needed)


# --- one scan


@dataclass(frozen=True)
class _Context:
    """What every part of one scan reads; nothing here is written during the scan."""

    node: str
    mounts: MountTable
    overrides: Mapping[str, str]
    share_ids: Mapping[str, str]
    cache: FileCheckCache
    clock: Callable[[], float]
    deadline: float  # on `clock`
    realpath: RealPaths  # this scan's only

    def expired(self) -> bool:
        return self.clock() >= self.deadline

    def tick(self) -> None:
        if self.expired():
            raise _Timeout

    def store(self, path: Path) -> Store:
        return resolve_store(
            path, self.mounts, self.node, self.overrides, self.share_ids, self.realpath
        )

    def held(self, key: str, fmt: str, path: Path, check: Check) -> Found:
        if check.adapter:
            adapter = HeldAdapter(
                key=key,
                format="gguf" if fmt == "gguf" else "peft",
                path=str(path),
                bytes=check.bytes,
                files=check.files,
                store=self.store(path),
                rank=check.rank,
                base=check.arch,
            )
            return Found(adapters=(adapter,))
        model = HeldModel(
            key=key,
            format=fmt,  # type: ignore[arg-type]
            path=str(path),
            bytes=check.bytes,
            files=check.files,
            store=self.store(path),
        )
        return Found(held=(model,))

    def judged(self, key: str, fmt: str, path: Path, check: Check) -> Found:
        """Held when the check says complete, else not weights with its reason."""
        if check.complete:
            return self.held(key, fmt, path, check)
        return _not_weights(key, path, check.reason)

    def safetensors_files(self, paths: Iterable[str]) -> Iterator[Check]:
        return self.cache.check_all(paths, check_safetensors, self.tick)

    def safetensors_index(self, path: str) -> tuple[str, ...]:
        self.tick()
        return self.cache.check(path, _index_names)

    def gguf_file(self, path: str) -> Check:
        self.tick()
        return self.cache.check(path, check_gguf)

    def peft(self, directory: Path, files: list[str]) -> Check:
        self.tick()
        config = self.cache.check(str(directory / "adapter_config.json"), _peft_config)
        return check_peft(directory, files, self.safetensors_files, config)


def _one_model(key: str, path: Path, judge: Callable[..., Found], *args: object) -> Found:
    """One model's verdict. The deadline passing inside it leaves it unjudged; anything else
    going wrong while reading it makes it not weights, with the reason: one hostile or
    broken file never ends the scan of everything else."""
    try:
        return judge(*args)
    except _Timeout:
        return _STOPPED
    except OSError as exc:
        return _not_weights(key, path, f"unreadable: {exc.strerror or exc}")
    except Exception as exc:  # noqa: BLE001 - a bug or a bound missed; logged as one
        log.exception("checking %s (%s) failed", key, path)
        return _not_weights(key, path, f"could not be checked ({type(exc).__name__})")


def _download_target(name: str) -> str | None:
    """The file a download companion belongs to (`x.gguf.aria2` -> `x.gguf`), else None."""
    if name.startswith("."):  # every rsync temp is hidden: most names skip the regex
        m = _RSYNC_TEMP.match(name)
        if m:
            return m["name"]
    if not name.endswith(DOWNLOAD_MARKS):
        return None
    for mark in DOWNLOAD_MARKS:
        if name.endswith(mark) and len(name) > len(mark):
            return name[: -len(mark)]
    return None


@dataclass(frozen=True, slots=True)
class _Listing:
    # regular files, links to them, and other things that are not directories (a FIFO, a
    # device): those are reported as "not a regular file" when named as weights, never opened
    files: list[str]
    dirs: list[str]  # directories not hidden, sorted
    names: set[str]  # everything, hidden included
    pending: dict[str, str]  # file being downloaded -> its companion (first by name)

    def pending_for(self, names: Iterable[str]) -> str | None:
        return next((self.pending[n] for n in names if n in self.pending), None)


def _list(directory: Path) -> _Listing:
    files: list[str] = []
    dirs: list[str] = []
    names: set[str] = set()
    with os.scandir(directory) as it:
        for entry in it:  # thousands of shards: the common case (a file) is tested first
            name = entry.name
            names.add(name)
            try:
                if entry.is_file() or not (entry.is_dir() or entry.is_symlink()):
                    files.append(name)
                elif entry.is_dir():
                    if not name.startswith(".") and name not in _NOT_MODELS:
                        dirs.append(name)
                else:
                    entry.stat()  # a link to a FIFO or a device: listed; dangling: not
                    files.append(name)
            except OSError:
                continue  # vanished or unreadable between listing and stat
    pending: dict[str, str] = {}
    # most names are neither hidden nor a download's companion: C-level tests skip them
    for name in sorted(n for n in names if n.startswith(".") or n.endswith(DOWNLOAD_MARKS)):
        target = _download_target(name)
        if target is not None:
            pending.setdefault(target, name)
    return _Listing(sorted(files), sorted(dirs), names, pending)


def _hf_local_dir_pending(ctx: _Context, directory: Path, listing: _Listing) -> str | None:
    """`hf download --local-dir` keeps partial files under .cache/huggingface/download/."""
    if ".cache" not in listing.names:
        return None
    pending = directory / ".cache" / "huggingface" / "download"
    if not pending.is_dir():
        return None
    for dirpath, _, filenames in os.walk(pending):
        ctx.tick()
        for name in sorted(filenames):
            if name.endswith(".incomplete"):
                return os.path.relpath(os.path.join(dirpath, name), directory)
    return None


# --- GGUF files at one level


def _scan_ggufs(ctx: _Context, directory: Path, listing: _Listing) -> Found:
    """Every GGUF (single or split) in one directory."""
    singles: list[str] = []
    splits: dict[tuple[str, int], GgufSplit] = {}
    for name in listing.files:
        if not name.endswith(".gguf") or name.startswith("."):
            continue
        split = gguf_split(name)
        if split is None:
            singles.append(name)
        else:
            splits.setdefault((split.stem, split.total), split)
    models: list[tuple[str, list[str]]] = [(n[: -len(".gguf")], [n]) for n in singles]
    models += [(stem, gguf_part_names(split)) for (stem, _), split in sorted(splits.items())]

    def judge(key: str, parts: list[str]) -> Found:
        path = directory / parts[0]
        mark = listing.pending_for(parts)
        if mark:
            return _not_weights(key, path, f"download in progress ({mark})")
        if len(parts) == 1:
            check = ctx.gguf_file(str(path))
        else:
            split = splits[(key, len(parts))]
            check = check_gguf_split(directory, split, listing.files, ctx.gguf_file)
        return ctx.judged(key, "gguf", path, check)

    found = _NOTHING
    for key, parts in models:
        if ctx.expired():
            return found + _STOPPED
        found += _one_model(key, directory / parts[0], judge, key, parts)
        if found.timed_out:
            return found
    # a GGUF that so far exists only as its download companion
    keys = {key for key, _ in models}
    for target, mark in sorted(listing.pending.items()):
        if target.endswith(".gguf") and target not in listing.names:
            split = gguf_split(target)
            key = split.stem if split else target[: -len(".gguf")]
            if key not in keys:
                keys.add(key)
                found += _not_weights(key, directory / target, f"download in progress ({mark})")
    return found


# --- safetensors in one directory


def _scan_peft(ctx: _Context, key: str, directory: Path, listing: _Listing) -> Found:
    """A PEFT adapter directory: held as an adapter when complete, never as a model."""

    def judge() -> Found:
        mark = min(listing.pending.values(), default=None)
        if mark:
            return _not_weights(key, directory, f"download in progress ({mark})")
        return ctx.judged(key, "peft", directory, ctx.peft(directory, listing.files))

    return _one_model(key, directory, judge)


def _peft_config(path: str, st: os.stat_result | None = None):
    return peft_config(Path(path).parent)


def _has_safetensors(listing: _Listing) -> bool:
    return any(n.endswith((".safetensors", SAFETENSORS_INDEX_SUFFIX)) for n in listing.files)


def _scan_safetensors_dir(ctx: _Context, key: str, directory: Path, listing: _Listing) -> Found:
    def judge() -> Found:
        mark = min(listing.pending.values(), default=None) or _hf_local_dir_pending(
            ctx, directory, listing
        )
        if mark:
            return _not_weights(key, directory, f"download in progress ({mark})")
        check = check_safetensors_dir(
            directory, listing.files, ctx.safetensors_files, ctx.safetensors_index
        )
        return ctx.judged(key, "safetensors", directory, check)

    return _one_model(key, directory, judge)


# --- Hugging Face cache repos


def _hf_key(repo_dir_name: str) -> str:
    # models--org--name -> org/name (huggingface_hub forbids "--" inside a repo id)
    return repo_dir_name[len("models--") :].replace("--", "/")


def _snapshot_problem(ctx: _Context, snapshot: Path, pending_blobs: list[str]) -> str | None:
    """A link into blobs/ whose blob is gone, or a blob still downloading that this
    snapshot's links do not account for."""
    targets: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(snapshot):
        ctx.tick()
        depth = len(Path(dirpath).relative_to(snapshot).parts)
        if depth >= MAX_DEPTH:
            dirnames.clear()
        for name in sorted(filenames) + [
            d for d in dirnames if os.path.islink(os.path.join(dirpath, d))
        ]:
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                if not os.path.exists(full):
                    return f"{os.path.relpath(full, snapshot)} link dangling (blob missing)"
                targets.add(os.path.basename(os.readlink(full)))
    for blob in pending_blobs:
        if blob[: -len(".incomplete")] not in targets:
            return f"download in progress (blobs/{blob})"
    return None


def _scan_snapshot(ctx: _Context, key: str, snapshot: Path, pending_blobs: list[str]) -> Found:
    """Models in one snapshot; nothing held means an older one may be tried."""
    if ctx.expired():
        return _STOPPED

    def links() -> Found:
        problem = _snapshot_problem(ctx, snapshot, pending_blobs)
        return _not_weights(key, snapshot, problem) if problem else _NOTHING

    def safetensors() -> Found:
        check = check_safetensors_dir(
            snapshot, listing.files, ctx.safetensors_files, ctx.safetensors_index
        )
        return ctx.judged(key, "safetensors", snapshot, check)

    problem = _one_model(key, snapshot, links)
    if problem.anything or problem.timed_out:
        return problem
    listing = _list(snapshot)
    if is_peft(listing.files):
        return _scan_peft(ctx, key, snapshot, listing)
    found = _NOTHING
    if _has_safetensors(listing):
        found += _one_model(key, snapshot, safetensors)
    # GGUF repos often keep each quantisation in its own folder
    found += _scan_ggufs(ctx, snapshot, listing)
    for sub in listing.dirs:
        if found.timed_out:
            return found
        found += _scan_ggufs(ctx, snapshot / sub, _list(snapshot / sub))
    if not found.anything and not found.timed_out:
        return _not_weights(key, snapshot, "no weight files")
    return found


# a commit hash; anything much longer is not a ref
_REF_LIMIT = 4096


def _scan_hf_repo(ctx: _Context, repo: Path) -> Found:
    """refs/main's snapshot when it exists (the revision an engine loading by repo id
    resolves); otherwise the newest snapshot that holds complete weights."""
    key = _hf_key(repo.name)
    try:
        pending = sorted(n for n in os.listdir(repo / "blobs") if n.endswith(".incomplete"))
    except OSError:
        pending = []
    snapshots = repo / "snapshots"
    try:
        revs = sorted(os.listdir(snapshots))
    except OSError:
        return _not_weights(key, repo, "no snapshots (download not finished)")
    try:
        main = read_text_bounded(repo / "refs" / "main", _REF_LIMIT).strip()
    except (OSError, TooLarge):
        main = ""
    if main and main in revs:
        return _scan_snapshot(ctx, key, snapshots / main, pending)
    if not revs:
        return _not_weights(key, repo, "no snapshots (download not finished)")

    def newest_first(rev: str) -> tuple[float, str]:
        try:
            return (-os.stat(snapshots / rev).st_mtime, rev)
        except OSError:
            return (0.0, rev)

    problems = _NOTHING
    for rev in sorted(revs, key=newest_first):
        found = _scan_snapshot(ctx, key, snapshots / rev, pending)
        if found.held:
            # older snapshots' problems, and this one's, do not matter once it holds weights
            return Found(held=found.held, timed_out=found.timed_out)
        problems += found
        if found.timed_out:
            break
    return problems


# --- walking a weights directory


def _scan_level(ctx: _Context, directory: Path, key: str, depth: int) -> Found:
    """One directory `depth` levels under a weights directory."""
    if ctx.expired():
        return _STOPPED
    try:
        listing = _list(directory)
    except OSError as exc:
        if depth == 0:
            raise
        return _not_weights(key, directory, f"unreadable: {exc.strerror or exc}")
    found = _scan_ggufs(ctx, directory, listing)
    if found.timed_out:
        return found
    if is_peft(listing.files):
        return found + _scan_peft(ctx, key, directory, listing)
    if _has_safetensors(listing):
        # a model directory: what is below it is part of it
        return found + _scan_safetensors_dir(ctx, key, directory, listing)
    for name in listing.dirs:
        sub = directory / name
        if name.startswith("models--"):
            try:
                found += _scan_hf_repo(ctx, sub)
            except OSError as exc:
                found += _not_weights(_hf_key(name), sub, f"unreadable: {exc.strerror or exc}")
        elif not name.startswith(("datasets--", "spaces--")) and depth < MAX_DEPTH:
            sub_key = name if depth == 0 else f"{key}/{name}"
            found += _scan_level(ctx, sub, sub_key, depth + 1)
        if found.timed_out:
            return found
    if not found.anything and depth > 0 and not listing.dirs:
        # only config files, or nothing: a model whose weights have not arrived
        return _not_weights(
            key, directory, "no weight files" if listing.names else "empty directory"
        )
    return found


def _scan_dir(ctx: _Context, directory: Path) -> tuple[WeightsDir, Found]:
    try:
        store = ctx.store(directory)
        if not directory.is_dir():
            status = "missing" if not directory.exists() else "unreadable"
            detail = "does not exist" if status == "missing" else "not a directory"
            return WeightsDir(path=str(directory), status=status, detail=detail), _NOTHING
        found = _scan_level(ctx, directory, directory.name, 0)
    except OSError as exc:
        detail = exc.strerror or str(exc)
        return WeightsDir(path=str(directory), status="unreadable", detail=detail), _NOTHING
    except Exception as exc:  # noqa: BLE001 - a bug or a bound missed; this directory only
        log.exception("scanning %s failed", directory)
        detail = f"scan failed ({type(exc).__name__}); see the agent log"
        return WeightsDir(path=str(directory), status="unreadable", detail=detail), _NOTHING
    return WeightsDir(path=str(directory), status="ok", store=store), found


def scan_weights(
    dirs: Sequence[Path],
    fetch_dir: Path,
    mounts: MountTable,
    node: str,
    configured: bool,
    shared_overrides: Mapping[str, str] | None = None,
    deadline_s: float = 60.0,
    *,
    cache: FileCheckCache | None = None,
    clock: Callable[[], float] = time.monotonic,
    now: Callable[[], float] = time.time,
    on_dir: Callable[[Path], None] | None = None,
) -> Weights:
    """Scan the configured `dirs` and, always, `fetch_dir` (fetched weights land there).

    `configured` False (no directories in the config) still looks in the fetch dir, but the
    result says looked=False; for placement that ranks exactly like a node that looked and
    found nothing. A directory that does not exist is status "missing", one that cannot be
    listed "unreadable"; after `deadline_s` seconds the directory being scanned and all
    later ones are "timeout" (models already verified in it are kept; see
    `carry_over_timed_out`). The deadline is checked between file operations: a hard-hung
    NFS mount blocks the calling thread inside one, so run one scan at a time; `on_dir` is
    called with each directory as its turn begins, so the caller can say which one hangs.
    """
    started = clock()
    overrides = dict(shared_overrides or {})
    ordered: list[Path] = []
    seen_real: set[str] = set()
    share_ids: dict[str, str] = {}
    realpath = RealPaths()
    for d in [*dirs, fetch_dir]:
        if on_dir is not None:
            on_dir(Path(d))
        real = realpath(d)
        if real not in seen_real:
            seen_real.add(real)
            ordered.append(Path(d))
            share_id = read_share_id(Path(d))
            if share_id is not None:
                share_ids[real] = share_id
    ctx = _Context(
        node=node,
        mounts=mounts,
        overrides=overrides,
        share_ids=share_ids,
        cache=cache if cache is not None else FileCheckCache(),  # this scan's only
        clock=clock,
        deadline=started + deadline_s,
        realpath=realpath,
    )
    results: list[WeightsDir] = []
    found = _NOTHING
    for i, d in enumerate(ordered):
        if on_dir is not None:
            on_dir(d)
        if not ctx.expired():
            result, in_dir = _scan_dir(ctx, d)
            found += in_dir
            if not in_dir.timed_out:
                results.append(result)
                continue
        results += [
            WeightsDir(
                path=str(late),
                status="timeout",
                detail=f"scan stopped after {deadline_s:g} s (weights.scan_timeout)",
            )
            for late in ordered[i:]
        ]
        break
    if cache is not None:
        cache.end_scan()
    return Weights(
        looked=configured,
        scanned_at=now(),
        dirs=results,
        models=_dedupe_models(found.held, realpath),
        incomplete=sorted(
            {(i.key, i.path): i for i in found.incomplete}.values(), key=lambda i: (i.key, i.path)
        ),
        adapters=_dedupe_models(found.adapters, realpath),
    )


def _dedupe_models(models: Iterable[H], realpath: RealPaths) -> list[H]:
    # the same files reached twice (a configured dir inside another) are one holding
    unique: dict[tuple[str, str], H] = {}
    for m in models:
        unique.setdefault((m.key, realpath(m.path)), m)
    return sorted(unique.values(), key=lambda m: (m.key, m.path))


def weights_equal_for_resend(a: Weights, b: Weights) -> bool:
    """Equal in everything but when they were scanned: the agent rewrites nodes.<id> only
    when this is False."""
    return (a.looked, a.dirs, a.models, a.incomplete, a.adapters) == (
        b.looked,
        b.dirs,
        b.models,
        b.incomplete,
        b.adapters,
    )


def carry_over_timed_out(previous: Weights | None, current: Weights) -> Weights:
    """Keep the previous scan's models under directories this scan did not finish, so a slow
    filer does not make models vanish and reappear between scans."""
    if previous is None:
        return current
    timed_out = [d.path for d in current.dirs if d.status == "timeout"]
    if not timed_out:
        return current
    models = _carried(previous.models, current.models, timed_out)
    adapters = _carried(previous.adapters, current.adapters, timed_out)
    if models is current.models and adapters is current.adapters:
        return current
    return Weights(
        looked=current.looked,
        scanned_at=current.scanned_at,
        dirs=current.dirs,
        models=models,
        incomplete=current.incomplete,
        adapters=adapters,
    )


def _carried(previous: list[H], current: list[H], timed_out: list[str]) -> list[H]:
    """`current` with what `previous` held under the directories not scanned to the end."""
    have = {(m.key, m.path) for m in current}
    kept = [
        m
        for m in previous
        if (m.key, m.path) not in have and any(is_under(m.path, t) for t in timed_out)
    ]
    if not kept:
        return current
    return sorted([*current, *kept], key=lambda m: (m.key, m.path))
