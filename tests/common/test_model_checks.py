"""The config.json rule (common/model_checks.py) shared by serve-local, the scheduler and the ranks, and the
start-up-failure exit the processes use when it rejects a checkpoint (common/process.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common import model_checks
from common.model_checks import DecoderShape, ModelConfigError, check_checkpoint, check_serveable, check_tp
from common.process import EXIT_STARTUP_FAILURE, startup_failure_cause
from common.tiny_model import build_config

# Decoder widths of real checkpoints, in the Hub layout (text fields at the top level of config.json).
REAL = {
    "Qwen2-VL-2B": ("qwen2_vl", 12, 2, 8960, [1, 2, 4]),
    "Qwen2-VL-7B": ("qwen2_vl", 28, 4, 18944, [1, 2, 4]),
    "Qwen2.5-VL-3B": ("qwen2_5_vl", 16, 2, 11008, [1, 2, 4, 8, 16]),
    "Qwen2.5-VL-7B": ("qwen2_5_vl", 28, 4, 18944, [1, 2, 4]),
}


def hub_config(model_type: str, heads: int, kv_heads: int, intermediate: int) -> dict:
    return {
        "model_type": model_type,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "vision_config": {"depth": 32},
    }


@pytest.mark.parametrize("name", sorted(REAL))
def test_valid_tp_sizes_of_real_checkpoints(name):
    model_type, heads, kv_heads, intermediate, valid = REAL[name]
    config = hub_config(model_type, heads, kv_heads, intermediate)
    assert DecoderShape.from_config(config).valid_tp_sizes() == valid
    check_serveable(config)
    for tp in valid:
        check_tp(config, tp, "--tp")


def test_qwen2_vl_2b_at_tp4_replicates_each_kv_head_on_two_ranks():
    shape = check_tp(hub_config("qwen2_vl", 12, 2, 8960), 4, "--tp")
    assert shape.kv_heads_local(4) == 1 and shape.kv_replicas(4) == 2
    assert [list(shape.kv_heads_of_rank(4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(shape.kv_heads_of_rank(2, r)) for r in range(2)] == [[0], [1]]  # no replication at TP=2


@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (8, 2), (8, 4), (8, 8), (12, 2), (16, 2), (28, 4), (24, 3)])
def test_every_rank_holds_the_kv_heads_its_query_heads_read(heads, kv_heads):
    """Query head q reads KV head q // (heads / kv_heads) (grouped-query attention); rank r holds query heads
    [r * heads / tp, (r + 1) * heads / tp). For every valid TP size, those KV heads are the rank's, and together
    the ranks hold every KV head."""
    shape = DecoderShape(heads, kv_heads, None)
    group = heads // kv_heads
    for tp in shape.valid_tp_sizes():
        held = set()
        for rank in range(tp):
            mine = shape.kv_heads_of_rank(tp, rank)
            assert len(mine) == shape.kv_heads_local(tp)
            queries = range(rank * heads // tp, (rank + 1) * heads // tp)
            assert {q // group for q in queries} == set(mine), (tp, rank)
            # the rank's local query heads map onto its local KV heads in order, as the attention repeats them
            assert [q // group - mine.start for q in queries] == [
                i // (len(queries) // len(mine)) for i in range(len(queries))
            ]
            held |= set(mine)
        assert held == set(range(kv_heads))


def test_tp_message_names_the_flag_and_the_valid_values():
    config = hub_config("qwen2_vl", 12, 2, 8960)
    with pytest.raises(ModelConfigError) as info:
        check_tp(config, 3, "--tp")
    message = str(info.value)
    assert message.startswith("--tp 3: ") and "2 KV heads" in message
    assert message.endswith("valid --tp values for this checkpoint: 1, 2, 4") and "\n" not in message
    with pytest.raises(ModelConfigError, match=r"^--world-size 8: .*12 attention heads.*--world-size values"):
        check_tp(config, 8, "--world-size")
    with pytest.raises(ModelConfigError, match=r"^--workers lists 6 rank\(s\): .*intermediate_size=8960"):
        check_tp(config, 6, "--workers", given="--workers lists 6 rank(s)", values="--workers counts")


def test_the_text_config_layout_of_transformers_5_reads_the_same():
    tiny = build_config("qwen2_vl", kv_heads=2)
    as_dict = json.loads(tiny.to_json_string())
    assert "num_attention_heads" in as_dict["text_config"]
    assert DecoderShape.from_config(as_dict) == DecoderShape.from_config(tiny) == DecoderShape(8, 2, 256)
    assert DecoderShape.from_config(as_dict).valid_tp_sizes() == [1, 2, 4, 8]
    no_kv = hub_config("qwen2_vl", 12, 2, 8960)
    del no_kv["num_key_value_heads"]
    assert DecoderShape.from_config(no_kv).kv_heads == 12  # transformers' reading: one KV head per query head


def test_unsupported_or_incomplete_checkpoints_are_refused(tmp_path):
    with pytest.raises(ModelConfigError, match=r"model type 'llama' is not supported; mmcast serves qwen2_vl"):
        check_serveable({"model_type": "llama", "vision_config": {}})
    with pytest.raises(ModelConfigError, match=r"no vision_config"):
        check_serveable({"model_type": "qwen2_vl"})
    with pytest.raises(ModelConfigError, match=r"not a model folder \(no config.json\)"):
        check_checkpoint(tmp_path, 1, "--tp")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"cannot read config.json"):
        check_checkpoint(tmp_path, 1, "--tp")
    with pytest.raises(ModelConfigError, match=r"num_key_value_heads=3 must divide num_attention_heads=8"):
        DecoderShape.from_config(hub_config("qwen2_vl", 8, 3, 256))
    assert issubclass(ModelConfigError, ValueError)
    assert model_checks.SUPPORTED_MODEL_TYPES == ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")


def test_startup_failure_cause_reads_the_marked_record_or_the_argparse_line():
    log = "\n".join(
        [
            json.dumps({"level": "info", "msg": "listening"}),
            json.dumps({"level": "critical", "msg": "older cause", "startup_failure": True}),
            "not json {",
            json.dumps({"level": "critical", "msg": "--tp 3: the cause", "startup_failure": True}),
            json.dumps({"level": "info", "msg": "after"}),
        ]
    )
    assert startup_failure_cause(log) == "--tp 3: the cause"
    assert startup_failure_cause("usage: x\nmmcast-worker: error: argument --rank: invalid int value") == (
        "mmcast-worker: error: argument --rank: invalid int value"
    )
    assert startup_failure_cause(json.dumps({"level": "critical", "msg": "crash"})) is None


@pytest.fixture(scope="module")
def kv2_config_dir(tmp_path_factory):
    """A folder holding only the config.json of the tiny model with 2 KV heads: all the checks read."""
    path = tmp_path_factory.mktemp("kv2-config")
    build_config("qwen2_vl", kv_heads=2).save_pretrained(path)
    return path


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MMCAST_ALLOCATOR_ENV_SET="0")
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60, env=env)


def last_record(stderr: str) -> dict:
    return json.loads([line for line in stderr.splitlines() if line.startswith("{")][-1])


def test_a_rank_refuses_a_world_size_the_checkpoint_cannot_shard(kv2_config_dir, tmp_path):
    done = run(
        "worker_svc.main", "--rank", "1", "--world-size", "3", "--listen", "127.0.0.1:0",
        "--dist-init", "tcp://127.0.0.1:1", "--model", str(kv2_config_dir), "--insecure-allow-unauthenticated",
    )  # fmt: skip
    assert done.returncode == EXIT_STARTUP_FAILURE, done.stderr
    record = last_record(done.stderr)
    assert record["startup_failure"] is True and record["rank"] == 1
    assert record["msg"].startswith("--world-size 3: ") and record["msg"].endswith("1, 2, 4, 8")
    assert "model loaded" not in done.stderr and "listening" not in done.stderr  # before any port or weight


def test_the_scheduler_refuses_a_number_of_workers_the_checkpoint_cannot_shard(kv2_config_dir):
    done = run("scheduler_svc.main", "--model", str(kv2_config_dir), "--workers", "a:1,b:2,c:3")
    assert done.returncode == EXIT_STARTUP_FAILURE, done.stderr
    assert last_record(done.stderr)["msg"] == (
        "--workers lists 3 rank(s): this checkpoint cannot be split over 3 tensor-parallel ranks: its 8 attention "
        "heads do not divide into 3 equal parts; valid --workers counts for this checkpoint: 1, 2, 4, 8"
    )


def test_serve_local_refuses_a_tp_size_at_once_in_one_line(kv2_config_dir, capsys):
    from mmcast_client import cli

    assert cli.main(["serve-local", "--model", str(kv2_config_dir), "--tp", "3", "--port", "0"]) == (
        EXIT_STARTUP_FAILURE
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --tp 3: this checkpoint cannot be split over 3 tensor-parallel ranks: its 8 attention heads do not "
        "divide into 3 equal parts; valid --tp values for this checkpoint: 1, 2, 4, 8"
    ]
