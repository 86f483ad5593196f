"""The KV pool's size rule (worker_svc/kv_sizing.py): --kv-blocks when given, else a share of the free memory, capped;
and a real rank sizing its pool by it."""

from __future__ import annotations

import pytest

from worker_svc.kv_sizing import (
    MAX_BLOCKS,
    PoolSizeError,
    _cgroup_available,
    _meminfo_available,
    block_bytes,
    size_pool,
)

GiB = 1 << 30


def test_a_block_holds_keys_and_values_of_every_layer_for_the_ranks_heads():
    # Qwen2-VL-2B on one rank, bfloat16: 28 layers, 2 KV heads of 128, 16 tokens
    assert block_bytes(num_layers=28, kv_heads=2, head_dim=128, block_size=16, dtype_bytes=2) == 458_752
    # the tiny model, float32: 2 layers, 4 heads of 16
    assert block_bytes(num_layers=2, kv_heads=4, head_dim=16, block_size=16, dtype_bytes=4) == 16384


def test_kv_blocks_overrides_the_memory_rule():
    size = size_pool(block_bytes=8192, kv_blocks=300, available_bytes=0, fraction=0.5, max_bytes=1)
    assert (size.blocks, size.nbytes, size.reason) == (300, 300 * 8192, "--kv-blocks")


def test_a_fraction_of_the_available_memory_in_whole_blocks():
    size = size_pool(block_bytes=458_752, kv_blocks=0, available_bytes=10 * GiB, fraction=0.5, max_bytes=0)
    assert size.blocks == (5 * GiB) // 458_752 and size.nbytes <= 5 * GiB < size.nbytes + 458_752
    assert "0.5 of 10737418240 bytes" in size.reason and "capped" not in size.reason


def test_local_ranks_share_the_machine_and_the_cap_bounds_each():
    shared = size_pool(block_bytes=1024, kv_blocks=0, available_bytes=8 * GiB, fraction=0.5, max_bytes=0, sharers=4)
    assert shared.nbytes == GiB and "over 4 local ranks" in shared.reason
    capped = size_pool(block_bytes=1000, kv_blocks=0, available_bytes=8 * GiB, fraction=0.5, max_bytes=GiB // 4)
    assert capped.blocks == (GiB // 4) // 1000 and "capped by --kv-cache-max-bytes=268435456" in capped.reason
    # a cap above the share changes nothing
    assert (
        size_pool(block_bytes=1024, kv_blocks=0, available_bytes=GiB, fraction=0.5, max_bytes=4 * GiB).nbytes
        == GiB // 2
    )


def test_the_count_stays_within_the_settings_bound():
    size = size_pool(block_bytes=1, kv_blocks=0, available_bytes=1 << 40, fraction=1.0, max_bytes=0)
    assert size.blocks == MAX_BLOCKS


@pytest.mark.parametrize(
    ("available", "max_bytes", "sharers", "needle"),
    [
        (100_000, 0, 1, "0.5 of 100000 bytes of available memory is 50000 bytes, and one block takes 458752"),
        (10 * GiB, 4096, 1, "(at most --kv-cache-max-bytes=4096) is 4096 bytes"),
        (600_000, 0, 2, "over 2 local ranks"),
        (-5, 0, 1, "is 0 bytes"),
    ],
)
def test_not_one_block_is_a_clear_error_naming_the_settings(available, max_bytes, sharers, needle):
    with pytest.raises(PoolSizeError) as info:
        size_pool(
            block_bytes=458_752,
            kv_blocks=0,
            available_bytes=available,
            fraction=0.5,
            max_bytes=max_bytes,
            sharers=sharers,
        )
    message = str(info.value)
    assert needle in message and "--kv-cache-memory-fraction" in message and "--kv-blocks" in message
    assert isinstance(info.value, ValueError)


def test_memory_sources_read_meminfo_and_cgroup_v2(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:  24000000 kB\nMemFree: 100 kB\nMemAvailable:  2000000 kB\n")
    assert _meminfo_available(str(tmp_path / "meminfo")) == 2_000_000 * 1024
    assert _meminfo_available(str(tmp_path / "missing")) is None
    (tmp_path / "memory.max").write_text("4294967296\n")
    (tmp_path / "memory.current").write_text("1073741824\n")
    assert _cgroup_available(str(tmp_path)) == 3 * GiB
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_available(str(tmp_path)) is None


def test_a_rank_sizes_its_pool_from_free_memory_and_logs_why(tiny_model_dir, caplog):
    from tests.support.worker_driver import rank_token_file
    from worker_svc.config import WorkerConfig
    from worker_svc.runner import ModelRunner

    caplog.set_level("INFO", logger="worker_svc.runner")
    config = WorkerConfig(model=str(tiny_model_dir), kv_cache_max_bytes=1 << 20, shared_token_file=rank_token_file())
    assert config.kv_blocks == 0  # the default: sized from memory
    runner = ModelRunner(config)
    assert runner.pool.num_blocks == (1 << 20) // 16384 and runner.pool.nbytes == 1 << 20
    (record,) = [r for r in caplog.records if r.getMessage() == "KV pool sized"]
    assert (record.kv_blocks, record.kv_pool_bytes, record.block_bytes) == (64, 1 << 20, 16384)
    assert "capped by --kv-cache-max-bytes=1048576" in record.why
