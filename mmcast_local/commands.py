"""The sub-commands the server distribution adds to `mmcast` (entry-point group `mmcast.commands`, see
mmcast_client/cli.py): `make-tiny-model`, `serve-local` and `demo`.

This module is loaded whenever `mmcast` builds its parser, so it imports only the standard library and the client's
`Command`; torch, transformers and the services are imported inside the function that runs a sub-command.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from mmcast_client.cli import Command

DEFAULT_TINY_MODEL_DIR = "~/.cache/mmcast/tiny-qwen2-vl"
TRANSFER_MODES = ("full", "strip", "lazy")
# make-tiny-model --family NAME -> the tiny model variant (common/tiny_model.py) it builds
FAMILY_VARIANTS = {"qwen2-vl": "qwen2_vl", "qwen2.5-vl": "qwen2_5_vl", "qwen3-vl": "qwen3_vl", "llava": "llava"}


class _Terminated(Exception):
    """Raised in the main thread by the SIGTERM handler so `finally` blocks stop the group."""


def _raise_terminated(signum, frame):
    raise _Terminated(signal.Signals(signum).name)


# -- make-tiny-model ---------------------------------------------------------------------------------------------
def add_make_tiny_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="output folder (created; left alone if it already holds the model)")
    p.add_argument(
        "--family",
        choices=tuple(FAMILY_VARIANTS),
        default=None,
        help="model family (default qwen2-vl; the families of common/families/)",
    )
    p.add_argument(
        "--variant",
        choices=tuple(FAMILY_VARIANTS.values()),
        default=None,
        help="the same choice by transformers model type (qwen2_vl, qwen2_5_vl, qwen3_vl, llava)",
    )
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    p.add_argument(
        "--kv-heads",
        type=int,
        choices=(1, 2, 4, 8),
        default=4,
        help="KV heads of the 8 query heads (default 4; 2 is Qwen2-VL-2B's grouping: --tp 4 then replicates them)",
    )


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from common.tiny_model import ensure_tiny_model  # torch + transformers: only here

    if args.family and args.variant and FAMILY_VARIANTS[args.family] != args.variant:
        raise SystemExit(f"--family {args.family} and --variant {args.variant} name different models; give one")
    variant = FAMILY_VARIANTS[args.family] if args.family else (args.variant or "qwen2_vl")
    path = ensure_tiny_model(os.path.expanduser(args.dir), variant=variant, seed=args.seed, kv_heads=args.kv_heads)
    print(path)
    return 0


# -- serve-local -------------------------------------------------------------------------------------------------
def add_serve_local_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="model folder (e.g. from make-tiny-model)")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size = worker ranks (default 1)")
    p.add_argument("--transfer-mode", choices=TRANSFER_MODES, default="lazy", help="payload transfer (default lazy)")
    p.add_argument("--port", type=int, default=50051, metavar="P", help="scheduler gRPC port (0: a free one)")
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        metavar="H",
        help="OpenAI-compatible HTTP API port (default 8000; 0: a free one)",
    )
    p.add_argument("--no-http", action="store_true", help="serve the gRPC API only")
    p.add_argument(
        "--metrics-port-base",
        type=int,
        default=None,
        metavar="Q",
        help="scheduler /metrics on Q, rank r on Q+1+r (default: free ports)",
    )
    p.add_argument("--kv-blocks", type=int, default=None, metavar="K", help="KV pool blocks per rank")
    p.add_argument("--log-dir", default=None, help="where the processes' logs go (default: a new temp folder)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    p.add_argument(
        "--pin-cpus",
        action="store_true",
        help="with at least tp+1 CPUs, pin the scheduler to one and each rank to an equal slice of the rest "
        "(default: unpinned, the kernel places them)",
    )


def cmd_serve_local(args: argparse.Namespace) -> int:
    import tempfile

    from common.process import EXIT_STARTUP_FAILURE
    from mmcast_local.supervisor import LocalGroup, StartupFailure, ready_line

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="mmcast-serve-local-")
    try:  # checks the flags and, from config.json alone, that the checkpoint shards over --tp ranks
        group = LocalGroup(
            args.model,
            args.tp,
            args.transfer_mode,
            port=args.port,
            http_port=None if args.no_http else args.http_port,
            metrics_port_base=args.metrics_port_base,
            kv_blocks=args.kv_blocks,
            scheduler_args=args.extra,
            log_dir=log_dir,
            ready_timeout=args.ready_timeout,
            pin_cpus=args.pin_cpus,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_STARTUP_FAILURE
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        print(f"starting 1 scheduler + {args.tp} worker rank(s); logs in {log_dir}", file=sys.stderr, flush=True)
        started = time.monotonic()
        group.start()
        group.wait_ready()
        print(f"ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
        print(f"scheduler  grpc://{group.target}  (mmcast.v1.GenerationService, transfer mode {args.transfer_mode})")
        if group.openai_base_url:
            print(f"openai     {group.openai_base_url}  (chat completions, completions, models)")
        for r, target in enumerate(group.worker_targets):
            print(f"rank {r:<4}  grpc://{target}")
        for name, url in group.metrics_urls.items():
            print(f"metrics    {name:<9} {url}")
        print(ready_line(group), flush=True)
        while group.failure is None:
            time.sleep(0.5)
        print(f"error: {group.failure}", file=sys.stderr)
        return EXIT_STARTUP_FAILURE if group.startup_failed else 1
    except (KeyboardInterrupt, _Terminated):
        print("stopping", file=sys.stderr, flush=True)
        return 0
    except StartupFailure as e:  # one line: the cause; no restarts were attempted
        print(f"error: {e}", file=sys.stderr)
        return EXIT_STARTUP_FAILURE
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        # A second Ctrl-C during the grace period must not leave processes behind: ignore it while stopping.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            group.stop()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)


# -- demo --------------------------------------------------------------------------------------------------------
def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=2, metavar="N", help="tensor-parallel size (default 2)")
    p.add_argument("--turns", type=int, default=8, help="conversation turns, one new image each (default 8)")
    p.add_argument("--transfer-mode", choices=TRANSFER_MODES, default="lazy", help="payload transfer (default lazy)")
    p.add_argument(
        "--model-dir", default=DEFAULT_TINY_MODEL_DIR, help=f"model folder (default {DEFAULT_TINY_MODEL_DIR})"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic images (default 0)")
    p.add_argument("--target", default=None, metavar="HOST:PORT", help="use a running scheduler instead")
    p.add_argument(
        "--video",
        action="store_true",
        help="the video workloads instead: a clip re-read each turn, then a live stream of 2 s segments",
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from mmcast_local.demo import run_demo

    return run_demo(
        tp=args.tp,
        turns=args.turns,
        transfer_mode=args.transfer_mode,
        model_dir=os.path.expanduser(args.model_dir),
        max_tokens=args.max_tokens,
        seed=args.seed,
        target=args.target,
        video=args.video,
    )


MAKE_TINY_MODEL = Command(
    name="make-tiny-model",
    help="build the embedded tiny Qwen2-VL model folder",
    description="Build the embedded tiny, randomly initialised model into DIR (nothing is downloaded).",
    add_arguments=add_make_tiny_model_arguments,
    run=cmd_make_tiny_model,
)

SERVE_LOCAL = Command(
    name="serve-local",
    help="run a scheduler and an N-rank worker group on loopback",
    description="Start N mmcast-worker ranks and one mmcast-scheduler on 127.0.0.1, supervise them (a dead rank "
    "restarts the whole group), print the addresses and a machine-readable 'READY {json}' line once ready, and stop "
    "everything on Ctrl-C / SIGTERM. Arguments after '--' go to mmcast-scheduler.",
    add_arguments=add_serve_local_arguments,
    run=cmd_serve_local,
    passes_extra_args=True,
)

DEMO = Command(
    name="demo",
    help="a growing multi-image conversation on a local group, with per-turn transfer savings",
    description="Build the tiny model if absent, start a local group and hold a conversation that adds one synthetic "
    "1280x720 JPEG per turn; print per turn the images in context, cached tokens, TTFT, payload bytes broadcast and "
    "what the 'full' transfer mode would have broadcast.",
    add_arguments=add_demo_arguments,
    run=cmd_demo,
)
