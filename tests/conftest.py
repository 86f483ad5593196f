"""Fixtures shared by the whole test suite."""

import os
import pathlib

import pytest

from common.tiny_model import ensure_tiny_model, recipe_id

# The ranks the suite starts size their KV pools from free memory (worker_svc/kv_sizing.py) under this cap rather
# than the default's 1 GiB: many ranks run at once on a shared machine, and 16 MiB is 1,024 blocks of the tiny model
# (16 KiB each; 2,048 per rank at TP 2), the pool it had before. A test that needs another size passes --kv-blocks.
os.environ.setdefault("MMCAST_KV_CACHE_MAX_BYTES", str(16 << 20))

# Set to a folder to keep the tiny models between test sessions; the folder names carry the build recipe, so a
# changed build never reuses a stale copy.
TINY_MODEL_CACHE_ENV = "MMCAST_TINY_MODEL_CACHE"


def _tiny_model(tmp_path_factory: pytest.TempPathFactory, variant: str, kv_heads: int | None = None) -> pathlib.Path:
    cache = os.environ.get(TINY_MODEL_CACHE_ENV)
    root = pathlib.Path(cache) if cache else tmp_path_factory.getbasetemp()
    if kv_heads is None:
        return ensure_tiny_model(root / f"tiny-{variant}-seed0-{recipe_id()}", variant=variant, seed=0)
    folder = root / f"tiny-{variant}-kv{kv_heads}-seed0-{recipe_id()}"
    return ensure_tiny_model(folder, variant=variant, seed=0, kv_heads=kv_heads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Folder of the embedded tiny Qwen2-VL (seed 0), built once per session."""
    return _tiny_model(tmp_path_factory, "qwen2_vl")


@pytest.fixture(scope="session")
def tiny_model_kv2_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny Qwen2-VL with 2 KV heads (the grouping of Qwen2-VL-2B; seed 0): TP 4 replicates each KV head."""
    return _tiny_model(tmp_path_factory, "qwen2_vl", kv_heads=2)


@pytest.fixture(scope="session")
def tiny_model_25_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Folder of the embedded tiny Qwen2.5-VL (seed 0), built once per session."""
    return _tiny_model(tmp_path_factory, "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_model_q3_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Folder of the embedded tiny Qwen3-VL (seed 0), built once per session."""
    return _tiny_model(tmp_path_factory, "qwen3_vl")


@pytest.fixture(scope="session")
def tiny_model_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Folder of the embedded tiny LLaVA (seed 0; no M-RoPE), built once per session."""
    return _tiny_model(tmp_path_factory, "llava")


_TINY_FIXTURES = {
    "qwen2_vl": "tiny_model_dir",
    "qwen2_5_vl": "tiny_model_25_dir",
    "qwen3_vl": "tiny_model_q3_dir",
    "llava": "tiny_model_llava_dir",
}


# --- worker fixtures: one loaded model and one in-process rank per tiny variant, shared by the worker tests ---

_WORKER_ENVS: dict = {}


class WorkerEnv:
    """A tiny model folder with its processor, its plain-transformers model (the oracle) and an in-process rank."""

    def __init__(self, model_dir: pathlib.Path) -> None:
        from transformers import AutoModelForImageTextToText

        from common.processor import load_processor
        from tests.support.worker_driver import InProcessWorker, rank_token_file
        from worker_svc.config import WorkerConfig

        self.model_dir = model_dir
        self.processor = load_processor(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
        self.image_token_id = self.model.config.image_token_id
        self.config = WorkerConfig(
            model=str(model_dir),
            listen="127.0.0.1:0",
            kv_blocks=256,
            max_tensor_bytes=64 << 20,
            scheduler_id="test",
            shared_token_file=rank_token_file(),
        )
        self.rank = InProcessWorker(self.config)

    def prompt(self, segments):
        from tests.support.worker_driver import process_prompt

        return process_prompt(self.processor, segments, self.image_token_id)


def _worker_env(request: pytest.FixtureRequest, variant: str) -> WorkerEnv:
    env = _WORKER_ENVS.get(variant)
    if env is None:
        env = _WORKER_ENVS[variant] = WorkerEnv(request.getfixturevalue(_TINY_FIXTURES[variant]))
        request.session.config.add_cleanup(env.rank.stop)
    return env


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"])
def worker_env(request: pytest.FixtureRequest) -> WorkerEnv:
    """An in-process rank (world size 1) of each tiny variant, with its oracle model."""
    return _worker_env(request, request.param)


@pytest.fixture(scope="session")
def worker_env_q2(request: pytest.FixtureRequest) -> WorkerEnv:
    """The Qwen2-VL in-process rank alone (protocol tests need one model, not both)."""
    return _worker_env(request, "qwen2_vl")


@pytest.fixture(scope="session")
def worker_env_for(request: pytest.FixtureRequest):
    """``worker_env_for("qwen2_vl" | "qwen2_5_vl" | "qwen3_vl" | "llava")``: the shared env of a variant, for tests parametrized by name."""
    return lambda variant: _worker_env(request, variant)


@pytest.fixture(scope="session")
def serve_local_tp2(tiny_model_dir):
    """One ``serve-local --tp 2`` group (lazy, the defaults) for the modules that only talk to it: starting a
    group costs tens of seconds on a loaded 2-core machine, so they share one."""
    from mmcast_local.supervisor import LocalGroup

    with LocalGroup(tiny_model_dir, 2, "lazy", ready_timeout=180) as group:
        yield group


# --- long runs: `fuzz`, `soak`, `chaos` tests run only when asked (make fuzz / soak / chaos) ----------------------------

# marker -> the option that enables its tests
_LONG_RUNS = {"fuzz": "--run-fuzz", "soak": "--run-soak", "chaos": "--run-chaos"}


def pytest_addoption(parser: pytest.Parser) -> None:
    for marker, option in _LONG_RUNS.items():
        try:
            parser.addoption(option, action="store_true", default=False, help=f"run the `{marker}`-marked tests")
        except ValueError:  # declared elsewhere already
            pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, option in _LONG_RUNS.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"long run: pass {option} (make {marker})")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


# --- the video oracle: transformers' own video processors, in their own venv (tests/oracle) -------------------------


@pytest.fixture(scope="session")
def oracle_venv() -> pathlib.Path:
    """The oracle venv's Python, installed on first use (scripts/install-oracle-venv.sh, skipped by its stamp
    after); the test is skipped only when pip cannot reach a package index."""
    from tests.oracle import OracleUnavailable, ensure_oracle_venv

    try:
        return ensure_oracle_venv()
    except OracleUnavailable as exc:
        pytest.skip(str(exc).splitlines()[0])
