"""The benchmark scenarios, driven through the SDK against a running local group.

A ``Session`` wraps one group (one tensor-parallel size and transfer mode) and its clients; every call is one
``Record``: client-side TTFT, the server's usage counters, and the per-request deltas of the scheduler's and the
workers' Prometheus counters, scraped before and after the request (requests run one at a time, so the deltas
belong to it). Scenarios (issue 7):

- ``cached_floor``: N distinct images sent once to warm the caches, then the same conversation plus a new short
  question, timed ``repeats`` times; interleaved with a text-only control of the same prompt length;
- ``duplicate``: the same, with all N slots holding one image;
- ``conversation``: one new image per turn, the whole history resent each turn;
- ``sliding_window``: one new image per turn, only the last ``window`` turns kept (the prefix misses from the
  first token on once the window slides).

Prompts are built so that repeats cost the same: questions are permutations of one word set (the tokenizer splits
on spaces, so every permutation has the same length), and the control's filler is calibrated to the image
prompt's token count on the server.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import urllib.request
from collections.abc import Callable, Sequence

ANSWER = "I see the pictures."  # the assistant's fixed reply in every history
_QUESTION_WORDS = ("which", "colour", "is", "the", "sky", "there", "now")
_FILLER = "the"  # one token per occurrence after a space; calibrated on the server anyway

# Counters scraped around every request: (endpoint role, metric, label) -> record field.
_SCHED = {
    ("mmcast_broadcast_bytes_total", "kind", "payload"): "payload_bytes",
    ("mmcast_broadcast_bytes_total", "kind", "metadata"): "metadata_bytes",
    ("mmcast_broadcast_bytes_total", "kind", "control"): "control_bytes",
    ("mmcast_broadcast_payload_bytes_saved_total", "reason", "prefix_covered"): "saved_prefix_bytes",
    ("mmcast_broadcast_payload_bytes_saved_total", "reason", "rank_cached"): "saved_rank_bytes",
    ("mmcast_step_seconds_sum", None, None): "step_seconds_sum",
    ("mmcast_step_seconds_count", None, None): "steps",
    ("mmcast_schedule_seconds_sum", None, None): "schedule_seconds_sum",
    ("mmcast_encoder_runs_total", None, None): "encoder_runs",
    ("mmcast_encoder_output_shared_bytes_total", None, None): "encoder_output_shared_bytes",
}
_WORKER = {
    ("mmcast_worker_received_bytes_total", "kind", "payload"): "worker_payload_bytes",
    ("mmcast_worker_received_bytes_total", "kind", "metadata"): "worker_metadata_bytes",
    ("mmcast_worker_received_bytes_total", "kind", "control"): "worker_control_bytes",
    ("mmcast_worker_encoder_runs_total", None, None): "worker_encoder_runs",
    ("mmcast_worker_encoder_collective_bytes_total", None, None): "worker_collective_bytes",  # sent + received
    ("mmcast_worker_encoder_collective_seconds_sum", None, None): "worker_collective_seconds_sum",
    ("mmcast_worker_preprocess_seconds_sum", None, None): "worker_preprocess_seconds_sum",
    ("mmcast_worker_encoder_seconds_sum", None, None): "worker_encoder_seconds_sum",
}


def parse_metrics(text: str) -> dict[tuple[str, str | None, str | None], float]:
    """The samples of a Prometheus text page keyed by (sample name, label name, label value) for samples with one
    label at most, and (sample name, None, None) = the sum over every label set of that sample name; that key is
    0 for a metric on the page without samples yet (a labelled counter before its first increment)."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total",), "histogram": ("_sum", "_count"), "summary": ("_sum", "_count")}
    out: dict[tuple[str, str | None, str | None], float] = {}
    for family in text_string_to_metric_families(text):
        for suffix in suffixes.get(family.type, ("",)):
            out[(family.name + suffix, None, None)] = 0.0
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            if "le" in s.labels:
                continue  # histogram buckets are not needed; _sum and _count are
            out[(s.name, None, None)] = out.get((s.name, None, None), 0.0) + s.value
            if len(labels) == 1:
                ((k, v),) = labels.items()
                out[(s.name, k, v)] = s.value
    return out


class Scraper:
    """Reads the scheduler's and every rank's /metrics and turns two snapshots into per-request byte counts."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls

    def snapshot(self) -> dict[str, dict]:
        out = {}
        for role, url in self.urls.items():
            with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - loopback URLs we started
                out[role] = parse_metrics(reply.read().decode())
        return out

    @staticmethod
    def delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, float | None]:
        """Per field: after - before (summed over ranks for the workers' fields); None where the metric is on no
        page (a build without it), so that it is not mistaken for a measured 0."""
        d: dict[str, float | None] = {}
        ranks = [r for r in after if r != "scheduler"]
        for key, field in _SCHED.items():
            present = (key[0], None, None) in after["scheduler"]
            d[field] = after["scheduler"].get(key, 0.0) - before["scheduler"].get(key, 0.0) if present else None
        for key, field in _WORKER.items():
            present = any((key[0], None, None) in after[r] for r in ranks)
            d[field] = sum(after[r].get(key, 0.0) - before[r].get(key, 0.0) for r in ranks) if present else None
        return {k: (int(v) if v is not None and not k.endswith("_sum") else v) for k, v in d.items()}


@dataclasses.dataclass
class Record:
    """One request as the benchmark saw it."""

    scenario: str  # cached_floor | duplicate | conversation | sliding_window | warmup
    kind: str  # image | control (text only) | warm (untimed cache fill)
    client: str  # sdk (upload once, reference by hash) | resend (encoded bytes every turn)
    tp: int
    mode: str
    n: int  # images in the prompt (for the control: the image prompt it matches)
    index: int  # repeat (cached floor, duplicate) or turn (conversation, sliding window)
    ttft_ms: float  # client side: generate() called -> first token
    server_ttft_ms: float
    total_ms: float
    token_ids: list[int]
    usage: dict  # mmcast.v1.Usage fields (a field this build's SDK lacks is absent)
    metrics: dict  # per-request counter deltas (see Scraper.delta) and CPU seconds (see Session.run)
    variant: str = ""  # new_images: payload encoding + encoder placement (benchmarks/transfer/new_images.py); else ""
    image: str = ""  # new_images: "<W>x<H> <format>" of every image in the request; else ""
    image_bytes: int = 0  # new_images: encoded bytes of the request's images as the client sent them


class Images:
    """Synthetic scenes as JPEG or PNG files on disk (paths let the SDK hash each image once, as a real application's
    would). ``size`` is the default (width, height); a file is rendered once and kept for later runs."""

    FORMATS = {"jpeg": "jpg", "png": "png"}  # format -> file extension

    def __init__(self, directory: str, size: tuple[int, int]) -> None:
        self.directory = directory
        self.size = size
        os.makedirs(directory, exist_ok=True)

    def path(self, seed: int, size: tuple[int, int] | None = None, fmt: str = "jpeg") -> str:
        from mmcast_local.synthetic_images import synthetic_jpeg, synthetic_scene

        if fmt not in self.FORMATS:
            raise ValueError(f"image format {fmt!r}; choose one of {sorted(self.FORMATS)}")
        w, h = size or self.size
        path = os.path.join(self.directory, f"scene-{w}x{h}-{seed}.{self.FORMATS[fmt]}")
        if not os.path.exists(path):
            if fmt == "jpeg":
                data = synthetic_jpeg(seed, (w, h))
            else:  # lossless: a PNG of the same scene is ~10x its JPEG, the heavy case for the encoded payload
                buffer = io.BytesIO()
                synthetic_scene(seed, (w, h)).save(buffer, format="PNG")
                data = buffer.getvalue()
            tmp = f"{path}.{os.getpid()}.tmp"  # concurrent runs may share the folder
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return path


def _cpu(pids: dict[str, int | None]) -> dict[str, float | None]:
    """CPU seconds of each named process; None for one that is not running."""
    from benchmarks.support.proc_memory import cpu_seconds

    out: dict[str, float | None] = {}
    for name, pid in pids.items():
        try:
            out[name] = cpu_seconds(pid) if pid else None
        except (OSError, ValueError):  # exited (and reaped) since the pids were read
            out[name] = None
    return out


def question(i: int) -> str:
    """Question ``i``: a permutation of one word set, so every question has the same token count."""
    words = next(itertools.islice(itertools.permutations(_QUESTION_WORDS), i * 97 % 5040, None))
    return "Question: " + " ".join(words) + "?"


def user(paths: Sequence[str], text: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "image", "image": p} for p in paths] + [{"type": "text", "text": text}],
    }


def assistant() -> dict:
    return {"role": "assistant", "content": ANSWER}


def filler(words: int) -> str:
    return "Context:" + f" {_FILLER}" * words


class Session:
    """One group's clients and scraper; ``run`` times one request and returns its Record."""

    def __init__(
        self, group, tp: int, mode: str, max_tokens: int, on_record: Callable[[Record], None], variant: str = ""
    ) -> None:
        from mmcast_client.client import Client

        self.tp, self.mode, self.max_tokens, self.variant = tp, mode, max_tokens, variant
        self.pids = group.pids  # re-read per request: a restarted process has a new pid
        self.clients = {
            "sdk": Client(group.target, timeout=600),
            "resend": Client(group.target, timeout=600, upload_images=False),
        }
        self.scraper = Scraper(group.metrics_urls)
        self.on_record = on_record
        self._filler_base: int | None = None  # prompt tokens of filler(0) in the control's conversation shape

    def close(self) -> None:
        for c in self.clients.values():
            c.close()

    def run(
        self,
        messages,
        *,
        scenario: str,
        kind: str,
        n: int,
        index: int,
        client: str = "sdk",
        max_tokens: int | None = None,
        image: str = "",
        image_bytes: int = 0,
    ) -> Record:
        """One request, timed. Besides the counter deltas, ``metrics`` gets the CPU seconds the scheduler process
        (``scheduler_cpu_seconds``) and all ranks together (``rank_cpu_seconds``) spent while it ran, read inside
        the scrapes so that serving /metrics is not counted (None if a process restarted meanwhile)."""
        before = self.scraper.snapshot()
        pids = self.pids()
        cpu0 = _cpu(pids)
        result = self.clients[client].generate(messages, max_tokens=max_tokens or self.max_tokens, ignore_eos=True)
        cpu1 = _cpu(pids)
        after = self.scraper.snapshot()
        metrics = Scraper.delta(before, after)
        for role, key in (("scheduler", "scheduler_cpu_seconds"), ("rank", "rank_cpu_seconds")):
            names = [name for name in pids if name.startswith(role)]
            ok = all(cpu0.get(name) is not None and cpu1.get(name) is not None for name in names)
            metrics[key] = sum(cpu1[name] - cpu0[name] for name in names) if ok and names else None
        rec = Record(
            scenario, kind, client, self.tp, self.mode, n, index,
            ttft_ms=result.ttft_seconds * 1e3, server_ttft_ms=result.server_ttft_seconds * 1e3,
            total_ms=result.total_seconds * 1e3, token_ids=list(result.token_ids),
            usage=dataclasses.asdict(result.usage), metrics=metrics, variant=self.variant, image=image,
            image_bytes=image_bytes,
        )  # fmt: skip
        self.on_record(rec)
        return rec

    # -- scenarios -----------------------------------------------------------------------------------------------
    def control_messages(self, prompt_tokens: int, text: str, q: int) -> list[dict]:
        """The text-only control whose prompt has ``prompt_tokens`` tokens (filler calibrated once per session)."""
        if self._filler_base is None:
            probe = [user([], filler(0) + " " + text), assistant(), user([], question(0))]
            rec = self.run(probe, scenario="calibration", kind="warm", n=0, index=0, max_tokens=1)
            self._filler_base = rec.usage["prompt_tokens"]
        words = max(0, prompt_tokens - self._filler_base)
        return [user([], filler(words) + " " + text), assistant(), user([], question(q))]

    def cached_floor(
        self,
        scenario: str,
        images: Images,
        ns: Sequence[int],
        repeats: int,
        clients: Sequence[str],
        control: bool,
        seed: int,
    ) -> None:
        """Warm every N once (images, then the control), then time ``repeats`` rounds of follow-up questions over
        all N, alternating the order of N each round, so that a drift of the machine's speed does not tilt the
        slope."""
        heads: dict[int, tuple[list[dict], list[dict] | None]] = {}
        for n in ns:
            seeds = [seed] * n if scenario == "duplicate" else [seed + i for i in range(n)]
            head = [user([images.path(s) for s in seeds], f"Here are {n} pictures."), assistant()]
            warm = self.run([*head, user([], question(0))], scenario=scenario, kind="warm", n=n, index=0)
            ctrl_head = None
            if control:
                ctrl = self.control_messages(warm.usage["prompt_tokens"], f"Here are {n} pictures.", 0)
                self.run(ctrl, scenario=scenario, kind="warm", n=n, index=0)
                ctrl_head = ctrl[:2]
            heads[n] = (head, ctrl_head)
        for r in range(1, repeats + 1):
            for n in ns if r % 2 else list(reversed(ns)):
                head, ctrl_head = heads[n]
                for client in clients:
                    self.run(
                        [*head, user([], question(r))], scenario=scenario, kind="image", n=n, index=r, client=client
                    )
                if ctrl_head is not None:
                    self.run([*ctrl_head, user([], question(r))], scenario=scenario, kind="control", n=n, index=r)

    def turns(
        self, scenario: str, images: Images, turns: int, window: int | None, clients: Sequence[str], seed: int
    ) -> None:
        """One new image per turn; the history is every earlier turn, or the last ``window - 1`` of them."""
        for c, client in enumerate(clients):  # each client its own images: no cache carried between them
            history: list[dict] = []
            for t in range(turns):
                history += [user([images.path(seed + 100 * c + t)], question(t)), assistant()]
                keep = history[-2 * window :] if window else history
                self.run(keep[:-1], scenario=scenario, kind="image", n=len(keep) // 2, index=t, client=client)
