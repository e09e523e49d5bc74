"""`python -m inference_svc [flags]`: one inference service replica, the same as `structd inference [flags]`.

A tensor-parallel rank 0 started without a rank layout starts its other
ranks as `python -m inference_svc <its own flags>` (tensor_parallel.py).
"""

from __future__ import annotations

import argparse
import sys

from inference_svc import config
from shared.entry import run_service, service_main

HELP = "run the inference service"
DESCRIPTION = ("Run one inference service replica (gRPC inference.v1.InferenceService): "
               "continuous batching with masks from the grammar tier.")
add_arguments = config.add_arguments


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """argv: the flags it was started with (ranks it starts itself get the same)."""
    # The configuration first: a bad flag is refused before the server's imports (torch, xgrammar) are paid.
    service_config = config.from_args(args)
    from inference_svc.server import serve

    return run_service(serve, service_config, argv)


def main(argv: list[str] | None = None) -> int:
    return service_main("inference_svc", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
