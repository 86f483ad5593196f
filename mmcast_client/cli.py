"""`mmcast`: the command line of mmcast.

The client distribution owns the command and its `generate` sub-command. Other installed distributions add
sub-commands through the `mmcast.commands` entry-point group: each entry point, named after its sub-command, points
at a `Command`. The `mmcast` server distribution adds `serve-local`, `demo` and `make-tiny-model` this way, so an
application that installs only `mmcast-client` gets `mmcast generate` and nothing that needs torch.

Sub-commands import what they need inside `run`, so `mmcast --help` and `mmcast generate` start fast and load only
the SDK's dependencies.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from importlib.metadata import entry_points
from pathlib import Path

COMMAND_GROUP = "mmcast.commands"


@dataclasses.dataclass(frozen=True)
class Command:
    """One `mmcast` sub-command: what --help shows, its flags, and the function that runs it."""

    name: str  # the sub-command word; an entry point of COMMAND_GROUP carries the same name
    help: str  # its one line in `mmcast --help`
    description: str  # the text of `mmcast NAME --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]  # declares its flags and positionals
    run: Callable[[argparse.Namespace], int | None]  # runs it; the return value is the exit status (None: 0)
    # Set for a command that hands arguments on to another program: everything after the first `--` is kept out of
    # parsing and lands in `args.extra`. Unset, `--` keeps argparse's meaning (what follows is positional).
    passes_extra_args: bool = False
    # Set when the entry point failed to load (the exception, one line): the command then takes any arguments and
    # running it reports this instead of argparse's 'invalid choice'.
    load_error: str | None = None


def _unavailable(name: str, origin: str, error: BaseException) -> Command:
    """Stands in for a sub-command whose entry point failed to load, so that `mmcast --help` and the other
    sub-commands still work and running this one says what broke."""
    reason = f"{type(error).__name__}: {error}"

    def run(args: argparse.Namespace) -> int:
        print(f"error: mmcast {name} (from {origin}) could not be loaded: {reason}", file=sys.stderr)
        return 1

    return Command(
        name=name,
        help=f"unavailable ({reason})",
        description=f"This sub-command comes from {origin} and failed to load: {reason}",
        add_arguments=lambda p: None,
        run=run,
        load_error=reason,
    )


def discover_commands() -> dict[str, Command]:
    """`generate`, then every installed distribution's COMMAND_GROUP entry points. A name already taken keeps its
    first owner (the client's own `generate` cannot be replaced); distributions are met in sys.path order."""
    commands = {GENERATE.name: GENERATE}
    for point in entry_points(group=COMMAND_GROUP):
        if point.name in commands:
            continue
        origin = f"{point.dist.name} {point.dist.version}" if point.dist is not None else point.value
        try:
            command = point.load()
            if not isinstance(command, Command) or command.name != point.name:
                raise TypeError(f"{point.value} is not an mmcast_client.cli.Command named {point.name!r}")
        except Exception as e:  # a broken plug-in must not take `mmcast generate` down with it
            command = _unavailable(point.name, origin, e)
        commands[point.name] = command
    return commands


def client_version() -> str:
    """The installed mmcast-client's version; from client/pyproject.toml in a source checkout that is not installed.
    (The SDK cannot ask the server side: an SDK-only install has none.)"""
    try:
        return metadata.version("mmcast-client")
    except metadata.PackageNotFoundError:
        pass
    try:
        import tomllib

        with open(Path(__file__).resolve().parents[1] / "client" / "pyproject.toml", "rb") as fh:
            return str(tomllib.load(fh)["project"]["version"]) + "+source"
    except (OSError, KeyError, ValueError):
        return "unknown"


def build_parser(commands: Mapping[str, Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmcast",
        description="mmcast: multimodal LLM serving that never re-broadcasts image tensors the prefix cache covers.",
        epilog=None
        if len(commands) > 1
        else "Installing the mmcast server distribution adds serve-local, demo and make-tiny-model.",
    )
    parser.add_argument("--version", action="version", version=f"mmcast {client_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in sorted(commands, key=lambda n: (n != GENERATE.name, n)):
        command = commands[name]
        p = sub.add_parser(name, help=command.help, description=command.description)
        command.add_arguments(p)
    return parser


def parse(argv: Sequence[str], commands: Mapping[str, Command] | None = None) -> tuple[Command, argparse.Namespace]:
    """The sub-command named by `argv` and its parsed arguments (`args.extra`: what followed `--`, for a command
    that passes extra arguments on; otherwise empty)."""
    commands = discover_commands() if commands is None else commands
    argv, extra = list(argv), []
    first = commands.get(argv[0]) if argv else None
    if first is not None and first.passes_extra_args and "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = build_parser(commands)
    args, unknown = parser.parse_known_args(argv)
    command = commands[args.command]
    if unknown and command.load_error is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # what parse_args would say
    args.extra = extra
    return command, args


def main(argv: Sequence[str] | None = None) -> int:
    command, args = parse(sys.argv[1:] if argv is None else argv)
    try:
        return int(command.run(args) or 0)
    except KeyboardInterrupt:
        return 130


# -- generate ----------------------------------------------------------------------------------------------------
def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the text of the user turn")
    p.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT", help="scheduler address")
    p.add_argument("--image", action="append", default=[], metavar="FILE", help="an image file (repeatable)")
    p.add_argument(
        "--video", action="append", default=[], metavar="FILE", help="a video file, after the images (repeatable)"
    )
    p.add_argument("--video-fps", type=float, default=None, metavar="FPS", help="frames to sample per second of video")
    p.add_argument("--video-frames", type=int, default=None, metavar="N", help="frames to sample from each video")
    p.add_argument("--system", default=None, help="a system message before the user turn")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="draw among the K most likely tokens (default: no top-k cut)",
    )
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens regardless of EOS")
    p.add_argument("--no-upload", action="store_true", help="send image bytes inline instead of uploading by hash")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="deadline of the whole request in seconds (default: "
        "the SDK's, 60 s per upload and 120 s to the first token)",
    )
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="CA bundle that signed the server's certificate (TLS)")
    p.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="client certificate, for a server requiring mutual TLS"
    )
    p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--tls", action="store_true", help="use TLS with the system's root certificates")
    p.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="file holding the bearer token (default: $MMCAST_TOKEN when set)",
    )


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
    roots, key, chain = (
        _read(args.tls_ca, "--tls-ca"),
        _read(args.tls_key, "--tls-key"),
        _read(args.tls_cert, "--tls-cert"),
    )
    tls = True if args.tls or roots or chain else None
    return {"tls": tls, "root_certificates": roots, "private_key": key, "certificate_chain": chain, "token": token}


def cmd_generate(args: argparse.Namespace) -> int:
    from mmcast_client import Client, MmcastError

    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    sampling = {"fps": args.video_fps, "num_frames": args.video_frames}
    content = [{"type": "image", "image": path} for path in args.image]
    content += [{"type": "video", "video": path, **sampling} for path in args.video]
    content.append({"type": "text", "text": args.prompt})
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
                top_k=args.top_k,
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


GENERATE = Command(
    name="generate",
    help="stream one answer from a running scheduler",
    description="Send one user turn (images first, then the prompt) and stream the answer to stdout; a usage line "
    "goes to stderr.",
    add_arguments=add_generate_arguments,
    run=cmd_generate,
)


if __name__ == "__main__":
    # `python -m mmcast_client.cli`: run the imported module, whose Command class the entry points' objects are
    # instances of (this file, run as __main__, defines a second, distinct one).
    from mmcast_client.cli import main as _main

    sys.exit(_main())
