"""One configuration mechanism for both binaries (common/settings.py): flags and MMCAST_* variables generated from
the config dataclasses, flag over variable over default, choices in any case, --version and --print-config.

The units use a small dataclass of their own; the process tests start the real ``mmcast-scheduler``,
``mmcast-worker`` and ``mmcast`` entry points (console scripts beside this interpreter) on their cheap paths
(``--print-config``, ``--version``, a refused value), which load no model and bind no port.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest

from common import settings
from common.process import EXIT_STARTUP_FAILURE
from common.settings import LOG_LEVELS, setting
from mmcast_local.child_processes import command_for as _command
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.main import config_from
from worker_svc.config import WorkerConfig, load_config


@dataclasses.dataclass(frozen=True)
class Demo:
    name: str = setting(help="required text", section="first", metavar="NAME")
    count: int = setting(3, "how many", min=1, max=10, section="first")
    ratio: float = setting(0.5, "a share of 100%", min=0.0, max=1.0, section="second")
    mode: str = setting("fast", "how", choices=("fast", "Careful"), section="second")
    hosts: list = setting(["a:1"], "addresses", section="second")
    loud: bool = setting(False, "say more", section="second")

    def __post_init__(self) -> None:
        settings.check_fields(self)


def demo(argv, environ=None) -> Demo:
    return settings.load(Demo, settings.build_parser(Demo, prog="demo", description="d"), argv, environ or {})


def test_a_flag_wins_over_its_variable_which_wins_over_the_default():
    env = {"MMCAST_NAME": "from-env", "MMCAST_COUNT": "7", "MMCAST_RATIO": "0.25", "MMCAST_HOSTS": "x:1, y:2,"}
    got = demo(["--count", "4"], env)
    assert (got.name, got.count, got.ratio, got.hosts, got.mode, got.loud) == (
        "from-env",
        4,
        0.25,
        ["x:1", "y:2"],
        "fast",
        False,
    )
    assert demo(["--name", "flag"], env).name == "flag"
    assert demo(["--name", "n", "--loud"]).loud is True and demo(["--name", "n", "--loud", "off"]).loud is False
    assert demo([], {"MMCAST_NAME": "n", "MMCAST_LOUD": "YES"}).loud is True


@pytest.mark.parametrize("spelling", ["careful", "CAREFUL", "Careful", " cArEfUl "])
def test_choices_take_any_case_and_are_stored_canonically(spelling):
    assert demo(["--name", "n", "--mode", spelling]).mode == "Careful"
    assert demo([], {"MMCAST_NAME": "n", "MMCAST_MODE": spelling}).mode == "Careful"
    assert Demo(name="n", mode=spelling).mode == "Careful"


def test_an_unknown_choice_names_the_flag_and_the_allowed_values(capsys):
    with pytest.raises(SystemExit) as info:
        demo(["--name", "n", "--mode", "slow"])
    assert info.value.code == 2
    assert "argument --mode: 'slow' is not one of fast, Careful" in capsys.readouterr().err
    with pytest.raises(ValueError) as env_error:
        demo([], {"MMCAST_NAME": "n", "MMCAST_MODE": "slow"})
    assert str(env_error.value) == "MMCAST_MODE='slow' (--mode): 'slow' is not one of fast, Careful"
    with pytest.raises(ValueError, match=r"^mode='slow' \(--mode\): must be one of fast, Careful \(any case\)$"):
        Demo(name="n", mode="slow")


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {}, "name: required (--name NAME or MMCAST_NAME)"),
        ([], {"MMCAST_NAME": "n", "MMCAST_COUNT": "many"}, "MMCAST_COUNT='many' (--count): 'many' is not an integer"),
        ([], {"MMCAST_NAME": "n", "MMCAST_COUNT": "11"}, "count=11 (--count): must be in [1, 10]"),
        ([], {"MMCAST_NAME": "n", "MMCAST_RATIO": "x"}, "MMCAST_RATIO='x' (--ratio): 'x' is not a number"),
        ([], {"MMCAST_NAME": "n", "MMCAST_LOUD": "maybe"}, "MMCAST_LOUD='maybe' (--loud): 'maybe' is not a boolean"),
        (["--name", "n", "--ratio", "2"], {}, "ratio=2.0 (--ratio): must be in [0.0, 1.0]"),
    ],
)
def test_bad_values_name_the_variable_or_setting_and_the_flag(argv, environ, message):
    with pytest.raises(ValueError) as info:
        demo(argv, environ)
    assert str(info.value).startswith(message)


def test_values_built_in_code_get_the_same_checks():
    with pytest.raises(ValueError, match=r"count=2\.5 \(--count\): must be an integer"):
        Demo(name="n", count=2.5)
    with pytest.raises(ValueError, match=r"loud=1 \(--loud\): must be true or false"):
        Demo(name="n", loud=1)
    assert Demo(name="n", ratio=1).ratio == 1.0 and Demo(name="n", hosts="p:1,q:2").hosts == ["p:1", "q:2"]


def test_help_has_sections_defaults_and_variables():
    text = settings.build_parser(Demo, prog="demo", description="d").format_help()
    for needle in (
        "first:",
        "second:",
        "--version",
        "--print-config",
        "--name NAME",
        "(default: required)",
        "[env MMCAST_NAME]",
        "--mode {fast,Careful}",
        "(default: fast) [env MMCAST_MODE]",
        "a share of 100% (default: 0.5)",
        "(default: a:1) [env MMCAST_HOSTS]",
        "--loud [BOOL]",
    ):
        assert needle in " ".join(text.split()), needle


@pytest.mark.parametrize("cls", [SchedulerConfig, WorkerConfig])
def test_every_setting_of_both_binaries_has_help_and_a_section(cls):
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help", "").strip() and f.metadata.get("section"), f.name


@pytest.mark.parametrize("level", ["info", "INFO", "Warning", "debug", "ERROR"])
def test_log_level_in_any_case_on_both_binaries_in_process(level):
    assert config_from([], {"MMCAST_LOG_LEVEL": level}).log_level == level.lower()
    assert config_from(["--log-level", level], {}).log_level == level.lower()
    env = {"MMCAST_MODEL": "/m", "MMCAST_INSECURE_ALLOW_UNAUTHENTICATED": "1", "MMCAST_LOG_LEVEL": level}
    assert load_config([], env).log_level == level.lower()
    assert load_config(["--log-level", level], {**env, "MMCAST_LOG_LEVEL": "error"}).log_level == level.lower()
    assert SchedulerConfig(log_level=level).log_level == level.lower() and level.lower() in LOG_LEVELS


# --- real processes -----------------------------------------------------------------------------------------------
def _run(script: str, module: str, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MMCAST_") or k == "MMCAST_TINY_MODEL_CACHE"}
    return subprocess.run(
        [*_command(script, module), *argv], env={**environ, **env}, capture_output=True, text=True, timeout=120
    )


BINARIES = {
    "scheduler": ("mmcast-scheduler", "scheduler_svc.main", {}),
    "worker": ("mmcast-worker", "worker_svc.main", {"MMCAST_MODEL": "/m", "MMCAST_SHARED_TOKEN_FILE": __file__}),
}


@pytest.mark.parametrize("binary", sorted(BINARIES))
@pytest.mark.parametrize(("env_level", "flag_level"), [("info", None), ("INFO", "Warning")])
def test_log_level_in_any_case_is_accepted_by_the_real_binaries(binary, env_level, flag_level):
    # Before the shared generator the scheduler exited 2 on MMCAST_LOG_LEVEL=info while the worker accepted it.
    script, module, env = BINARIES[binary]
    argv = ["--print-config"] + (["--log-level", flag_level] if flag_level else [])
    done = _run(script, module, argv, {**env, "MMCAST_LOG_LEVEL": env_level, "MMCAST_METRICS_PORT": "9100"})
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["log_level"] == (flag_level or env_level).lower()
    assert printed["metrics_port"] == 9100  # the environment reached the same generator


@pytest.mark.parametrize("binary", sorted(BINARIES))
def test_an_unknown_log_level_stops_either_binary_naming_the_flag_and_the_levels(binary):
    script, module, env = BINARIES[binary]
    done = _run(script, module, ["--print-config"], {**env, "MMCAST_LOG_LEVEL": "verbose"})
    assert done.returncode == EXIT_STARTUP_FAILURE
    record = json.loads(done.stderr.strip().splitlines()[-1])
    assert record["startup_failure"] is True
    assert (
        "MMCAST_LOG_LEVEL='verbose' (--log-level): 'verbose' is not one of debug, info, warning, error" in record["msg"]
    )
    done = _run(script, module, ["--log-level", "verbose"], env)
    assert done.returncode == 2
    assert "argument --log-level: 'verbose' is not one of debug, info, warning, error" in done.stderr


@pytest.mark.parametrize(
    ("script", "module"),
    [("mmcast-scheduler", "scheduler_svc.main"), ("mmcast-worker", "worker_svc.main"), ("mmcast", "mmcast_client.cli")],
)
def test_every_binary_answers_version(script, module):
    done = _run(script, module, ["--version"], {})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{script} {settings.package_version()}"
    assert settings.package_version()[0].isdigit()


def test_version_falls_back_to_the_source_tree_when_not_installed(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    import tomllib

    with open(os.path.join(os.path.dirname(settings.__file__), "..", "pyproject.toml"), "rb") as fh:
        expected = tomllib.load(fh)["project"]["version"]
    assert settings.package_version() == f"{expected}+source"
