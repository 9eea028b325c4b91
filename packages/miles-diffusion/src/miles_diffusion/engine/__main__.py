"""``python -m miles_diffusion.engine --model DIR [--host 127.0.0.1] [--port N]``: one diffusion engine."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from miles.engines.process import exit_with_parent, listen


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m miles_diffusion.engine", description=__doc__)
    p.add_argument(
        "--model",
        required=True,
        help="a model directory (config.json + model.safetensors, or a diffusers SD3 pipeline directory)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=0, help="port (0: a free one)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("bfloat16", "float16", "float32"),  # precision.DTYPES, without importing torch yet
        help="the forward pass's compute dtype (float32 weights either way; others run under autocast)",
    )
    p.add_argument("--max-batch-size", type=int, default=64, help="most trajectories one request may ask for")
    p.add_argument("--handoff-dir", default=None, help="directory of safetensors hand-off files (colocated)")
    p.add_argument("--weight-version", type=int, default=0, help="the version the loaded weights are")
    p.add_argument("--torch-threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--seed", type=int, default=None, help="seeds torch's global RNG (requests bring their own)"
    )
    p.add_argument("--deterministic", action="store_true", help="torch's deterministic algorithms on")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    if not (args.device == "cpu" or args.device == "cuda" or re.fullmatch(r"cuda:\d+", args.device)):
        raise SystemExit(f"miles diffusion engine: --device {args.device!r}; allowed: cpu, cuda, cuda:N")
    if args.max_batch_size < 1:
        raise SystemExit(f"miles diffusion engine: --max-batch-size must be >= 1, got {args.max_batch_size}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        if os.path.isfile(os.path.join(args.model, "model_index.json")):  # a diffusers pipeline (sd3)
            from miles_diffusion.families import check_core_path

            try:
                check_core_path(args.model)
            except ValueError as exc:
                raise SystemExit(f"miles diffusion engine: {exc}") from None
        else:
            raise SystemExit(
                f"miles diffusion engine: {args.model!r} is not a model directory (no config.json)"
            )
    sock = listen(
        args.host, args.port, "miles diffusion engine", backlog=512
    )  # before the model loads: a taken port fails at once
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(
            f"miles diffusion engine: --device {args.device}, but torch sees no CUDA device here"
        )
    threads = args.torch_threads or int(os.environ.get("MILES_TORCH_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    if args.deterministic:
        from miles_diffusion.deterministic import enable_deterministic_mode

        enable_deterministic_mode(0 if args.seed is None else args.seed)
    elif args.seed is not None:
        torch.manual_seed(args.seed)
    from miles_diffusion.engine.server import DiffusionEngine, serve
    from miles_diffusion.precision import PrecisionConfig

    try:
        engine = DiffusionEngine(
            args.model,
            device=args.device,
            handoff_dir=args.handoff_dir,
            weight_version=args.weight_version,
            max_batch_size=args.max_batch_size,
            precision=PrecisionConfig(compute_dtype=args.dtype),
        )
    except ValueError as exc:
        raise SystemExit(f"miles diffusion engine: {exc}") from None
    if args.deterministic:
        from miles_diffusion.deterministic import check_attention_backends

        check_attention_backends(engine.model)
    host, port = sock.getsockname()[:2]
    logging.getLogger("miles_diffusion.engine").info("serving %s on http://%s:%d", args.model, host, port)
    serve(engine, sock)


if __name__ == "__main__":
    main()
