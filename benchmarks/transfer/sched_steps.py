"""Scheduler step time against the number of items a session holds (vLLM #58324).

One ``Scheduler`` (the core, in process, no network) serves a growing session: request k holds ``counts[k]``
small image items — the previous request's items (a prefix hit) plus new ones — and then decodes
``decode_steps`` tokens. A step's work must be proportional to its new items, so the time of a decode step
(schedule + serializing its control + applying rank 0's token) must stay flat from 10 to 10,000 held items, and
the decider's ``items_examined`` count of a decode step must stay bounded. Admission steps necessarily touch every
item once (each item's metadata goes to the ranks), and are reported separately.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from benchmarks.support import stats

_TOKENS_PER_ITEM = 4  # placeholder tokens per item (one merged 4x4-patch grid)
_TEXT_BETWEEN = 2  # text tokens after each item
_IMG = 1000  # placeholder id (outside the synthetic text ids)


def _session_request(rid: str, count: int, decode_steps: int):
    import torch

    from common.ids import ItemId
    from common.multimodal import (
        FieldKind,
        Modality,
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from scheduler_svc.core.request import Request, RequestSampling

    tokens: list[int] = [1, 2, 3]
    features = []
    for i in range(count):
        data = MultiModalKwargsItem({
            "pixel_values": MultiModalFieldElem(torch.zeros(_TOKENS_PER_ITEM, 4), keep_on_cpu=False,
                                                kind=FieldKind.FLAT),
            "image_grid_thw": MultiModalFieldElem(torch.tensor([[1, 2, 2 * _TOKENS_PER_ITEM // 2]]), keep_on_cpu=True),
        })  # fmt: skip
        features.append(MultiModalFeatureSpec(data, Modality.IMAGE, ItemId(f"item-{i:06d}"),
                                              PlaceholderRange(len(tokens), _TOKENS_PER_ITEM),
                                              payload_nbytes=_TOKENS_PER_ITEM * 16))  # fmt: skip
        tokens += [_IMG] * _TOKENS_PER_ITEM + [(i * 7) % 900 + 1, (i * 13) % 900 + 1]
    tokens += [5, 6, 7]
    return Request(rid, tokens, features, RequestSampling(max_tokens=decode_steps, ignore_eos=True))


def measure_step_flatness(
    counts: Sequence[int] = (10, 100, 1000, 10_000),
    decode_steps: int = 60,
    modes: Sequence[str] = ("lazy", "strip", "full"),
    num_ranks: int = 2,
) -> dict:
    """Per mode and item count: decode-step time (p50, p90 µs), items examined per decode step, admission cost."""
    from common.sample import Sample
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.inputs import GroupBudget, GroupStepOutcome
    from scheduler_svc.core.scheduler import Scheduler
    from scheduler_svc.transport.plan_proto import step_control

    longest = max(counts) * (_TOKENS_PER_ITEM + _TEXT_BETWEEN) + decode_steps + 16
    out: dict = {"counts": list(counts), "decode_steps": decode_steps, "modes": {}}
    for mode in modes:
        config = SchedulerConfig(transfer_mode=mode, max_model_len=2 * longest, max_num_batched_tokens=8192)
        budget = GroupBudget(
            num_ranks,
            kv_blocks=4 * longest // 16,
            encoder_cache_tokens=4 * longest,
            payload_cache_bytes=1 << 30,
            max_model_len=2 * longest,
        )
        sched = Scheduler(config, budget, uses_mrope=True, eos_token_ids={0})
        rows = []
        for k, count in enumerate(counts):  # one session: each request extends the previous one's items
            sched.add_request(_session_request(f"session-{k}", count, decode_steps))
            decode_us, examined, admission_us, prefill_steps = [], [], 0.0, 0
            while True:
                t0 = time.perf_counter()
                plan = sched.schedule()
                if plan is None:
                    break
                step_control(plan).SerializeToString()
                sched.update_from_output(plan, GroupStepOutcome({rid: Sample(17) for rid in plan.sampling_request_ids}))
                elapsed = (time.perf_counter() - t0) * 1e6
                is_decode = not plan.new_requests and all(n == 1 for n in plan.num_scheduled_tokens.values())
                if is_decode:
                    decode_us.append(elapsed)
                    examined.append(plan.items_examined)
                else:
                    admission_us += elapsed
                    prefill_steps += 1
            s = stats.summary(decode_us)
            rows.append({"items": count, "decode_p50_us": s["p50"], "decode_p90_us": s["p90"],
                         "decode_steps": len(decode_us), "items_examined_max": max(examined),
                         "items_examined_mean": sum(examined) / len(examined),
                         "prefill_steps": prefill_steps, "admission_and_prefill_ms": admission_us / 1e3})  # fmt: skip
        base = rows[0]["decode_p50_us"]
        out["modes"][mode] = {
            "rows": rows,
            "flatness": stats.flatness([r["decode_p50_us"] for r in rows], base),  # max |p50(K)/p50(10) - 1|
            "ratio_last_first": rows[-1]["decode_p50_us"] / base,
            "items_examined_max": max(r["items_examined_max"] for r in rows),
        }
    return out
