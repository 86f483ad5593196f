"""`mmcast`: the command line of mmcast (make-tiny-model, serve-local, generate, demo).

Heavy modules (torch, transformers, the services) are imported inside the sub-command that needs them, so
`mmcast generate` and `--help` start fast and need only the SDK's dependencies.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence

DEFAULT_TINY_MODEL_DIR = "~/.cache/mmcast/tiny-qwen2-vl"
TRANSFER_MODES = ("full", "strip", "lazy")


class _Terminated(Exception):
    """Raised in the main thread by the SIGTERM handler so `finally` blocks stop the group."""


def _raise_terminated(signum, frame):
    raise _Terminated(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmcast",
        description="mmcast: multimodal LLM serving that never re-broadcasts image tensors the prefix cache covers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("make-tiny-model", help="build the embedded tiny Qwen2-VL model folder")
    p.description = "Build the embedded tiny, randomly initialised model into DIR (nothing is downloaded)."
    p.add_argument("dir", metavar="DIR", help="output folder (created; left alone if it already holds the model)")
    p.add_argument("--variant", choices=("qwen2_vl", "qwen2_5_vl"), default="qwen2_vl", help="architecture")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    p.add_argument(
        "--kv-heads",
        type=int,
        choices=(1, 2, 4, 8),
        default=4,
        help="KV heads of the 8 query heads (default 4; 2 is Qwen2-VL-2B's grouping: --tp 4 then replicates them)",
    )
    p.set_defaults(handler="cmd_make_tiny_model")

    p = sub.add_parser(
        "serve-local",
        help="run a scheduler and an N-rank worker group on loopback",
        description="Start N mmcast-worker ranks and one mmcast-scheduler on 127.0.0.1, supervise them (a dead "
        "rank restarts the whole group), print the addresses and a machine-readable 'READY {json}' line once "
        "ready, and stop everything on Ctrl-C / SIGTERM. Arguments after '--' go to mmcast-scheduler.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="model folder (e.g. from make-tiny-model)")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size = worker ranks (default 1)")
    p.add_argument("--transfer-mode", choices=TRANSFER_MODES, default="lazy", help="payload transfer (default lazy)")
    p.add_argument("--port", type=int, default=50051, metavar="P", help="scheduler gRPC port (0: a free one)")
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
    p.set_defaults(handler="cmd_serve_local")

    p = sub.add_parser(
        "generate",
        help="stream one answer from a running scheduler",
        description="Send one user turn (images first, then the prompt) and stream the answer to stdout; a usage "
        "line goes to stderr.",
    )
    p.add_argument("prompt", help="the text of the user turn")
    p.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT", help="scheduler address")
    p.add_argument("--image", action="append", default=[], metavar="FILE", help="an image file (repeatable)")
    p.add_argument("--system", default=None, help="a system message before the user turn")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens regardless of EOS")
    p.add_argument("--no-upload", action="store_true", help="send image bytes inline instead of uploading by hash")
    p.add_argument("--timeout", type=float, default=None, help="deadline of the whole request in seconds (default: "
                   "the SDK's, 60 s per upload and 120 s to the first token)")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="CA bundle that signed the server's certificate (TLS)")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="client certificate, for a server requiring mutual TLS")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--tls", action="store_true", help="use TLS with the system's root certificates")
    p.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="file holding the bearer token (default: $MMCAST_TOKEN when set)",
    )
    p.set_defaults(handler="cmd_generate")

    p = sub.add_parser(
        "demo",
        help="a growing multi-image conversation on a local group, with per-turn transfer savings",
        description="Build the tiny model if absent, start a local group and hold a conversation that adds one "
        "synthetic 1280x720 JPEG per turn; print per turn the images in context, cached tokens, TTFT, payload "
        "bytes broadcast and what the 'full' transfer mode would have broadcast.",
    )
    p.add_argument("--tp", type=int, default=2, metavar="N", help="tensor-parallel size (default 2)")
    p.add_argument("--turns", type=int, default=8, help="conversation turns, one new image each (default 8)")
    p.add_argument("--transfer-mode", choices=TRANSFER_MODES, default="lazy", help="payload transfer (default lazy)")
    p.add_argument(
        "--model-dir", default=DEFAULT_TINY_MODEL_DIR, help=f"model folder (default {DEFAULT_TINY_MODEL_DIR})"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic images (default 0)")
    p.add_argument("--target", default=None, metavar="HOST:PORT", help="use a running scheduler instead")
    p.set_defaults(handler="cmd_demo")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if argv[:1] == ["serve-local"] and "--" in argv:  # the rest goes to mmcast-scheduler
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    args.extra = extra
    try:
        return int(globals()[args.handler](args) or 0)  # looked up late so tests can replace a handler
    except KeyboardInterrupt:
        return 130


# -- make-tiny-model ---------------------------------------------------------------------------------------------
def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from common.tiny_model import ensure_tiny_model  # torch + transformers: only here

    path = ensure_tiny_model(os.path.expanduser(args.dir), variant=args.variant, seed=args.seed, kv_heads=args.kv_heads)
    print(path)
    return 0


# -- serve-local -------------------------------------------------------------------------------------------------
def cmd_serve_local(args: argparse.Namespace) -> int:
    import tempfile

    from common.process import EXIT_STARTUP_FAILURE
    from mmcast_client.local_group import LocalGroup, StartupFailure, ready_line

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="mmcast-serve-local-")
    try:  # checks the flags and, from config.json alone, that the checkpoint shards over --tp ranks
        group = LocalGroup(
            args.model,
            args.tp,
            args.transfer_mode,
            port=args.port,
            metrics_port_base=args.metrics_port_base,
            kv_blocks=args.kv_blocks,
            scheduler_args=args.extra,
            log_dir=log_dir,
            ready_timeout=args.ready_timeout,
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
        print(f"scheduler  grpc://{group.target}  (mmcast.v1.Generation, transfer mode {args.transfer_mode})")
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


# -- generate ----------------------------------------------------------------------------------------------------
def format_usage(result) -> str:
    u = result.usage
    return (
        f"usage: prompt_tokens={u.prompt_tokens} cached_tokens={u.cached_tokens} "
        f"completion_tokens={u.completion_tokens} images={u.images} sent={u.images_sent} "
        f"stripped={u.images_stripped} rank_cached={u.images_rank_cached} "
        f"payload_bytes_broadcast={u.payload_bytes_broadcast} payload_bytes_saved={u.payload_bytes_saved} "
        f"ttft={result.ttft_seconds * 1000:.1f}ms server_ttft={result.server_ttft_seconds * 1000:.1f}ms "
        f"total={result.total_seconds * 1000:.1f}ms finish={result.finish_reason}"
    )


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read()
    except OSError as e:
        raise SystemExit(f"error: {what} {path}: {e.strerror or e}") from None


def connection_options(args: argparse.Namespace) -> dict:
    """Client keyword arguments from --tls-ca/--tls-cert/--tls-key/--tls/--token-file (or $MMCAST_TOKEN)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("error: --tls-cert and --tls-key go together")
    token = os.environ.get("MMCAST_TOKEN") or None
    if args.token_file:
        token = (_read(args.token_file, "--token-file") or b"").decode().strip()
        if not token:
            raise SystemExit(f"error: --token-file {args.token_file} is empty")
    roots, key, chain = _read(args.tls_ca, "--tls-ca"), _read(args.tls_key, "--tls-key"), _read(args.tls_cert, "--tls-cert")
    tls = True if args.tls or roots or chain else None
    return {"tls": tls, "root_certificates": roots, "private_key": key, "certificate_chain": chain, "token": token}


def cmd_generate(args: argparse.Namespace) -> int:
    from mmcast_client import Client, MmcastError

    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    content = [{"type": "image", "image": path} for path in args.image] + [{"type": "text", "text": args.prompt}]
    messages.append({"role": "user", "content": content})
    try:
        options = connection_options(args)
        if args.timeout is not None:  # not given: the SDK's default deadlines
            options["timeout"] = args.timeout
        with Client(args.target, upload_images=not args.no_upload, **options) as client:
            stream = client.generate(
                messages,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                ignore_eos=args.ignore_eos,
                stream=True,
            )
            with stream:
                for delta in stream:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(format_usage(stream.result), file=sys.stderr)
    except MmcastError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    return 0


# -- demo --------------------------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from mmcast_client.demo import run_demo

    return run_demo(
        tp=args.tp,
        turns=args.turns,
        transfer_mode=args.transfer_mode,
        model_dir=os.path.expanduser(args.model_dir),
        max_tokens=args.max_tokens,
        seed=args.seed,
        target=args.target,
    )


if __name__ == "__main__":
    sys.exit(main())
