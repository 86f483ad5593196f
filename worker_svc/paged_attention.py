"""The CPU attention backend (``worker_svc/attention_backends.py``): the rank's KV block pool read and written in place,
one ragged forward per step.

A step packs every scheduled window (prefill chunks and decode tokens of all requests) into one sequence of batch 1.
Each decoder layer hands the backend the step's new queries, keys and values (rotary already applied); it

1. writes the new keys and values into their pool slots (``slot = block_id * block_size + offset``), and
2. attends the queries to their keys read from the pool through the block tables:

   - **short windows after a long prefix** (decode tokens, the bulk of a loaded step; a new question after cached
     images; at most ``PIECES_MAX_WINDOW`` tokens after at least ``VIEW_MIN_CONTEXT`` of context) whose prefix lies
     mostly in runs of consecutive blocks (a prompt's blocks, a cached conversation's turns) are attended one at a
     time in pieces: those runs read in place as views of the pool (no copy, each key read once, where a gathered
     batch reads its keys three times: to copy, to write the copy, to score it), the blocks of the prefix's
     shorter runs (tokens decoded one block at a time beside other requests) gathered, and the window's own keys
     at their slots, causal among themselves; one softmax covers every piece's scores;
   - **a decode token whose context blocks are one run** of consecutive ids (a conversation's blocks allocated
     together, as a new prompt's are) attends over a view of its pool rows, one SDPA call per layer and request with
     nothing copied: at ~300 tokens of context on the 64-wide checkpoint (one thread) its forward is 10-17 % faster
     than in a gathered batch from 2 to 48 decodes (16: 3.4-3.9 against 3.9-4.5 ms);
   - **other decode tokens** (a cached prefix's blocks and the request's own, one block at a time beside other
     requests) are attended together, one call per
     layer for all of them (two batched matmuls): their context blocks are gathered whole by one ``index_select``
     for keys and one for values (a copy per block, not per row: several times faster) into a batch padded to the
     longest context of the batch rounded up to a block, and a key mask hides the padding. Windows are grouped by
     context length so padding stays under ``PAD_SLACK`` of the rows really read (one request of 8k tokens beside
     300-token ones gets a batch of its own). One call per layer replaces one per request, whose Python and
     dispatch overhead dominated a decode step of a small model (40 decodes: 80 calls per step on a 2-layer model).
     A batch keeps the step's packed order; when it holds every token of the step (a step of decodes alone), its
     queries are read and its answer returned in place, with no gather or scatter;
   - **prefill chunks** (and a decode alone in its batch) are attended one window at a time: a window whose blocks
     are one run of consecutive ids attends over a view of the pool (no copy); one whose table is fragmented (a
     cached prefix and new blocks) has its context blocks gathered by one ``index_select`` per layer for keys and
     one for values (scoring each run apart cost 5-20x a contiguous decode at 64 runs,
     ``benchmarks/rank/paged_attention.py``). Queries of a window attend causally to their own window (bottom-right
     aligned after the computed prefix): without a prefix by SDPA's own causal form, which skips the masked scores;
     after one by an additive mask built once per step, not per layer.

   Nothing is copied back: the gathered rows are read, the pool is only written at the new tokens' slots.

``plan_step`` builds what a step needs once per forward; ``write_kv`` and ``attend`` run per layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

# A decode batch pads every context to its longest: rows gathered may exceed the rows really read by this factor at
# most (a batch is cut where one more window would pass it).
PAD_SLACK = 1.25
# A short window after at least this many tokens of context reads its prefix in place (``_in_place``). Its pieces
# cost ~10 small calls per window and layer, where a decode batch's gather costs a copy per block: at 1k tokens the
# copies dominate (16 decodes on the 2B-width checkpoint: 36 ms a step in pieces against 44-56 ms gathered; the
# 64-wide one's: 4.4 against 10 ms), at ~300 the calls do (a closed loop of 32 requests on one cached image served
# 65-68 requests/s in pieces against 84-96 in batches on a one-thread rank).
VIEW_MIN_CONTEXT = 1024
# Such a decode's runs of at least this many rows are read in place; its shorter runs (a conversation's tokens
# decoded beside others, one block at a time) are gathered. Half its context or more must be in place.
VIEW_MIN_RUN = 64
# A window of up to this many tokens after a prefix (a new question after cached images, a prompt's last block
# recomputed) reads its prefix in place too, with its own keys causal beside it; a longer one is one SDPA call
# over its gathered context, whose fused kernel is the cheaper there.
PIECES_MAX_WINDOW = 64
# A step's plan builds its index tensors (a decode batch's padded tables, gather rows and key bias) in Python lists
# when they hold at most this many entries, in numpy above. numpy's first calls in a step cost the served rank ~100
# µs, its code cold after the forward (a two-decode batch's plan: 124-126 µs in numpy, 38-39 µs in lists, measured
# in the rank during `benchmarks.rank.grammar_cost`'s setting); lists cost ~70 µs per thousand entries, numpy ~5.
SMALL_PLAN = 1024


@dataclasses.dataclass(frozen=True)
class Span:
    """One request's share of the packed step."""

    start: int  # first packed token of the window
    end: int  # one past its last; end - start new tokens, computed after ``context - (end - start)`` older ones
    context: int  # tokens the window's last query attends to (computed prefix + the window)
    runs: tuple[tuple[int, int], ...]  # (first pool row, rows) per run of consecutive blocks; rows sum to context
    blocks: torch.Tensor | None = None  # (ceil(context / block_size),) int64 block ids in order, where several runs
    block_size: int = 0  # the pool's, where ``blocks`` is set
    mask: torch.Tensor | None = None  # (window, context) float: 0 where a query sees a key, -inf elsewhere; only for a
    # window of several queries after a computed prefix (one without a prefix is causal from its first key)
    # A short window attended in pieces (``_in_place``): its computed prefix as these runs (first pool row, rows)
    # read in place and ``blocks`` (when set: the blocks of the prefix's shorter runs in table order) gathered and
    # cut to ``rest`` rows; its own tokens' keys at the pool rows ``own``, causal by ``mask`` when it has several.
    views: tuple[tuple[int, int], ...] = ()
    rest: int = 0
    own: torch.Tensor | None = None
    index: torch.Tensor | None = None  # ``blocks``' rows for ``gather_blocks``, built once per step (``block_index``)


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """Decode windows (one query each) attended in one call, their contexts padded to the longest. ``tokens`` and
    ``blocks`` are tensors made when first read: a batch of a whole step reads neither, and each tensor made in a
    step costs a served rank's decode step several microseconds."""

    token_ids: tuple[int, ...]  # packed index of each window's query, ascending
    table: tuple[int, ...]  # (n * width / block_size) block ids: window i's table cut to its context, then its last
    # block again up to the width (the slots past its context hold zeros or finite KV, hidden by the bias)
    width: int  # rows gathered per window: the longest context of the batch rounded up to whole blocks
    block_size: int  # the pool's
    # (kv_heads * n, 1, width) float: 0 at a window's own keys, -inf past them, for every (KV head, window) pair in
    # the score matrices' order (head-major: rows [0, n) are KV head 0's, ``window_bias``); None if none padded
    bias: torch.Tensor | None
    index: torch.Tensor  # ``blocks``' rows for ``gather_blocks``, built once per step (``block_index``)
    whole: bool = False  # the windows are the step's every token, in packed order: queries and answer in place

    @functools.cached_property
    def tokens(self) -> torch.Tensor:
        """(n,) int64: ``token_ids`` on the pool's device."""
        return _long(list(self.token_ids), self.index.device)

    @functools.cached_property
    def blocks(self) -> torch.Tensor:
        """(n * width / block_size,) int64: ``table`` on the pool's device."""
        return _long(list(self.table), self.index.device)

    @property
    def window_bias(self) -> torch.Tensor | None:
        """(n, 1, width): each window's key bias once."""
        return None if self.bias is None else self.bias[: len(self.token_ids)]


@dataclasses.dataclass(frozen=True)
class PagedStep:
    """The per-step metadata every layer reads; built once per forward by ``plan_step``."""

    pool: torch.Tensor  # the KVPool's data: [layers, 2, kv_heads, num_blocks, block_size, head_dim]
    slots: torch.Tensor  # (tokens,) int64: the pool row (block_id * block_size + offset) of each packed token
    spans: tuple[Span, ...]  # in packing order; spans cover [0, tokens) without gaps
    singles: tuple[Span, ...] = ()  # the spans attended one at a time (the others are in ``batches``)
    batches: tuple[DecodeBatch, ...] = ()  # decode windows attended together, one call per batch and layer


def block_runs(block_ids: Sequence[int], num_tokens: int, block_size: int) -> tuple[tuple[int, int], ...]:
    """The first ``num_tokens`` pool rows of a block table as runs of consecutive rows: (first row, rows)."""
    runs: list[list[int]] = []
    left = num_tokens
    for block in block_ids[: -(-num_tokens // block_size)]:
        rows = min(block_size, left)
        left -= rows
        row = block * block_size
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1][1] += rows
        else:
            runs.append([row, rows])
    return tuple((first, rows) for first, rows in runs)


def _one_run(block_ids: Sequence[int], num_tokens: int, block_size: int) -> bool:
    """Whether the blocks holding a table's first ``num_tokens`` rows are consecutive ids (one run)."""
    count = -(-num_tokens // block_size)
    first = block_ids[0]
    if block_ids[count - 1] != first + count - 1:  # the common refusal, without the loop
        return False
    return all(block_ids[i] == first + i for i in range(1, count - 1))


def _single(block_ids: Sequence[int], start: int, end: int, packed: int, pool: torch.Tensor, block_size: int) -> Span:
    runs = block_runs(block_ids, end, block_size)
    blocks = index = None
    if len(runs) > 1:
        blocks, index = _blocks_and_index(block_ids[: -(-end // block_size)], pool)
    n = end - start
    mask = _causal_bias(end, n, pool.device, pool.dtype) if 1 < n < end else None
    return Span(packed, packed + n, end, runs, blocks, block_size if blocks is not None else 0, mask, index=index)


def _blocks_and_index(block_ids: Sequence[int], pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_ids`` as a tensor, and their rows for ``gather_blocks`` (``_gather_index``)."""
    if len(block_ids) <= SMALL_PLAN:
        return _long(list(block_ids), pool.device), _gather_index(block_ids, pool)
    return torch.from_numpy(np.asarray(block_ids, dtype=np.int64)).to(pool.device), _gather_index(block_ids, pool)


def _gather_index(block_ids: Sequence[int], pool: torch.Tensor) -> torch.Tensor:
    """The rows ``gather_blocks`` selects for ``block_ids`` in the pool's layers (``block_index``): built once per
    step instead of once per layer, in Python lists up to ``SMALL_PLAN`` entries, else in numpy."""
    kv_heads, num_blocks = pool.shape[2], pool.shape[3]
    if kv_heads * len(block_ids) <= SMALL_PLAN:
        return _long([h * num_blocks + b for h in range(kv_heads) for b in block_ids], pool.device)
    ids = np.asarray(block_ids, dtype=np.int64)
    index = (np.arange(0, kv_heads * num_blocks, num_blocks, dtype=np.int64)[:, None] + ids[None, :]).reshape(-1)
    return torch.from_numpy(index).to(pool.device)


def _long(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _in_place(block_ids: Sequence[int], start: int, end: int, packed: int, block_size: int, own: list[int],
              pool: torch.Tensor) -> Span | None:  # fmt: skip
    """The span of a short window (``end - start`` tokens after ``start`` computed ones) read mostly in place: the
    prefix's runs of at least ``VIEW_MIN_RUN`` rows are views, the rest of its blocks are gathered, the window's own
    keys are read at their slots ``own``. None when the views would hold less than half the prefix (a decode batch
    or one gathered window reads it then)."""
    count = -(-start // block_size)
    views, rest_blocks, rest = [], [], 0
    a = 0
    while a < count:  # one run of consecutive blocks per pass; a plain loop, as it runs per decode and step
        first = block_ids[a]
        b = a + 1
        while b < count and block_ids[b] == first + b - a:
            b += 1
        rows = min(b * block_size, start) - a * block_size
        if rows >= VIEW_MIN_RUN:
            views.append((first * block_size, rows))
        else:
            rest_blocks.extend(block_ids[a:b])
            rest += rows
            if 2 * rest > start:  # a fragmented table: known before its end
                return None
        a = b
    n = end - start
    blocks, index = _blocks_and_index(rest_blocks, pool) if rest_blocks else (None, None)
    mask = _causal_bias(n, n, pool.device, pool.dtype) if n > 1 else None
    return Span(packed, packed + n, end, (), blocks, block_size, mask, tuple(views), rest,
                torch.as_tensor(own, dtype=torch.long).to(pool.device), index)  # fmt: skip


def _decode_groups(decodes: list[tuple[int, Sequence[int], int]]) -> list[list[tuple[int, Sequence[int], int]]]:
    """``(packed index, block table, context)`` of decode windows in batches, longest contexts first, each batch
    cut where padding to its longest context would gather more than ``PAD_SLACK`` times the rows really read."""
    groups: list[list] = []
    real = 0
    for entry in sorted(decodes, key=lambda e: -e[2]):
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * group[0][2] <= PAD_SLACK * (real + entry[2]):
            group.append(entry)
            real += entry[2]
        else:
            groups.append([entry])
            real = entry[2]
    return groups


def _decode_batch(group: list[tuple[int, Sequence[int], int]], pool: torch.Tensor, block_size: int) -> DecodeBatch:
    """The batch of ``(packed index, block table, context)`` decode windows: each table cut to its own blocks, then
    padded with its last block up to the longest (the rows past a context are hidden by the bias). The key bias is
    built in Python lists up to ``SMALL_PLAN`` gathered rows, else in numpy."""
    group = sorted(group, key=lambda entry: entry[0])  # packed order: a batch of a whole step reads it in place
    blocks = -(-max(context for _, _, context in group) // block_size)
    width = blocks * block_size
    table: list[int] = []
    for _, ids, context in group:
        count = -(-context // block_size)
        table += ids[:count]
        table += [ids[count - 1]] * (blocks - count)
    contexts = [context for _, _, context in group]
    kv_heads = pool.shape[2]
    bias = None
    if any(context < width for context in contexts):  # in the pool's dtype, as SDPA's masks must be
        if kv_heads * len(group) * width <= SMALL_PLAN:
            rows = [[0.0] * context + [-math.inf] * (width - context) for context in contexts]
            bias = torch.tensor(rows * kv_heads, dtype=pool.dtype, device=pool.device)[:, None, :]
        else:
            own = np.arange(width)[None, :] < np.array(contexts, dtype=np.int64)[:, None]
            rows = np.tile(np.where(own, 0.0, -math.inf).astype(np.float32), (kv_heads, 1))
            bias = torch.from_numpy(rows)[:, None, :].to(pool.device, pool.dtype)
    return DecodeBatch(
        token_ids=tuple(index for index, _, _ in group),
        table=tuple(table),
        width=width,
        block_size=block_size,
        bias=bias,
        index=_gather_index(table, pool),
    )


def plan_step(pool: torch.Tensor, windows: Sequence[tuple[Sequence[int], int, int]], block_size: int) -> PagedStep:
    """The step's slots, spans and decode batches from ``(block_ids, start, end)`` per window, in packing order:
    tokens ``[start, end)`` of a request whose table ``block_ids`` covers at least ``end`` tokens."""
    device = pool.device
    slots: list[int] = []
    spans: list[Span] = []
    singles: list[Span] = []
    decodes: list[tuple[int, Sequence[int], int]] = []
    span_of: dict[int, int] = {}  # a decode's packed index -> its place in ``spans``
    packed = 0
    for block_ids, start, end in windows:
        n = end - start
        # the slots of the window's tokens, in Python ints: a decode's is one multiply, and a chunk's a short loop
        slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
        span = None
        if n <= PIECES_MAX_WINDOW and end >= VIEW_MIN_CONTEXT:
            span = _in_place(block_ids, start, end, packed, block_size, slots[-n:], pool)
        elif n == 1 and _one_run(block_ids, end, block_size):
            span = Span(packed, packed + 1, end, ((block_ids[0] * block_size, end),))
        if span is not None:
            spans.append(span)
            singles.append(span)
        elif n == 1:
            span_of[packed] = len(spans)
            spans.append(Span(packed, packed + 1, end, ()))
            decodes.append((packed, block_ids, end))
        else:
            span = _single(block_ids, start, end, packed, pool, block_size)
            spans.append(span)
            singles.append(span)
        packed += n
    batches: list[DecodeBatch] = []
    for group in _decode_groups(decodes):
        if len(group) == 1:  # alone: its own rows gathered, nothing padded
            index, block_ids, context = group[0]
            span = _single(block_ids, context - 1, context, index, pool, block_size)
            spans[span_of[index]] = span
            singles.append(span)
        else:
            batches.append(_decode_batch(group, pool, block_size))
    if len(batches) == 1 and not singles:  # every token of the step is a decode of one batch (the packed order)
        batches = [dataclasses.replace(batches[0], whole=True)]
    return PagedStep(pool, torch.tensor(slots, dtype=torch.long, device=device), tuple(spans), tuple(singles),
                     tuple(batches))  # fmt: skip


def _causal_bias(context: int, window: int, device, dtype=torch.float32) -> torch.Tensor:
    """(window, context) float: 0 where query ``i`` of a window ending at ``context`` sees key ``j``
    (``j <= context - window + i``), -inf elsewhere. Additive, built once per step: given a bool mask, the CPU's SDPA
    converts it to this form in every call."""
    allowed = (
        torch.arange(context, device=device)[None, :]
        <= (context - window) + torch.arange(window, device=device)[:, None]
    )
    return torch.zeros(window, context, device=device, dtype=dtype).masked_fill_(~allowed, -math.inf)


def block_index(blocks: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """The rows ``gather_blocks`` selects for ``blocks``: block b of head h is row ``h * num_blocks + b`` of the layer
    seen as [kv_heads * num_blocks, block_size * d], head-major. The plan builds it once per step
    (``_blocks_and_index``); built per call, its two small ops cost ~3x the copy itself for a decode's few blocks,
    in every layer."""
    heads = torch.arange(0, kv_heads * num_blocks, num_blocks, device=blocks.device)
    return (heads[:, None] + blocks[None, :]).view(-1)


def gather_blocks(
    layer: torch.Tensor, blocks: torch.Tensor, block_size: int, index: torch.Tensor | None = None
) -> torch.Tensor:
    """[kv_heads, len(blocks) * block_size, d]: the rows of ``blocks`` of a layer's row view, in order (``index``:
    their ``block_index``, when the plan built it). One copy per block and head, not per row (a per-row
    ``index_select`` of 64-float rows ran ~5-20x slower on the same data), selected along the first dimension of the
    layer seen as [kv_heads * num_blocks, block_size * d]: PyTorch's CPU ``index_select`` copies whole rows there,
    ~2.5x faster than the same selection along a middle dimension."""
    kv_heads, rows, dim = layer.shape
    num_blocks = rows // block_size
    if index is None:
        index = block_index(blocks, kv_heads, num_blocks)
    return layer.view(kv_heads * num_blocks, block_size * dim).index_select(0, index).view(kv_heads, -1, dim)


def attend_window(
    q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, span: Span, scaling: float
) -> torch.Tensor:
    """Attention of one window's queries ``q`` ([heads, n, d]) over its pool rows; returns [heads, n, d]."""
    n = q.shape[1]
    if span.own is not None:
        return _attend_pieces(q, k_layer, v_layer, span, scaling)
    if span.blocks is None:
        ((first, rows),) = span.runs
        keys, values = k_layer[:, first : first + rows], v_layer[:, first : first + rows]
    else:
        keys = gather_blocks(k_layer, span.blocks, span.block_size, span.index)[:, : span.context]
        values = gather_blocks(v_layer, span.blocks, span.block_size, span.index)[:, : span.context]
    mask = span.mask
    if mask is None and 1 < n < span.context:  # a span built by hand (the benchmark's): the causal mask now
        mask = _causal_bias(span.context, n, q.device, q.dtype)
    # without a computed prefix the window is causal from its first key: SDPA's own causal form skips the masked
    # half of the scores (~1.6x faster at 1,100 tokens than the same mask given)
    return F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=mask, is_causal=mask is None and n > 1, scale=scaling,
        enable_gqa=q.shape[0] > k_layer.shape[0],
    )[0]  # fmt: skip


def _attend_pieces(
    q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, span: Span, scaling: float
) -> torch.Tensor:
    """A short window's queries ``q`` ([heads, n, d]) over its prefix's view runs and gathered rest and its own
    keys: the scores of every piece, one softmax over them all, the pieces' values weighted and summed; returns
    [heads, n, d]."""
    kv_heads, _, dim = k_layer.shape
    heads, n, _ = q.shape
    group = heads // kv_heads
    # query head h attends with KV head h // group: each KV head's queries as rows of one plain batched matmul (a
    # broadcast batch dimension would copy the keys once per query head)
    grouped = q.reshape(kv_heads, group * n, dim)
    keys = [k_layer[:, first : first + rows] for first, rows in span.views]
    values = [v_layer[:, first : first + rows] for first, rows in span.views]
    if span.blocks is not None:
        keys.append(gather_blocks(k_layer, span.blocks, span.block_size, span.index)[:, : span.rest])
        values.append(gather_blocks(v_layer, span.blocks, span.block_size, span.index)[:, : span.rest])
    keys.append(k_layer.index_select(1, span.own))
    values.append(v_layer.index_select(1, span.own))
    scores = [torch.matmul(grouped, k.transpose(-1, -2)).mul_(scaling) for k in keys]  # [kv_heads, group * n, rows]
    if span.mask is not None:
        scores[-1] = (scores[-1].view(kv_heads, group, n, n) + span.mask).view(kv_heads, group * n, n)
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out, offset = None, 0
    for v in values:
        part = torch.matmul(probs[..., offset : offset + v.shape[1]], v)
        offset += v.shape[1]
        out = part if out is None else out.add_(part)
    return out.reshape(heads, n, dim)


# the name benchmarks/rank/paged_attention.py calls in this tree and in a baseline checkout's
_attend = attend_window


def _attend_batch(
    query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: DecodeBatch, scaling: float
) -> torch.Tensor:
    """Attention of a decode batch: ``query`` [heads, tokens, d] of the packed step; returns [n, heads, d].

    Two batched matmuls over the gathered rows kept in the pool's head-major order (a batch of KV head x window
    pairs, [kv_heads * n, width, d], contiguous), each KV head's group of query heads beside it: on a CPU this beats
    ``scaled_dot_product_attention`` on the same rows (~1.5x at 40 decodes of 300 tokens), whose one-query kernel is
    bound by its per-row setup. The scores are scaled and biased inside the first (``baddbmm``), with the same
    rounding as a product scaled and biased after: two calls fewer per layer, 3-15 % of the attention's time from
    2 to 48 decodes."""
    kv_heads, _, dim = k_layer.shape
    heads, n = query.shape[0], len(batch.token_ids)
    group = heads // kv_heads
    q = query if batch.whole else query.index_select(1, batch.tokens)
    q = q.view(kv_heads, group, n, dim).transpose(1, 2).reshape(-1, group, dim)
    keys = gather_blocks(k_layer, batch.blocks, batch.block_size, batch.index).view(-1, batch.width, dim)
    values = gather_blocks(v_layer, batch.blocks, batch.block_size, batch.index).view(-1, batch.width, dim)
    if batch.bias is None:
        scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scaling)  # [kv_heads * n, group, width]
    else:
        scores = torch.baddbmm(batch.bias, q, keys.transpose(1, 2), alpha=scaling)
    out = torch.bmm(torch.softmax(scores, dim=-1), values)  # [kv_heads * n, group, d]
    return out.view(kv_heads, n, group, dim).transpose(0, 1).reshape(n, heads, dim)


def layer_rows(pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values as [kv_heads, num_blocks * block_size, d] views: rows are pool slots."""
    kv_heads, _, _, dim = pool.shape[2:]
    return pool[layer, 0].view(kv_heads, -1, dim), pool[layer, 1].view(kv_heads, -1, dim)


def write_kv(step: PagedStep, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Stores one layer's new keys and values ([kv_heads, T, d]) at the step's slots."""
    k_layer, v_layer = layer_rows(step.pool, layer)
    k_layer.index_copy_(1, step.slots, key.to(k_layer.dtype))
    v_layer.index_copy_(1, step.slots, value.to(v_layer.dtype))


def attend(step: PagedStep, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """One layer's attention of the packed step's ``query`` [heads, T, d]; returns [T, heads, d]."""
    k_layer, v_layer = layer_rows(step.pool, layer)
    if step.batches and step.batches[0].whole:  # a step of decodes alone: the batch's answer is the step's
        return _attend_batch(query, k_layer, v_layer, step.batches[0], scaling)
    out = query.new_empty(query.shape[1], query.shape[0], query.shape[2])  # [T, heads, d]: the layout returned
    for batch in step.batches:
        out.index_copy_(0, batch.tokens, _attend_batch(query, k_layer, v_layer, batch, scaling))
    for span in step.singles:
        out[span.start : span.end] = attend_window(
            query[:, span.start : span.end], k_layer, v_layer, span, scaling
        ).transpose(0, 1)
    return out


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    paged_step: PagedStep | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The CPU backend called as transformers calls an attention function (query [1, heads, T, d], key/value
    [1, kv_heads, T, d]; returns ([1, T, heads, d], None)) on a step planned by ``plan_step``: the form the tests
    and ``benchmarks/rank/paged_attention.py`` drive directly."""
    if paged_step is None or query.shape[0] != 1:
        raise ValueError("paged_attention takes a planned step (paged_step) and one packed row")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    write_kv(paged_step, module.layer_idx, key[0], value[0])
    return attend(paged_step, module.layer_idx, query[0], scaling)[None], None
