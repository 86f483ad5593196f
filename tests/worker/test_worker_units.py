"""Pure units of the worker: configuration, KV pool, sampling, payload assembly and caches, the epoch rule."""

from __future__ import annotations

import random

import pytest
import torch

from common import codec
from common.ids import ItemId
from mmcast.v1 import worker_pb2
from tests.support.worker_driver import rank_token_file
from worker_svc import kv_pool, paged_attention
from worker_svc.caches import EncoderCache, FrameError, PayloadAssembler, PayloadCache
from worker_svc.config import WorkerConfig, load_config
from worker_svc.handshake import EpochGate, HandshakeRejected
from worker_svc.sampling import RowSampling, draw_seed, sample

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
        ({"kv_blocks": -1}, "kv_blocks=-1"),
        ({"kv_cache_memory_fraction": 0.0}, "kv_cache_memory_fraction=0.0"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction=1.5"),
        ({"kv_cache_max_bytes": -1}, "kv_cache_max_bytes=-1"),
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


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--insecure-allow-unauthenticated"], {}), ([], {"MMCAST_INSECURE_ALLOW_UNAUTHENTICATED": "true"})],
)
def test_the_insecure_flag_must_be_explicit(argv, env):
    assert load_config(["--model", "/m", *argv], env).insecure_allow_unauthenticated
    with pytest.raises(ValueError, match="MMCAST_INSECURE_ALLOW_UNAUTHENTICATED='maybe'"):
        load_config(["--model", "/m"], {"MMCAST_INSECURE_ALLOW_UNAUTHENTICATED": "maybe"})


def test_a_step_socket_is_an_absolute_path_and_needs_the_token(tmp_path):
    token = rank_token_file()
    path = str(tmp_path / "rank0.sock")
    assert WorkerConfig(model="/m", shared_token_file=token, step_socket=path).step_socket == path
    with pytest.raises(ValueError, match="step_socket='rank0.sock' \\(--step-socket\\): must be an absolute path"):
        WorkerConfig(model="/m", shared_token_file=token, step_socket="rank0.sock")
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ValueError, match="--step-socket\\) needs --shared-token-file"):  # mutual TLS alone: no
        WorkerConfig(model="/m", tls_client_ca_file=str(ca), tls_cert_file=str(ca), tls_key_file=str(ca),
                     step_socket=path)  # fmt: skip


def test_bind_hosts_are_hosts_without_ports():
    token = rank_token_file()
    assert WorkerConfig(model="/m", shared_token_file=token, metrics_host="127.0.0.1", dist_bind_host="::1")
    for name in ("metrics_host", "dist_bind_host"):
        with pytest.raises(ValueError, match=f"{name}='127.0.0.1 9' "):
            WorkerConfig(model="/m", shared_token_file=token, **{name: "127.0.0.1 9"})


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="MMCAST_KV_BLOCKS='many'"):
        load_config(
            [], {"MMCAST_MODEL": "/m", "MMCAST_KV_BLOCKS": "many", "MMCAST_SHARED_TOKEN_FILE": rank_token_file()}
        )


# --- KV pool ---------------------------------------------------------------------------------------------------


def test_block_runs_merge_consecutive_blocks_and_stop_at_the_context():
    assert paged_attention.block_runs([3, 4, 5, 9, 10, 2], 21, 4) == ((12, 12), (36, 8), (8, 1))
    assert paged_attention.block_runs([7], 1, 16) == ((112, 1),)


def _reference_attention(q, keys, values, context, window, scaling):
    """Plain softmax attention over gathered rows with a bottom-right causal mask (one request, all heads)."""
    groups = q.shape[0] // keys.shape[0]
    k = keys.repeat_interleave(groups, 0)
    v = values.repeat_interleave(groups, 0)
    scores = q @ k.transpose(-1, -2) * scaling
    allowed = torch.arange(context)[None, :] <= (context - window + torch.arange(window))[:, None]
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def test_paged_attention_writes_slots_and_reads_fragmented_tables():
    torch.manual_seed(0)
    block, heads, kv_heads, dim = 4, 4, 2, 8
    pool = kv_pool.KVPool(
        num_layers=2,
        kv_heads=kv_heads,
        head_dim=dim,
        num_blocks=16,
        block_size=block,
        dtype=torch.float32,
        device="cpu",
    )
    pool.data.normal_()  # earlier tokens' KV (and garbage past each request's context, which must not be read)
    # (block table, computed, new tokens): a contiguous prefill chunk after a prefix, a decode over three runs, a
    # fresh prefill whose blocks are out of order
    windows = [([2, 3, 4], 5, 6), ([9, 0, 1, 12], 13, 1), ([15, 7], 0, 7)]
    step = paged_attention.plan_step(pool.data, [(ids, a, a + n) for ids, a, n in windows], block)
    assert step.slots.tolist() == [13, 14, 15, 16, 17, 18, 49, 60, 61, 62, 63, 28, 29, 30]
    # the contiguous window reads a view; the fragmented ones gather their context rows in table order
    assert step.spans[0].blocks is None
    assert step.spans[1].blocks.tolist() == [9, 0, 1, 12] and step.spans[2].blocks.tolist() == [15, 7]
    # a chunk after a computed prefix has its causal bias; a fresh prefill is causal from its first key
    assert step.spans[0].mask.shape == (6, 11) and step.spans[2].mask is None
    tokens = sum(n for *_, n in windows)
    q, k, v = (
        torch.randn(1, heads, tokens, dim),
        torch.randn(1, kv_heads, tokens, dim),
        torch.randn(1, kv_heads, tokens, dim),
    )
    module = torch.nn.Module()
    module.layer_idx = 1
    out, _ = paged_attention.paged_attention(module, q, k, v, None, scaling=0.3, paged_step=step)
    assert torch.equal(pool.rows(1, 0)[:, step.slots], k[0]) and torch.equal(pool.rows(1, 1)[:, step.slots], v[0])
    for (ids, computed, n), span in zip(windows, step.spans, strict=True):
        rows = torch.cat([torch.arange(b * block, b * block + block) for b in ids])[: computed + n]
        want = _reference_attention(
            q[0, :, span.start : span.end], pool.rows(1, 0)[:, rows], pool.rows(1, 1)[:, rows], computed + n, n, 0.3
        )
        torch.testing.assert_close(out[0, span.start : span.end].transpose(0, 1), want, atol=1e-5, rtol=1e-5)


def _random_pool(num_blocks: int, block: int) -> kv_pool.KVPool:
    """One layer's pool of 2 KV heads of width 8, every row random (as earlier tokens' KV, or garbage)."""
    pool = kv_pool.KVPool(
        num_layers=1, kv_heads=2, head_dim=8, num_blocks=num_blocks, block_size=block, dtype=torch.float32,
        device="cpu",
    )  # fmt: skip
    pool.data.normal_()
    return pool


def _attends_as_plain_attention(pool, step, windows, block: int, heads: int) -> None:
    """Layer 0 of ``step`` over random queries and the windows' new keys: every window's output equals plain
    attention over the rows its table names, in order, up to its context."""
    kv_heads, dim = pool.data.shape[2], pool.data.shape[-1]
    tokens = sum(b - a for _, a, b in windows)
    q, k, v = (torch.randn(1, heads, tokens, dim), torch.randn(1, kv_heads, tokens, dim),
               torch.randn(1, kv_heads, tokens, dim))  # fmt: skip
    module = torch.nn.Module()
    module.layer_idx = 0
    out, _ = paged_attention.paged_attention(module, q, k, v, None, scaling=0.3, paged_step=step)
    for (ids, computed, end), span in zip(windows, step.spans, strict=True):
        rows = torch.cat([torch.arange(b * block, b * block + block) for b in ids])[:end]
        want = _reference_attention(
            q[0, :, span.start : span.end], pool.rows(0, 0)[:, rows], pool.rows(0, 1)[:, rows], end, end - computed,
            0.3,
        )  # fmt: skip
        torch.testing.assert_close(out[0, span.start : span.end].transpose(0, 1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("small_plan", [paged_attention.SMALL_PLAN, 0], ids=["lists", "numpy"])
def test_decode_windows_attend_in_padded_batches_that_read_only_their_own_rows(monkeypatch, small_plan):
    monkeypatch.setattr(paged_attention, "SMALL_PLAN", small_plan)  # the plan's index tensors built either way
    torch.manual_seed(1)
    block, heads, kv_heads, dim = 4, 4, 2, 8
    pool = kv_pool.KVPool(
        num_layers=1,
        kv_heads=kv_heads,
        head_dim=dim,
        num_blocks=64,
        block_size=block,
        dtype=torch.float32,
        device="cpu",
    )
    pool.data.normal_()
    # decodes of contexts 9, 10, 12 (fragmented tables, one batch padded to 12), one of 40 (too long to pad the
    # others to: a batch of its own, attended alone), a prefill chunk between them, and a decode that shares its
    # first blocks with another (a cached prefix)
    windows = [
        ([5, 1, 30], 8, 9),
        ([20, 21, 22, 23, 24, 25, 26, 27, 28, 29], 39, 40),
        ([2, 3], 0, 6),
        ([7, 9, 11], 9, 10),
        ([5, 1, 12], 11, 12),
    ]
    step = paged_attention.plan_step(pool.data, [(ids, a, b) for ids, a, b in windows], block)
    (batch,) = step.batches
    assert batch.width == 12 and batch.tokens.tolist() == [0, 8, 9] and not batch.whole  # in packed order
    assert {s.start for s in step.singles} == {1, 2}  # the long decode alone, and the chunk
    assert batch.bias is not None and torch.isinf(batch.window_bias).sum() == (12 - 9) + (12 - 10)
    assert torch.equal(batch.bias, batch.window_bias.repeat(pool.data.shape[2], 1, 1))  # the same for every KV head
    # whole blocks of the window's own table, padded with its last block: no other request's keys
    blocks = batch.blocks.view(3, 3)
    for i, (ids, _, context) in enumerate(w for w in windows if w[2] - w[1] == 1 and w[2] < 40):
        own = ids[: -(-context // block)]
        assert blocks[i].tolist() == own + [own[-1]] * (3 - len(own))
    tokens = sum(b - a for _, a, b in windows)
    q, k, v = (
        torch.randn(1, heads, tokens, dim),
        torch.randn(1, kv_heads, tokens, dim),
        torch.randn(1, kv_heads, tokens, dim),
    )
    module = torch.nn.Module()
    module.layer_idx = 0
    out, _ = paged_attention.paged_attention(module, q, k, v, None, scaling=0.3, paged_step=step)
    for (ids, computed, end), span in zip(windows, step.spans, strict=True):
        rows = torch.cat([torch.arange(b * block, b * block + block) for b in ids])[:end]
        n = end - computed
        want = _reference_attention(
            q[0, :, span.start : span.end], pool.rows(0, 0)[:, rows], pool.rows(0, 1)[:, rows], end, n, 0.3
        )
        torch.testing.assert_close(out[0, span.start : span.end].transpose(0, 1), want, atol=1e-5, rtol=1e-5)


def test_a_step_of_decodes_alone_is_one_batch_attended_in_place():
    """Every token of the step a decode of one batch: the queries are read and the answer written in packed order
    without a gather or a scatter, and each window still sees only its own keys."""
    torch.manual_seed(2)
    block, heads, kv_heads, dim = 4, 4, 2, 8
    pool = kv_pool.KVPool(
        num_layers=1, kv_heads=kv_heads, head_dim=dim, num_blocks=64, block_size=block, dtype=torch.float32,
        device="cpu",
    )  # fmt: skip
    pool.data.normal_()
    windows = [([7, 9, 11], 9, 10), ([5, 1, 30], 8, 9), ([5, 1, 12], 11, 12), ([40, 3, 44], 10, 11)]  # not by context
    step = paged_attention.plan_step(pool.data, windows, block)
    (batch,) = step.batches
    assert batch.whole and not step.singles and batch.tokens.tolist() == [0, 1, 2, 3]
    q, k, v = torch.randn(1, heads, 4, dim), torch.randn(1, kv_heads, 4, dim), torch.randn(1, kv_heads, 4, dim)
    module = torch.nn.Module()
    module.layer_idx = 0
    out, _ = paged_attention.paged_attention(module, q, k, v, None, scaling=0.3, paged_step=step)
    assert out.shape == (1, 4, heads, dim)
    for t, (ids, computed, end) in enumerate(windows):
        rows = torch.cat([torch.arange(b * block, b * block + block) for b in ids])[:end]
        want = _reference_attention(
            q[0, :, t : t + 1], pool.rows(0, 0)[:, rows], pool.rows(0, 1)[:, rows], end, end - computed, 0.3
        )
        torch.testing.assert_close(out[0, t : t + 1].transpose(0, 1), want, atol=1e-5, rtol=1e-5)


def test_a_decode_batch_is_the_same_built_in_lists_or_in_numpy(monkeypatch):
    """Small plans are built in Python lists (numpy's first calls in a step are slow on a rank), larger ones in
    numpy: both give the same tensors, of the same dtypes."""
    rng = random.Random(7)
    pool = torch.zeros(1, 2, 3, 500, 16, 8)
    for n in (2, 5, 9):
        group = [(i, rng.sample(range(500), 6), rng.randint(60, 96)) for i in range(n)]
        group.sort(key=lambda e: -e[2])
        built = []
        for small in (10**6, 0):
            monkeypatch.setattr(paged_attention, "SMALL_PLAN", small)
            built.append(paged_attention._decode_batch(group, pool, 16))
        lists, arrays = built
        assert lists.width == arrays.width
        for field in ("tokens", "blocks", "index", "bias"):
            a, b = getattr(lists, field), getattr(arrays, field)
            assert a.dtype == b.dtype and torch.equal(a, b), field


def test_short_decodes_of_one_run_read_a_view_and_only_fragmented_ones_are_gathered():
    torch.manual_seed(3)
    block, heads = 4, 4
    pool = _random_pool(num_blocks=64, block=block)  # rows past each context: finite garbage a view must not read
    windows = [
        ([8, 9, 10], 9, 10),  # one run: rows 32..41 of the pool, read as a view
        ([20, 21, 22, 23], 12, 13),  # one run ending in a whole block
        ([30, 31, 40], 10, 11),  # its last block elsewhere: gathered in a batch
        ([50, 52], 6, 7),  # two runs: batched with the one above
        ([44, 45, 46, 47, 60], 15, 16),  # one run up to its context; the table's spare block is not read
        ([2, 3], 0, 6),  # a prefill chunk between them
    ]
    step = paged_attention.plan_step(pool.data, [(ids, a, b) for ids, a, b in windows], block)
    by_start = {s.start: s for s in step.singles}
    assert by_start[0].runs == ((32, 10),) and by_start[0].blocks is None and by_start[0].mask is None
    assert by_start[1].runs == ((80, 13),) and by_start[1].blocks is None
    assert by_start[4].runs == ((176, 16),) and by_start[4].blocks is None
    (batch,) = step.batches
    assert sorted(batch.tokens.tolist()) == [2, 3]  # the fragmented pair, padded to 11 rows in one call
    _attends_as_plain_attention(pool, step, windows, block, heads)


def test_long_decodes_read_their_runs_of_blocks_in_place_and_fragmented_ones_in_a_batch(monkeypatch):
    monkeypatch.setattr(paged_attention, "VIEW_MIN_CONTEXT", 256)  # small tables; the rule is the same
    torch.manual_seed(2)
    block, heads = 16, 4
    pool = _random_pool(num_blocks=160, block=block)
    long = 256 + 44  # 300 tokens: 19 blocks, the last one 12 rows
    windows = [
        (list(range(3, 22)), long - 1, long),  # one run: a view of rows 48..347
        # runs of 10 blocks, 1, and 8 (its last partial): two views and one gathered block between them
        ([*range(30, 40), 70, *range(41, 49)], long - 1, long),
        ([*range(100, 119)][::-1], long - 2, long - 1),  # no two blocks adjacent in order: batched
        ([*range(120, 139)][::-1], long - 1, long),  # as above, batched with it
        (list(range(75, 92)), 256, 257),  # one run at the threshold: a view
        # 64 + 160 rows in place, the last run (3 blocks, 33 rows: shorter than VIEW_MIN_RUN) gathered
        ([50, 51, 52, 53, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 71, 72, 73], 256, 257),
        ([0, 1], 19, 20),  # short: alone in its batch, so attended alone over its one run
        (list(range(140, 160)), 290, 303),
    ]
    step = paged_attention.plan_step(pool.data, [(ids, a, b) for ids, a, b in windows], block)
    by_start = {s.start: s for s in step.singles}
    # each: its prefix's long runs as views, the short ones gathered, its own key at its slot
    assert by_start[0].views == ((48, long - 1),) and by_start[0].blocks is None
    assert by_start[0].own.tolist() == [48 + long - 1]
    assert by_start[1].views == ((480, 160), (656, 123)) and by_start[1].blocks.tolist() == [70]
    assert by_start[1].rest == 16
    assert by_start[4].views == ((1200, 256),) and by_start[4].blocks is None
    assert by_start[5].views == ((800, 64), (960, 160)) and by_start[5].blocks.tolist() == [71, 72]
    assert by_start[5].rest == 256 - 224
    # 13 new tokens after 290 (a question after cached images): the prefix in place, its own keys causal
    assert by_start[7].views == ((2240, 290),) and by_start[7].own.tolist() == list(range(2530, 2543))
    assert by_start[7].mask.shape == (13, 13) and by_start[7].end == 20
    (batch,) = step.batches
    assert sorted(batch.tokens.tolist()) == [2, 3]
    _attends_as_plain_attention(pool, step, windows, block, heads)


# --- sampling --------------------------------------------------------------------------------------------------


def test_greedy_and_logprobs_of_the_unmodified_distribution():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    s = sample(logits, RowSampling(temperature=0.0, return_logprobs=True, logprobs=2), index=0)
    assert s.token_id == 1
    assert s.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
    assert [t for t, _ in s.top_logprobs] == [1, 3]
    assert sample(logits, RowSampling(), 0).logprob is None


def test_draws_repeat_per_seed_and_index_and_top_p_cuts_the_tail():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = RowSampling(temperature=1.0, seed=7)
    first = [sample(logits, params, i).token_id for i in range(20)]
    assert first == [sample(logits, params, i).token_id for i in range(20)]
    assert len(set(first)) > 1 and draw_seed(7, 0) != draw_seed(7, 1) != draw_seed(8, 1)
    top = int(torch.argmax(logits))
    assert {sample(logits, RowSampling(temperature=1.0, top_p=1e-6, seed=s), 0).token_id for s in range(20)} == {top}


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


# --- patch embedding ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_a_patch_convolution_is_one_product_and_other_inputs_keep_the_convolution(bias):
    from worker_svc.patch_conv import swap_patch_convolutions

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), bias=bias),  # Qwen-VL's patch embedding
        torch.nn.Conv2d(3, 8, 3, stride=1, padding=1),  # a stride below the kernel: not a patch embedding
    )
    patches, image, whole = torch.randn(5, 3, 2, 4, 4), torch.randn(1, 3, 6, 6), torch.randn(1, 3, 4, 8, 8)
    reference = [model[0](patches), model[1](image), model[0](whole)]
    assert swap_patch_convolutions(model) == 1 and "forward" in vars(model[0]) and "forward" not in vars(model[1])
    got = model[0](patches)
    assert got.shape == (5, 8, 1, 1, 1)
    torch.testing.assert_close(got, reference[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model[1](image), reference[1])
    torch.testing.assert_close(model[0](whole), reference[2])  # several patches in one input: the convolution
    assert swap_patch_convolutions(model) == 0  # idempotent
