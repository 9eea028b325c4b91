"""Stand-in for ``python -m sglang.launch_server``: parses SGLang's flags, records them, serves ``/health``.

This is a MOCK of a program we cannot run here (SGLang's server needs CUDA kernels, DESIGN.md §5),
used to test the command line Miles' driver builds when it launches SGLang. What it checks: every
flag must be one of SGLang's own ``launch_server`` flags (names as in SGLang's ``server_args.py``)
with a value of the right type; anything else exits with argparse's usage error (code 2), as the
real server does. Values are written as JSON to the file named by ``MILES_FAKE_SGLANG_RECORD``.
Only ``GET /health`` is answered; the engine-protocol routes live in ``tests/engine/sglang_fake.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--random-seed", type=int)
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    return parser.parse_args(argv)


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # keep the engine log to what matters
        pass


def main() -> None:
    args = parse(sys.argv[1:])
    record = os.environ.get("MILES_FAKE_SGLANG_RECORD")
    if record:
        with open(record, "w") as f:
            json.dump({"argv": sys.argv[1:], "args": vars(args)}, f)
    print(f"fake sglang serving {args.model_path} on {args.host}:{args.port}", flush=True)
    ThreadingHTTPServer((args.host, args.port), _Health).serve_forever()


if __name__ == "__main__":
    main()
