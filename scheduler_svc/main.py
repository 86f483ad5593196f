"""``mmcast-scheduler``: the client API server, the step loop and the connection to the worker group.

Every ``SchedulerConfig`` field is a flag (``--kv-blocks``) and an environment variable (``MMCAST_KV_BLOCKS``);
flags win over the environment. ``--help`` lists them with their help text and default.

Exit status: 0 after a requested shutdown; ``EXIT_STARTUP_FAILURE`` (2, common/process.py, as the ranks use) when
it cannot start with what it was given — a missing flag, a checkpoint ``common/model_checks.py`` rejects for the
number of ``--workers``, a model folder without a chat template or image processor, a secret file it cannot read, a
port it cannot bind — logged as one line saying what to change, before anything heavy loads where it can be; 1 for a
crash after start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys

from common import tracing
from common.model_checks import ModelConfigError, check_checkpoint
from common.process import StartupError, ensure_allocator_env, setup_logging, startup_failure
from scheduler_svc.config import SchedulerConfig

log = logging.getLogger("mmcast.scheduler")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmcast-scheduler",
        description="mmcast scheduler: serves mmcast.v1.Generation and drives one tensor-parallel worker group.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(SchedulerConfig):
        flag = "--" + f.name.replace("_", "-")
        env = "MMCAST_" + f.name.upper()
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f"{f.metadata.get('help', '')} [env {env}]"
        kwargs: dict = {"dest": f.name, "help": help_text, "default": argparse.SUPPRESS}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if f.type in ("int", int):
            kwargs["type"] = int
        elif f.type in ("float", float):
            kwargs["type"] = float
        elif f.type in ("list", list):
            kwargs["type"] = str
        elif f.type in ("bool", bool):
            kwargs["type"] = _parse_bool
        kwargs["help"] += f" (default: {default if not isinstance(default, list) else ','.join(default) or 'none'})"
        parser.add_argument(flag, **kwargs)
    return parser


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def config_from(argv: list[str] | None, environ: dict[str, str] | None = None) -> SchedulerConfig:
    """Flags over environment variables over defaults. Raises SystemExit with the validation message."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    environ = os.environ if environ is None else environ
    values = {}
    for f in dataclasses.fields(SchedulerConfig):
        if f.name in args:
            values[f.name] = args[f.name]
            continue
        env = environ.get("MMCAST_" + f.name.upper())
        if env is None:
            continue
        try:
            if f.type in ("int", int):
                values[f.name] = int(env)
            elif f.type in ("float", float):
                values[f.name] = float(env)
            elif f.type in ("bool", bool):
                values[f.name] = _parse_bool(env)
            else:
                values[f.name] = env
        except (ValueError, argparse.ArgumentTypeError):
            parser.error(f"MMCAST_{f.name.upper()}={env!r} is not a valid {f.type}")
    try:
        return SchedulerConfig(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None) -> None:
    config = config_from(argv)
    ensure_allocator_env()
    setup_logging("scheduler", config.log_level)
    try:
        tracing.configure("scheduler")
    except tracing.TracingError as exc:
        sys.exit(startup_failure(log, str(exc)))
    if not config.model:
        sys.exit(startup_failure(log, "no model folder: pass --model DIR (or MMCAST_MODEL)"))
    if not config.workers:
        sys.exit(startup_failure(log, "no worker ranks: pass --workers HOST:PORT,... (or MMCAST_WORKERS), ordered by rank"))
    try:  # config.json alone, before the processor loads or a rank is dialled; the ranks check the same rule
        n = len(config.workers)
        check_checkpoint(config.model, n, "--workers", given=f"--workers lists {n} rank(s)", values="--workers counts")
    except ModelConfigError as exc:
        sys.exit(startup_failure(log, str(exc)))
    from scheduler_svc.server import serve  # heavy imports (torch, transformers) after argument checks

    try:
        asyncio.run(_run(serve, config))
    except StartupError as exc:  # one line, no traceback (--log-level debug shows it): the message says what to change
        log.debug("start-up failure", exc_info=exc)
        sys.exit(startup_failure(log, str(exc), model=config.model))
    except Exception:
        log.exception("scheduler failed")
        sys.exit(1)


async def _run(serve, config: SchedulerConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(config, stop)


if __name__ == "__main__":
    main()
