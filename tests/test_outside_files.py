"""Files an operator's path names, read as state files are (issue 30): a FIFO is refused,
never opened (a plain open() waits for a writer forever), a link to /dev/zero is refused
rather than read until memory runs out, and each refusal names the file. Real FIFOs and
links; the catalog through a real `llmgw catalog apply` process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

KINDS = ["a FIFO", "a device"]


def _hostile(path: Path, kind: str) -> Path:
    if kind == "a FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_llmgw_catalog_apply_refuses_a_catalog_that_is_no_regular_file(tmp_path, kind):
    path = _hostile(tmp_path / "catalog.toml", kind)
    out = subprocess.run(
        [sys.executable, "-m", "llmgw.cli", "catalog", "apply", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "LLMGW_NATS": "nats://127.0.0.1:1"},  # never reached
    )
    assert out.returncode != 0
    assert f"{path}: cannot read the catalog (is {kind}, not a regular file)" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_catalog_that_is_not_utf8_is_named_where(tmp_path):
    from llmgw.catalog import CatalogError, load_catalog_toml

    path = tmp_path / "catalog.toml"
    path.write_bytes(b'[[models]]\nid = "caf\xe9"\n')
    with pytest.raises(CatalogError) as refused:
        load_catalog_toml(path)
    assert refused.value.errors == [
        f"{path}: not UTF-8 text (byte 0xe9 at line 2, column 10); save it as UTF-8"
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_a_tls_file_that_is_no_regular_file_is_named(tmp_path, kind):
    from llmgw.bus.client import BusError, NatsSettings

    path = _hostile(tmp_path / "ca.pem", kind)
    with pytest.raises(BusError, match=f"TLS CA file {path} is {kind}, not a file"):
        NatsSettings(tls_ca=str(path)).ssl_context()


@pytest.mark.parametrize("kind", KINDS)
def test_a_key_file_that_is_no_regular_file_is_named(tmp_path, kind):
    from llmgw.keyfiles import SecretFileError, read_keys

    path = _hostile(tmp_path / "keys", kind)
    with pytest.raises(SecretFileError, match=f"API key file {path} is {kind}, not a regular"):
        read_keys(path, "API key")


def test_engine_discovery_reads_no_fifo_on_path_and_only_a_metadata_header(tmp_path):
    from llmgw.agent.discovery.engines import dist_info_versions, script_python

    fifo = _hostile(tmp_path / "vllm", "a FIFO")
    assert script_python(fifo, str(tmp_path)) is None  # refused, not waited on
    site = tmp_path / "lib" / "python3.11" / "site-packages" / "vllm-0.9.1.dist-info"
    site.mkdir(parents=True)
    # a description of any length after the header: only the header is read
    (site / "METADATA").write_bytes(
        b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.9.1\n\n" + b"x" * (8 << 20)
    )
    assert dist_info_versions([tmp_path]) == {"0.9.1"}
    (site / "METADATA").unlink()
    _hostile(site / "METADATA", "a FIFO")
    assert dist_info_versions([tmp_path]) == set()
