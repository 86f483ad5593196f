"""The attention backends (worker_svc/attention_backends.py): selection by device and flag, and the ``sdpa``
backend — its torch-SDPA path and its varlen path (driven on CPU through a reference function of flash-attn's
signature) — against the CPU backend on random pools with fragmented block tables and decode batches of mixed
context lengths; then the rank's tokens against plain transformers with the ``sdpa`` backend in place."""

from __future__ import annotations

import pytest
import torch

from tests.support.worker_driver import MiniScheduler, noise_image, oracle
from tests.worker.test_oracle import assert_matches, two_image_prompt
from worker_svc import attention_backends, kv_pool, varlen_attention
from worker_svc.config import WorkerConfig

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
# (block table, computed, end): a prefill chunk after a prefix on consecutive blocks, a fresh prefill on out-of-order
# blocks, decodes of contexts 9, 10 and 12 on fragmented tables (one padded batch), one of 40 (alone), and a decode
# sharing its first blocks with another (a cached prefix)
WINDOWS = [
    ([2, 3, 4], 5, 11),
    ([5, 1, 30], 8, 9),
    ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49], 39, 40),
    ([15, 7], 0, 7),
    ([8, 9, 11], 9, 10),
    ([5, 1, 12], 11, 12),
]


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    """flash-attn's varlen contract in plain torch: q [T, heads, d], k/v [rows, kv_heads, d], each sequence's
    queries aligned to the end of its keys (causal, bottom-right)."""
    assert causal and int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) == max_seqlen_q
    assert int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) == max_seqlen_k
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qa, qb, ka, kb = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]))
        n, context = qb - qa, kb - ka
        keys = k[ka:kb].repeat_interleave(groups, 1).transpose(0, 1)
        values = v[ka:kb].repeat_interleave(groups, 1).transpose(0, 1)
        scores = q[qa:qb].transpose(0, 1) @ keys.transpose(-1, -2) * softmax_scale
        allowed = torch.arange(context)[None, :] <= (context - n + torch.arange(n))[:, None]
        out[qa:qb] = (torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ values).transpose(0, 1)
    return out


def _run(backend, seed=0, dtype=torch.float32):
    """One layer of the packed step through ``backend`` on a seeded random pool: (output, pool after writing)."""
    torch.manual_seed(seed)
    pool = kv_pool.KVPool(
        num_layers=2,
        kv_heads=KV_HEADS,
        head_dim=DIM,
        num_blocks=64,
        block_size=BLOCK,
        dtype=dtype,
        device="cpu",
    )
    pool.data.normal_()  # earlier tokens' KV, and values past every context that must not count
    tokens = sum(end - start for _, start, end in WINDOWS)
    q, k, v = torch.randn(HEADS, tokens, DIM), torch.randn(KV_HEADS, tokens, DIM), torch.randn(KV_HEADS, tokens, DIM)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    plan = backend.plan(pool.data, WINDOWS, BLOCK)
    backend.write(plan, 1, k, v)
    return backend.attend(plan, 1, q, 0.3), pool.data


def test_auto_takes_cpu_on_a_cpu_rank_and_sdpa_on_a_cuda_one():
    assert isinstance(attention_backends.select("auto", "cpu"), attention_backends.CpuBackend)
    cuda = attention_backends.select("auto", "cuda", torch.bfloat16)  # chosen by device; nothing runs on it here
    assert isinstance(cuda, varlen_attention.SdpaBackend)
    assert isinstance(attention_backends.select("SDPA", "cpu"), varlen_attention.SdpaBackend)
    assert isinstance(attention_backends.select("cpu", "cuda"), attention_backends.CpuBackend)
    # flash-attn serves only a CUDA rank with a half-precision pool
    assert varlen_attention.flash_varlen(torch.device("cpu"), torch.bfloat16) is None
    assert varlen_attention.flash_varlen(torch.device("cuda"), torch.float32) is None


def test_an_unknown_backend_names_the_setting():
    with pytest.raises(ValueError, match="--attention-backend"):
        attention_backends.select("flash", "cpu")
    with pytest.raises(ValueError, match="attention_backend"):
        WorkerConfig(model="m", attention_backend="flash", insecure_allow_unauthenticated=True)


@pytest.mark.parametrize("varlen", [None, reference_varlen], ids=["sdpa", "varlen"])
def test_sdpa_backend_agrees_with_the_cpu_backend(varlen):
    want, want_pool = _run(attention_backends.CpuBackend())
    got, got_pool = _run(varlen_attention.SdpaBackend(varlen))
    assert torch.equal(got_pool, want_pool)  # the same slots written
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_plans_cover_a_decode_batch_of_mixed_contexts_and_fragmented_tables():
    pool = torch.zeros(1, 2, KV_HEADS, 64, BLOCK, DIM)
    plan = varlen_attention.SdpaBackend(reference_varlen).plan(pool, WINDOWS, BLOCK)
    (batch,) = plan.paged.batches  # the SDPA path's padded decode batch: contexts 12, 10, 9
    assert batch.width == 12 and batch.bias is not None and torch.isinf(batch.window_bias).sum() == 2 + 3
    assert plan.cu_q.tolist() == [0, 6, 7, 8, 15, 16, 17] and plan.cu_k.tolist() == [0, 11, 20, 60, 67, 77, 89]
    assert (plan.max_q, plan.max_k) == (7, 40)
    # the second window's rows follow its table across three runs of blocks
    assert plan.rows[11:20].tolist() == [*range(20, 24), *range(4, 8), 120]


@pytest.mark.parametrize("varlen", [None, reference_varlen], ids=["sdpa", "varlen"])
def test_rank_tokens_match_transformers_with_the_sdpa_backend(worker_env_q2, monkeypatch, varlen):
    runner = worker_env_q2.rank.worker.runner
    backend = varlen_attention.SdpaBackend(varlen)
    plans = []
    monkeypatch.setattr(backend, "plan", lambda *a: plans.append(1) or varlen_attention.SdpaBackend.plan(backend, *a))
    monkeypatch.setattr(runner, "attention", backend)
    stream = worker_env_q2.rank.stream(worker_env_q2.model_dir)
    try:
        sched = MiniScheduler([stream], uses_mrope=runner.uses_mrope)
        prompt = two_image_prompt(worker_env_q2, seed=50)
        other = worker_env_q2.prompt([noise_image(53, 56, 56), "Name the colours you see in the picture."])
        a, b = sched.add(prompt, "whole"), sched.add(other, "chunked", chunk=12)
        sched.run([a, b])  # prefill windows beside decodes of unequal contexts in one forward
        assert_matches(a, oracle(worker_env_q2.model, prompt))
        assert_matches(b, oracle(worker_env_q2.model, other))
        assert len(plans) >= len(b.outputs)  # every step went through this backend
    finally:
        stream.close()


@pytest.mark.parametrize(
    "backend", [attention_backends.CpuBackend(), varlen_attention.SdpaBackend()], ids=["cpu", "sdpa"]
)
def test_a_half_precision_pool_gets_masks_of_its_own_dtype(backend):
    # CUDA's SDPA takes a float mask only in the query's dtype: a bfloat16 rank must not get float32 masks
    plan = backend.plan(torch.zeros(1, 2, KV_HEADS, 64, BLOCK, DIM, dtype=torch.bfloat16), WINDOWS, BLOCK)
    paged = getattr(plan, "paged", plan)
    masks = [s.mask for s in paged.singles if s.mask is not None] + [b.bias for b in paged.batches]
    assert len(masks) == 2 and {m.dtype for m in masks} == {torch.bfloat16}
    want, _ = _run(attention_backends.CpuBackend())
    got, _ = _run(backend, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)
