"""Parse `vllm serve` command lines with vLLM's own parser, without serving anything.

Run by vLLM's python (it imports vllm, and nothing of llmgw): reads a JSON list of argvs
(each `[binary, "serve", ...]`) on stdin, writes one JSON object per argv on stdout:
{"ok": true, "args": {the parsed values that llmgw sets}} or {"ok": false, "error": ...}.
vLLM's parser is what `vllm serve` runs first: it refuses an unknown flag, a missing or
ill-typed value, and, in validate_parsed_serve_args, combinations it knows are wrong.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

# what tests compare: each flag llmgw builds, under the name vLLM parses it to
FIELDS = (
    "model_tag",
    "host",
    "port",
    "served_model_name",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "download_dir",
    "max_model_len",
    "max_num_seqs",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "headless",
    "api_key",
)


def parse(argv: list[str]) -> dict:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = parser.parse_args(argv[2:])
            args.subparser = "serve"
            validate_parsed_serve_args(args)
    except SystemExit:
        return {"ok": False, "error": errors.getvalue().strip().splitlines()[-1:]}
    except (TypeError, ValueError) as e:
        return {"ok": False, "error": [str(e)]}
    return {"ok": True, "args": {f: getattr(args, f, None) for f in FIELDS}}


def main() -> None:
    for argv in json.load(sys.stdin):
        print(json.dumps(parse(argv), default=str), flush=True)


if __name__ == "__main__":
    main()
