"""Rank 0's sampling of a step: every window that reached its end drawn in one batched call, each request's
failure its own (the group's state is intact, every collective of the step being done).
"""

from __future__ import annotations

import logging

import torch

from common.sample import Sample
from worker_svc.request_state import RequestState
from worker_svc.runner import StepLogits
from worker_svc.sampling import GrammarMasks, SamplingError, sample_batch
from worker_svc.token_mask import UnpackedMasks

log = logging.getLogger(__name__)


def sample_step(
    states: list[RequestState], logits: StepLogits, masks: dict, rank: int, unpacked: UnpackedMasks
) -> list[Sample | str]:
    """Each request's token, or why sampling it failed, in one batched call (``sample_batch``). Sampling runs
    after every collective of the step and only here on rank 0, so a failure is the request's alone: the
    group's state is intact (see worker.py). ``rank``: this rank, for the messages; ``unpacked``: the session's
    unpacked grammar masks. Should the batched call itself fail, each request is sampled alone, so only the request
    whose draw raises fails."""
    params = [s.sampling for s in states]
    indices = [s.num_output_tokens for s in states]
    histories = [(s.token_ids, s.num_prompt_tokens) for s in states]  # no copies: penalties.py slices
    rows = [row for row in logits.rows if row is not None]  # 0, 1, ...: every window that samples, in order
    vocab = logits.batch.shape[-1]
    masked = [k for k, s in enumerate(states) if s.request_id in masks]
    grammar = None
    if masked:
        grammar = GrammarMasks(masked, unpacked.forbidden([masks[states[k].request_id].allowed for k in masked], vocab))
    try:
        # The step's logits are read by nothing after: masks may go into them (alone below, a mask again is a
        # no-op). They are the forward's inference tensors, which only inference mode may write.
        with torch.inference_mode():
            drawn: list = sample_batch(logits.batch, params, indices, histories, grammar, writable=True)
    except Exception:  # noqa: BLE001 - isolate the failing request below
        log.warning("sampling the step's batch failed; each request is sampled alone", exc_info=True)
        drawn = []
        for state, row, history in zip(states, rows, histories, strict=True):
            try:
                one = logits.batch[row : row + 1]
                mask = grammar.row(masked.index(row)) if grammar is not None and row in masked else None
                drawn.append(sample_batch(one, [state.sampling], [state.num_output_tokens], [history], mask)[0])
            except Exception as exc:  # any failure of one request's draw or log-probabilities
                drawn.append(exc)
    out: list[Sample | str] = []
    for state, got in zip(states, drawn, strict=True):
        if isinstance(got, Sample):
            out.append(got)
            continue
        log.warning(
            "sampling failed; the request fails alone",
            extra={"request_id": state.request_id, "error": repr(got)},
            exc_info=(type(got), got, got.__traceback__) if not isinstance(got, SamplingError) else False,
        )
        out.append(f"sampling failed on rank {rank}: {got}")
    return out
