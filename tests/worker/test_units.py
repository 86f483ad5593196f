"""Pure units of the worker: configuration, KV pool, sampling, payload assembly and caches, the epoch rule."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2VLConfig

from common import codec
from common.ids import ItemId
from mmcast.v1 import worker_pb2
from tests.support.worker_driver import rank_token_file
from worker_svc import kv_pool
from worker_svc.caches import EncoderCache, FrameError, PayloadAssembler, PayloadCache
from worker_svc.config import WorkerConfig, load_config
from worker_svc.handshake import EpochGate, HandshakeRejected
from worker_svc.sampling import SamplingParams, draw_seed, sample

# --- configuration ---------------------------------------------------------------------------------------------


def test_flags_override_environment_which_overrides_defaults():
    env = {
        "MMCAST_MODEL": "/m",
        "MMCAST_KV_BLOCKS": "64",
        "MMCAST_RANK": "1",
        "MMCAST_WORLD_SIZE": "2",
        "MMCAST_DIST_INIT": "tcp://h:1",
        "MMCAST_GROUP_TIMEOUT_SECONDS": "7.5",
        "MMCAST_SHARED_TOKEN_FILE": rank_token_file(),
    }
    config = load_config(["--kv-blocks", "32"], env)
    assert (config.model, config.kv_blocks, config.rank, config.world_size) == ("/m", 32, 1, 2)
    assert config.group_timeout_seconds == 7.5 and config.device == "auto"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"rank": 2, "world_size": 2, "dist_init": "tcp://h:1"}, "rank=2 (--rank): must be in [0, 1]"),
        ({"world_size": 2}, "dist_init=''"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"kv_blocks": 0}, "kv_blocks=0"),
        ({"listen": "nowhere"}, "listen='nowhere'"),
        ({"group_timeout_seconds": 0.0}, "group_timeout_seconds=0.0"),
    ],
)
def test_bad_settings_name_setting_value_and_range(kwargs, needle):
    with pytest.raises(ValueError, match="must be") as info:
        WorkerConfig(model="/m", shared_token_file=rank_token_file(), **kwargs)
    assert needle in str(info.value)


def test_a_rank_without_authentication_refuses_to_start_naming_the_flags():
    with pytest.raises(ValueError) as info:
        load_config(["--model", "/m"], {})
    for flag in ("--shared-token-file", "--tls-client-ca-file", "--insecure-allow-unauthenticated"):
        assert flag in str(info.value)


@pytest.mark.parametrize(("argv", "env"), [(["--insecure-allow-unauthenticated"], {}),
                                           ([], {"MMCAST_INSECURE_ALLOW_UNAUTHENTICATED": "true"})])
def test_the_insecure_flag_must_be_explicit(argv, env):
    assert load_config(["--model", "/m", *argv], env).insecure_allow_unauthenticated
    with pytest.raises(ValueError, match="MMCAST_INSECURE_ALLOW_UNAUTHENTICATED='maybe'"):
        load_config(["--model", "/m"], {"MMCAST_INSECURE_ALLOW_UNAUTHENTICATED": "maybe"})


def test_bind_hosts_are_hosts_without_ports():
    token = rank_token_file()
    assert WorkerConfig(model="/m", shared_token_file=token, metrics_host="127.0.0.1", dist_bind_host="::1")
    for name in ("metrics_host", "dist_bind_host"):
        with pytest.raises(ValueError, match=f"{name}='127.0.0.1 9' "):
            WorkerConfig(model="/m", shared_token_file=token, **{name: "127.0.0.1 9"})


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="MMCAST_KV_BLOCKS='many'"):
        load_config([], {"MMCAST_MODEL": "/m", "MMCAST_KV_BLOCKS": "many", "MMCAST_SHARED_TOKEN_FILE": rank_token_file()})


# --- KV pool ---------------------------------------------------------------------------------------------------


def _text_config():
    return Qwen2VLConfig(
        text_config={"num_hidden_layers": 2, "num_key_value_heads": 2, "num_attention_heads": 4, "hidden_size": 32}
    ).get_text_config()


def test_pool_write_then_gather_rebuilds_the_prefix_in_a_live_cache():
    pool = kv_pool.KVPool(
        num_layers=2, kv_heads=2, head_dim=4, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu"
    )
    kv = torch.randn(2, 2, 2, 12, 4)
    pool.write([5, 1, 6], kv)
    prefix = pool.gather([5, 1, 6], 12)
    assert torch.equal(prefix, kv)
    cache = kv_pool.cache_from_prefix(prefix, _text_config())
    assert cache.get_seq_length() == 12
    assert torch.equal(cache.layers[1].values[0], kv[1, 1])
    assert torch.equal(kv_pool.cache_rows(cache, 4, 8), kv[:, :, :, 4:8])
    assert pool.gather([], 0).shape == (2, 2, 2, 0, 4)


def test_padded_batch_cache_left_pads_and_masks():
    config = _text_config()
    short = kv_pool.cache_from_prefix(torch.randn(2, 2, 2, 3, 4), config)
    long = kv_pool.cache_from_prefix(torch.randn(2, 2, 2, 5, 4), config)
    batch, mask = kv_pool.padded_batch_cache([short, long], config)
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert torch.equal(batch.layers[0].keys[0, :, 2:], short.layers[0].keys[0])
    assert batch.layers[0].keys[0, :, :2].abs().sum() == 0
    for layer in batch.layers:  # as the model would: one new row per request
        layer.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))
    kv_pool.append_batch_rows([short, long], batch, 1)
    assert (short.get_seq_length(), long.get_seq_length()) == (4, 6)
    assert torch.equal(short.layers[0].keys[0, :, -1], torch.ones(2, 4))


def test_decode_batches_group_similar_cache_lengths_only():
    from worker_svc.runner import ForwardInput, decode_batches

    config = _text_config()

    def item(length, tokens=1):
        cache = kv_pool.cache_from_prefix(torch.zeros(2, 2, 2, length, 4), config)
        return ForwardInput(cache, [1] * tokens, torch.zeros(3, tokens, dtype=torch.long), [], True)

    items = [item(100), item(5, tokens=7), item(90), item(1000), item(95), item(10)]
    assert decode_batches(items) == [[2, 4, 0]]  # the prefill window, the lone long and the short stay single
    assert decode_batches([item(3), item(4)]) == [[0, 1]] and decode_batches([item(3)]) == []


# --- sampling --------------------------------------------------------------------------------------------------


def test_greedy_and_logprobs_of_the_unmodified_distribution():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    s = sample(logits, SamplingParams(temperature=0.0, return_logprobs=True, logprobs=2), index=0)
    assert s.token_id == 1
    assert s.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
    assert [t for t, _ in s.top] == [1, 3]
    assert sample(logits, SamplingParams(), 0).logprob is None


def test_draws_repeat_per_seed_and_index_and_top_p_cuts_the_tail():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)
    first = [sample(logits, params, i).token_id for i in range(20)]
    assert first == [sample(logits, params, i).token_id for i in range(20)]
    assert len(set(first)) > 1 and draw_seed(7, 0) != draw_seed(7, 1) != draw_seed(8, 1)
    top = int(torch.argmax(logits))
    assert {sample(logits, SamplingParams(temperature=1.0, top_p=1e-6, seed=s), 0).token_id for s in range(20)} == {top}


# --- payload assembly and caches -----------------------------------------------------------------------------


def _frames(ident, name, tensor, chunk_size):
    return [
        worker_pb2.StepRequest.FromString(b).payload
        for b in codec.payload_frames(ident, name, tensor, chunk_size=chunk_size)
    ]


def test_assembler_rebuilds_chunked_fields_and_refuses_interleaving():
    a, b = torch.randn(10, 7), torch.arange(5)
    asm = PayloadAssembler(max_tensor_bytes=1 << 20)
    for frame in _frames("x", "pixel_values", a, 64) + _frames("x", "other", b, 1 << 10):
        asm.add(frame)
    got = asm.take()
    assert torch.equal(got["x"]["pixel_values"], a) and torch.equal(got["x"]["other"], b)
    fa, fb = _frames("x", "pixel_values", a, 64), _frames("y", "pixel_values", a, 64)
    asm.add(fa[0])
    with pytest.raises(FrameError, match="still misses chunks"):
        asm.add(fb[0])
    asm.clear()
    asm.add(fa[0])
    with pytest.raises(FrameError, match="missing chunks"):
        asm.take()


def test_payload_cache_budget_arithmetic_matches_the_merge():
    cache = PayloadCache(budget_bytes=1000)
    cache.merge({ItemId("a"): {"p": torch.zeros(10)}, ItemId("b"): {"p": torch.zeros(20)}})
    assert cache.nbytes == 120
    incoming = {ItemId("b"): {"p": torch.zeros(5)}, ItemId("c"): {"p": torch.zeros(1)}}
    predicted = cache.bytes_after(["a"], incoming, reset=False)
    cache.evict(["a"])
    cache.merge(incoming)
    assert predicted == cache.nbytes == 24 and len(cache) == 2
    assert cache.bytes_after([], incoming, reset=True) == 24
    enc = EncoderCache(budget_tokens=10)
    enc.put(ItemId("a"), torch.zeros(4, 3))
    enc.put(ItemId("a"), torch.zeros(6, 3))
    assert enc.tokens == 6
    enc.evict(["a", "ghost"])
    assert enc.tokens == 0


# --- epochs ----------------------------------------------------------------------------------------------------


def test_epoch_gate():
    gate = EpochGate()
    assert gate.admit(5) is False
    with pytest.raises(HandshakeRejected, match="scheduler_epoch=5 is not newer than the active stream's epoch 5"):
        gate.admit(5)
    assert gate.admit(6) is True  # supersedes
    gate.release(5)  # the superseded stream ending does not free the slot
    with pytest.raises(HandshakeRejected):
        gate.admit(6)
    gate.release(6)
    assert gate.admit(6) is False  # the same scheduler reconnecting
    gate.release(6)
    with pytest.raises(HandshakeRejected, match="older than epoch 6"):
        gate.admit(4)
