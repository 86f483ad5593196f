"""A rank's default torch threads: the CPUs its process may use, shared by the ranks on the machine."""

from __future__ import annotations

import os

import pytest

from common.process import available_cpus, default_threads
from mmcast_local.cpu_pinning import cpu_plan
from mmcast_local.supervisor import LocalGroup
from worker_svc.config import WorkerConfig, load_config

EIGHT = set(range(8))


@pytest.fixture
def eight_cpus(monkeypatch, tmp_path):
    """An affinity mask of 8 CPUs and an empty cgroup root (no quota), whatever the test machine has."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: EIGHT)
    monkeypatch.setattr("common.process.CGROUP_ROOT", str(tmp_path / "no-cgroup"))
    return tmp_path


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_quota_caps_the_affinity_mask(eight_cpus):
    v2 = eight_cpus / "v2"
    _write(v2 / "cpu.max", "max 100000\n")
    assert available_cpus(str(v2)) == 8
    _write(v2 / "cpu.max", "250000 100000\n")  # a 2.5-CPU limit: 2 threads, never oversubscribed
    assert available_cpus(str(v2)) == 2
    _write(v2 / "cpu.max", "50000 100000\n")  # half a CPU: still one thread
    assert available_cpus(str(v2)) == 1
    v1 = eight_cpus / "v1"
    _write(v1 / "cpu" / "cpu.cfs_quota_us", "300000\n")
    _write(v1 / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert available_cpus(str(v1)) == 3
    _write(v1 / "cpu" / "cpu.cfs_quota_us", "-1\n")
    assert available_cpus(str(v1)) == 8
    _write(v2 / "cpu.max", "garbage")  # unreadable: the affinity mask alone
    assert available_cpus(str(v2)) == 8


def test_the_default_splits_the_cpus_among_the_local_ranks(eight_cpus):
    _write(eight_cpus / "no-cgroup" / "cpu.max", "max 100000\n")
    _write(eight_cpus / "token", "a-token-of-sixteen-or-more-characters\n")
    env = {"MMCAST_MODEL": "/m", "MMCAST_SHARED_TOKEN_FILE": str(eight_cpus / "token")}
    assert load_config([], env).threads == 8
    assert load_config(["--local-ranks", "2"], env).threads == 4
    assert load_config([], {**env, "MMCAST_LOCAL_RANKS": "3"}).threads == 2  # rounded down
    assert load_config(["--local-ranks", "16"], env).threads == 1  # at least one
    assert load_config(["--threads", "3", "--local-ranks", "2"], env).threads == 3  # an explicit value stays
    assert default_threads(4) == 2
    assert load_config(["--reserved-cpus", "1"], env).threads == 7  # one CPU left to the scheduler and clients
    assert load_config(["--reserved-cpus", "2", "--local-ranks", "2"], env).threads == 3
    assert load_config(["--reserved-cpus", "8"], env).threads == 1  # at least one
    assert load_config(["--threads", "2", "--reserved-cpus", "7"], env).threads == 2


def test_the_encoder_takes_the_reserved_cpus_unless_threads_are_explicit(eight_cpus):
    _write(eight_cpus / "no-cgroup" / "cpu.max", "max 100000\n")
    _write(eight_cpus / "token", "a-token-of-sixteen-or-more-characters\n")
    env = {"MMCAST_MODEL": "/m", "MMCAST_SHARED_TOKEN_FILE": str(eight_cpus / "token")}
    one_rank = load_config(["--reserved-cpus", "1"], env)  # serve-local's TP1 on 8 CPUs
    assert (one_rank.threads, one_rank.encoder_threads) == (7, 8)
    two_ranks = load_config(["--reserved-cpus", "1", "--local-ranks", "2"], env)
    assert (two_ranks.threads, two_ranks.encoder_threads) == (3, 4)
    explicit = load_config(["--threads", "2", "--reserved-cpus", "1"], env)
    assert (explicit.threads, explicit.encoder_threads) == (2, 2)  # an explicit --threads holds for the encoder
    chosen = load_config(["--threads", "2", "--encoder-threads", "6"], env)
    assert (chosen.threads, chosen.encoder_threads) == (2, 6)
    assert load_config([], {**env, "MMCAST_ENCODER_THREADS": "5"}).encoder_threads == 5


def test_the_encoder_runs_on_its_threads_and_the_decoder_on_its_own(tiny_model_dir, monkeypatch):
    import torch

    from common.multimodal import Modality
    from tests.support.worker_driver import rank_token_file
    from worker_svc.runner import ModelRunner

    config = WorkerConfig(
        model=str(tiny_model_dir), kv_blocks=16, threads=1, encoder_threads=2, shared_token_file=rank_token_file()
    )
    runner = ModelRunner(config)
    seen = []
    monkeypatch.setattr(runner.family, "encode", lambda *a, **k: seen.append(torch.get_num_threads()) or torch.zeros(1))
    feature = type("F", (), {})()
    torch.set_num_threads(1)
    pixels = type("T", (), {"data": torch.zeros(4, 4)})()
    grid = type("T", (), {"data": torch.tensor([1, 2, 2])})()
    feature.modality, feature.data = Modality.IMAGE, {"pixel_values": pixels, "image_grid_thw": grid}
    runner.encode(feature)
    assert seen == [2] and torch.get_num_threads() == 1  # back to --threads for the language model


def test_the_default_follows_the_real_machine(tmp_path):
    _write(tmp_path / "token", "a-token-of-sixteen-or-more-characters\n")
    assert WorkerConfig(model="/m", shared_token_file=str(tmp_path / "token")).threads == available_cpus()
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"local_ranks": 0}, "local_ranks=0 (--local-ranks): must be in [1, 1024]"),
        ({"threads": -1}, "threads=-1 (--threads): must be in [0, 1024]"),
        ({"reserved_cpus": -1}, "reserved_cpus=-1 (--reserved-cpus): must be in [0, 1024]"),
    ],
)
def test_bad_thread_settings_name_the_flag(kwargs, needle):
    with pytest.raises(ValueError) as info:
        WorkerConfig(model="/m", **kwargs)
    assert needle in str(info.value)


def test_serve_local_tells_its_ranks_how_many_share_the_machine(tmp_path):
    group = LocalGroup(
        tmp_path / "model", tp=3, log_dir=tmp_path / "logs", env={"PATH": os.environ["PATH"]}, pin_cpus=False
    )
    assert group.env["MMCAST_LOCAL_RANKS"] == "3" and group.env["MMCAST_RESERVED_CPUS"] == "1"
    mine = LocalGroup(
        tmp_path / "model",
        tp=3,
        log_dir=tmp_path / "logs",
        env={"MMCAST_LOCAL_RANKS": "6", "MMCAST_RESERVED_CPUS": "0"},
        pin_cpus=False,
    )
    assert mine.env["MMCAST_LOCAL_RANKS"] == "6" and mine.env["MMCAST_RESERVED_CPUS"] == "0"  # the operator's wins


def test_cpu_plans_give_the_scheduler_one_cpu_and_each_rank_an_equal_disjoint_slice():
    assert cpu_plan([0, 1], 1) == {"scheduler": [0], "rank0": [1]}
    assert cpu_plan([0, 1], 2) is None  # fewer CPUs than processes: shared, unpinned
    assert cpu_plan(range(8), 2) == {"scheduler": [0, 7], "rank0": [1, 2, 3], "rank1": [4, 5, 6]}
    assert cpu_plan([3, 5, 9, 11], 3) == {"scheduler": [3], "rank0": [5], "rank1": [9], "rank2": [11]}


def test_a_pinned_group_gives_each_rank_its_slice_as_threads(eight_cpus):
    group = LocalGroup(
        eight_cpus / "model", tp=3, log_dir=eight_cpus / "logs", env={"PATH": os.environ["PATH"]}, pin_cpus=True
    )
    assert group.cpus == {"scheduler": [0, 7], "rank0": [1, 2], "rank1": [3, 4], "rank2": [5, 6]}
    assert group.env["MMCAST_LOCAL_RANKS"] == "1" and group.env["MMCAST_RESERVED_CPUS"] == "0"
    assert group.describe()["cpus"] == group.cpus


def test_the_launcher_pins_the_child_before_it_runs(tmp_path):
    import subprocess
    import sys

    from mmcast_local.child_processes import LAUNCHER as _LAUNCHER

    cpu = min(os.sched_getaffinity(0))
    probe = "import os; print(sorted(os.sched_getaffinity(0)))"
    out = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(os.getpid()), str(cpu), sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.strip() == f"[{cpu}]"
    unpinned = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(os.getpid()), "", sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert unpinned.strip() == str(sorted(os.sched_getaffinity(0)))
