"""The rank's language model against transformers' static batch: ``python -m benchmarks.rank.rank_engine [--quick]
[--widths 2b,7b,qwen3-2b] [--out DIR]`` (``make bench``: every width; ``make bench-quick``: the short 2B-width form).

Checkpoints: 2-layer Qwen2-VL with real widths and random weights, float32 — Qwen2-VL-2B's widths
(``common.tiny_model``, ``width="real"``) and Qwen2-VL-7B's (hidden 3584, 28 query / 4 KV heads, intermediate 18944,
vocabulary 152064, untied ``lm_head``; built here), each built once under ``benchmarks/results/.model``. Beside them
``qwen3-2b``: a 2-layer Qwen3-VL at Qwen3-VL-2B's widths (``common.tiny_model``, ``QWEN3_REAL_WIDTH``: head_dim 128,
16 query / 8 KV heads, interleaved M-RoPE), the same jobs through the same rank code (its DeepStack inputs are absent
from text requests, so the figures compare the decoders).

Jobs: N = 1, 4, 16, 32 concurrent text requests with equal (~1k tokens) or mixed prompt lengths (256, 512, 1k, 2k,
4k in turn), every prompt distinct from its first block on (no prefix-cache hit), greedy, ``ignore_eos``, the same
number of new tokens each. Served: one local group (TP 1, real processes), all N requests of a job sent at once
through the SDK with token streaming. Reference: one process with plain transformers, the same prompt token ids
left-padded into one batch, ``generate`` with the same new tokens. The two sides take turns job by job (never at
the same time), so a machine whose load drifts weighs on both alike; the rank gets every CPU, as the transformers
process does (``MMCAST_RESERVED_CPUS=0``; serve-local's default leaves one to the scheduler).

Figures per job, both sides: prefill tokens/s (real prompt tokens over the time until every request has its first
token) and decode tokens/s (tokens produced after the last first token, over that phase: pure decode steps on both
sides), and end to end (every new token over the whole job). Beside the served figures, the rank's own step time
over the decode phase (``mmcast_worker_step_seconds`` from its ``/metrics``). A third table divides a decode step's time by the tokens its 16 requests attend to
(context lengths summed) at 256, 1k and 4k tokens of context. Greedy tokens are compared; a random-weight model's
near-ties can flip a token between a padded batch and a ragged one, so equality is reported, not required.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "benchmarks", "results", ".model")
MIXED = (256, 512, 1024, 2048, 4096)
# Qwen2-VL-7B-Instruct's config.json widths; 2 decoder layers, the 2B-width recipe's 2 vision blocks.
WIDTH_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}


@dataclasses.dataclass(frozen=True)
class Job:
    name: str  # "equal" | "mixed" | "context"
    n: int
    lengths: tuple[int, ...]  # target prompt tokens per request
    new_tokens: int


@dataclasses.dataclass(frozen=True)
class Plan:
    width: str  # "2b" | "7b"
    jobs: tuple[Job, ...]


def _jobs(ns, equal: int, new_tokens: int, mixed_ns, contexts, context_tokens: int) -> tuple[Job, ...]:
    jobs = [Job("equal", n, (equal,) * n, new_tokens) for n in ns]
    jobs += [Job("mixed", n, tuple(MIXED[i % len(MIXED)] for i in range(n)), new_tokens) for n in mixed_ns]
    jobs += [Job("context", 16, (c,) * 16, context_tokens) for c in contexts]
    return tuple(jobs)


PLANS = {
    # make bench-quick: 2B widths, the two targets' jobs (N = 16 equal and mixed), N = 1, and a 256-token context
    # (N = 16 equal is the 1k row of the attended-token table).
    "quick": (Plan("2b", _jobs((1, 16), 1024, 16, (16,), (256,), 8)),),
    # make bench: every N at 2B widths, 4k context included. 7B widths: the jobs whose static batch fits beside the
    # rank in 24 GiB (transformers prefills a job in one forward: 16 x 4k tokens at 7B widths holds ~15 GB of MLP
    # activations alone); prefill there costs ~4x.
    "full": (Plan("2b", _jobs((1, 4, 16, 32), 1024, 24, (4, 16, 32), (256, 4096), 8)),
             Plan("7b", _jobs((1, 16), 1024, 24, (4,), (256,), 8)),
             Plan("qwen3-2b", _jobs((1, 16), 1024, 24, (16,), (256,), 8))),
}  # fmt: skip


# --- checkpoints -----------------------------------------------------------------------------------------------


def model_dir(width: str) -> str:
    from common import tiny_model

    if width == "2b":
        return str(
            tiny_model.ensure_tiny_model(os.path.join(MODELS, "qwen2_vl-real-width"), width="real", replace_stale=True)
        )
    if width == "qwen3-2b":
        return str(
            tiny_model.ensure_tiny_model(
                os.path.join(MODELS, "qwen3_vl-real-width"), variant="qwen3_vl", width="real", replace_stale=True
            )
        )
    out = os.path.join(MODELS, "qwen2_vl-7b-width")
    marker = os.path.join(out, "mmcast_rank_engine.json")
    wanted = {"widths": WIDTH_7B, "recipe": tiny_model.recipe_id()}
    if os.path.exists(marker) and json.load(open(marker)) == wanted:
        return out
    _build_7b(out)
    with open(marker, "w") as f:
        json.dump(wanted, f)
    return out


def _build_7b(out: str) -> None:
    """The 2B-width recipe (tokenizer, processor, vision tower) with Qwen2-VL-7B's decoder widths."""
    import torch
    from transformers import AutoModelForImageTextToText

    from common import tiny_model

    config = tiny_model.build_config(width="real")
    for key, value in WIDTH_7B.items():
        setattr(config.text_config, key, value)
    config.vision_config.hidden_size = WIDTH_7B["hidden_size"]  # the merger's output: the decoder's width
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = tiny_model.build_model().generation_config
    model.save_pretrained(out)
    del model
    processor = tiny_model.build_processor()
    processor.tokenizer.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    path = os.path.join(out, "preprocessor_config.json")
    data = json.load(open(path))
    data["processor_class"] = type(processor).__name__
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


# --- prompts ---------------------------------------------------------------------------------------------------


def prompts(processor, job: Job, tag: str) -> list[tuple[str, list[int]]]:
    """(text, the frontend's token ids) per request, each ``job.lengths[i]`` tokens within a few, distinct from the
    first user token on (``tag`` and the index lead the text)."""
    from common import tiny_model

    words = open(tiny_model.corpus_path()).read().split()
    out = []
    for i, target in enumerate(job.lengths):
        head = f"Request {tag}-{i}: "
        count = target
        for _ in range(6):  # a few corrections: tokens per word vary
            text = head + " ".join(words[(i * 7919 + k) % len(words)] for k in range(count))
            ids = _ids(processor, text)
            if abs(len(ids) - target) <= 2:
                break
            count = max(1, int(count * target / len(ids)))
        out.append((text, ids))
    return out


def _ids(processor, text: str) -> list[int]:
    chat = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    templated = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return processor(text=[templated], return_tensors="pt")["input_ids"][0].tolist()


# --- served ----------------------------------------------------------------------------------------------------


def _step_seconds(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = float(re.search(r"^mmcast_worker_step_seconds_sum (\S+)$", text, re.M).group(1))
    count = float(re.search(r"^mmcast_worker_step_seconds_count (\S+)$", text, re.M).group(1))
    return total, count


def serve_job(client, rank_metrics: str, job: Job, reqs: list[tuple[str, list[int]]]) -> dict:
    """All requests at once, streamed; returns the phase times, the tokens and the rank's step time."""
    n = len(reqs)
    first = [0.0] * n
    times: list[list[float]] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    errors: list[BaseException] = []
    all_first = threading.Event()
    lock = threading.Lock()
    scrape: dict = {}

    def one(i: int) -> None:
        try:
            stream = client.generate(
                reqs[i][0], max_tokens=job.new_tokens, temperature=0.0, ignore_eos=True, stream=True
            )
            for delta in stream:
                now = time.perf_counter()
                times[i] += [now] * len(delta.token_ids)
                tokens[i] += delta.token_ids
                with lock:
                    if not first[i]:
                        first[i] = now
                        if all(first):
                            scrape["start"] = (now, _step_seconds(rank_metrics))
                            all_first.set()
            served = stream.result.usage.prompt_tokens
            if served != len(reqs[i][1]):  # the reference must run the very prompt the frontend built
                raise RuntimeError(
                    f"request {i}: the server counted {served} prompt tokens, the reference has {len(reqs[i][1])}"
                )
        except BaseException as exc:  # reported after the join
            errors.append(exc)
            all_first.set()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    end = max(ts[-1] for ts in times)
    steps_end = _step_seconds(rank_metrics)
    t_first, steps_start = scrape["start"]
    decode_tokens = sum(sum(1 for t in ts if t > t_first) for ts in times)
    decode_steps = steps_end[1] - steps_start[1]
    return {
        "prompt_tokens": sum(len(r[1]) for r in reqs),
        "new_tokens": sum(len(t) for t in tokens),
        "prefill_seconds": t_first - t0,
        "decode_tokens": decode_tokens,
        "decode_seconds": end - t_first,
        "rank_step_ms": 1e3 * (steps_end[0] - steps_start[0]) / decode_steps if decode_steps else None,
        "rank_decode_steps": decode_steps,
        "tokens": tokens,
    }


class Reference:
    """The transformers process (``--reference``): loads the checkpoint once, then runs one job per line of its
    stdin and answers one JSON line. Kept beside the group so the two sides take turns job by job: a machine whose
    load drifts over minutes then weighs on both alike (they never run at the same time)."""

    def __init__(self, model: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.rank.rank_engine", "--reference", model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def run(self, job: Job, reqs: list) -> dict:
        self.proc.stdin.write(json.dumps({"new_tokens": job.new_tokens, "ids": [ids for _, ids in reqs]}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the transformers process ended (exit status {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # still loading (the group failed first): it has nothing left to do
            self.proc.kill()
            self.proc.wait()


def run_jobs(
    model: str, jobs: list[tuple[Job, list]], log, env: dict | None = None, worker_args: tuple[str, ...] = ()
) -> list[tuple[dict, dict]]:
    """(served, transformers) per job, the two taking turns."""
    from mmcast_client.client import Client
    from mmcast_local.supervisor import LocalGroup

    peak = max(sum(len(ids) + j.new_tokens for _, ids in reqs) for j, reqs in jobs)
    blocks = 2 * (peak // 16 + 64 * 4)  # the largest job twice over: room beside the prefix cache's freed blocks
    out = []
    reference = Reference(model)
    # The rank takes every CPU, as the transformers process does: the two take turns, never run at once, and the
    # question is the forward's. (serve-local leaves one CPU to the scheduler: MMCAST_RESERVED_CPUS=1.)
    env = {**(os.environ if env is None else env), "MMCAST_RESERVED_CPUS": "0"}
    try:
        # A long prefill step on a loaded 2-core machine can outlast the scheduler's default step timeout (120 s),
        # which would count the group as lost and restart it mid-job.
        with (
            LocalGroup(
                model,
                tp=1,
                kv_blocks=blocks,
                env=env,
                ready_timeout=900,
                worker_args=worker_args,
                scheduler_args=("--step-timeout-seconds", "1800"),
            ) as group,
            Client(group.target, timeout=3600, first_token_timeout=3600) as client,
        ):
            rank = group.metrics_urls["rank0"]
            client.generate("warm up", max_tokens=2, ignore_eos=True)
            for job, reqs in jobs:
                served = serve_job(client, rank, job, reqs)
                plain = reference.run(job, reqs)
                log(
                    f"{job.name} N={job.n}: decode tok/s mmcast {_rate(served, 'decode'):.1f} (rank step "
                    f"{served['rank_step_ms']:.1f} ms), transformers {_rate(plain, 'decode'):.1f} (step "
                    f"{plain['step_ms']:.1f} ms); prefill tok/s {_rate(served, 'prefill'):.0f} / "
                    f"{_rate(plain, 'prefill'):.0f}"
                )
                out.append((served, plain))
    finally:
        reference.close()
    return out


def _reference_main(model_path: str) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, LogitsProcessor, LogitsProcessorList

    model = AutoModelForImageTextToText.from_pretrained(model_path, local_files_only=True).eval()
    pad = model.generation_config.pad_token_id

    class Clock(LogitsProcessor):
        """Called once per generated token, right after the forward that produced its logits."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    for line in sys.stdin:
        job = json.loads(line)
        ids = job["ids"]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        clock = Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=job["new_tokens"],
                min_new_tokens=job["new_tokens"],
                do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
            )
        steps = len(clock.times) - 1
        print(json.dumps({
            "prompt_tokens": sum(len(x) for x in ids),
            "new_tokens": len(clock.times) * len(ids),
            "prefill_seconds": clock.times[0] - t0,
            "decode_tokens": steps * len(ids),
            "decode_seconds": clock.times[-1] - clock.times[0],
            "step_ms": 1e3 * (clock.times[-1] - clock.times[0]) / steps if steps else None,
            "tokens": out[:, width:].tolist(),
        }), flush=True)  # fmt: skip


# --- the run ---------------------------------------------------------------------------------------------------


def measure(plans, log=print, env: dict | None = None, worker_args: tuple[str, ...] = ()) -> dict:
    from common.processor import load_processor

    rows = []
    for plan in plans:
        model = model_dir(plan.width)
        processor = load_processor(model)
        stamp = time.strftime("%H%M%S")
        jobs = [(job, prompts(processor, job, f"{plan.width}{stamp}{k}")) for k, job in enumerate(plan.jobs)]
        t0 = time.monotonic()
        pairs = run_jobs(model, jobs, log, env, worker_args)
        log(f"{plan.width} widths: every job on both sides in {time.monotonic() - t0:.0f} s")
        for (job, reqs), (s, p) in zip(jobs, pairs, strict=True):
            contexts = [len(ids) + job.new_tokens / 2 for _, ids in reqs]  # mean over the decode steps
            same = sum(a == b for a, b in zip(s["tokens"], p["tokens"], strict=True))
            rows.append({"width": plan.width, "job": job.name, "n": job.n, "new_tokens": job.new_tokens,
                         "mean_prompt": sum(len(ids) for _, ids in reqs) / job.n, "attended": sum(contexts),
                         "served": {k: v for k, v in s.items() if k != "tokens"},
                         "plain": {k: v for k, v in p.items() if k != "tokens"},
                         "requests_equal": same})  # fmt: skip
    return {"rows": rows}


def _rate(side: dict, kind: str) -> float:
    """Tokens/s of a phase: ``prefill`` (prompt tokens), ``decode`` (tokens after the last first token) or
    ``total`` (every new token over the whole job, prefill included)."""
    tokens = {"prefill": side["prompt_tokens"], "decode": side["decode_tokens"], "total": side["new_tokens"]}[kind]
    seconds = side["prefill_seconds"] + side["decode_seconds"] if kind == "total" else side[f"{kind}_seconds"]
    return tokens / seconds if seconds else float("nan")


def tables(result: dict) -> str:
    lines = [
        "| widths | prompts | N | mean prompt | prefill tok/s mmcast / transformers | decode tok/s mmcast | "
        "decode tok/s transformers | decode ratio | end-to-end tok/s mmcast / transformers | rank step ms | "
        "greedy equal |",
        "|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in result["rows"]:
        if r["job"] == "context":
            continue
        s, p = r["served"], r["plain"]
        lines.append(
            f"| {r['width'].upper()} | {r['job']} | {r['n']} | {r['mean_prompt']:.0f} | "
            f"{_rate(s, 'prefill'):.0f} / {_rate(p, 'prefill'):.0f} | {_rate(s, 'decode'):.1f} | "
            f"{_rate(p, 'decode'):.1f} | **{_rate(s, 'decode') / _rate(p, 'decode'):.2f}×** | "
            f"{_rate(s, 'total'):.1f} / {_rate(p, 'total'):.1f} | {s['rank_step_ms']:.1f} | "
            f"{r['requests_equal']}/{r['n']} |"
        )
    lines += [
        "",
        "| widths | context | rank step ms | transformers step ms | rank µs / attended token | "
        "transformers µs / attended token | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(
        (r for r in result["rows"] if r["n"] == 16 and r["job"] in ("equal", "context")),
        key=lambda r: (r["width"], r["mean_prompt"]),
    ):
        s, p = r["served"]["rank_step_ms"], r["plain"]["step_ms"]
        lines.append(
            f"| {r['width'].upper()} | {r['mean_prompt']:.0f} | {s:.1f} | {p:.1f} | "
            f"{1e3 * s / r['attended']:.2f} | {1e3 * p / r['attended']:.2f} | {s / p:.2f} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    widths = sorted({r["width"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(widths), figsize=(5.5 * len(widths), 3.8), squeeze=False)
    for ax, width in zip(axes[0], widths, strict=True):
        for job, style in (("equal", "-o"), ("mixed", "-s")):
            rows = sorted((r for r in result["rows"] if r["width"] == width and r["job"] == job), key=lambda r: r["n"])
            if not rows:
                continue
            ns = [r["n"] for r in rows]
            ax.plot(ns, [_rate(r["served"], "decode") for r in rows], style, color="tab:green", label=f"mmcast, {job}")
            ax.plot(
                ns,
                [_rate(r["plain"], "decode") for r in rows],
                style,
                color="tab:grey",
                label=f"transformers batch, {job}",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests N")
        ax.set_ylabel("decode tokens/s")
        model = "Qwen3-VL, 2B" if width == "qwen3-2b" else f"Qwen2-VL, {width.upper()}"
        ax.set_title(f"2-layer {model} widths, float32")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(out_dir: str, result: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    md = tables(result)
    with open(os.path.join(out_dir, "rank_engine.md"), "w") as f:
        f.write("# The rank's forward against transformers' static batch\n\n" + md + "\n")
    with open(os.path.join(out_dir, "rank_engine.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out_dir, "rank_engine.png"))
    return md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rank.rank_engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short 2B-width form (make bench-quick)")
    parser.add_argument(
        "--widths",
        default="",
        help="comma-separated subset of 2b,7b,qwen3-2b (default: the "
        "plan's; a width the chosen plan lacks runs with the plan's 2B jobs)",
    )
    parser.add_argument("--out", help="folder for rank_engine.md/.json/.png")
    parser.add_argument("--worker-tree", help="run the group's processes from this source tree (a before/after check)")
    parser.add_argument(
        "--jobs",
        default="",
        help="comma-separated subset of the plan's jobs as NAME:N (e.g. equal:16,mixed:16; default: all)",
    )
    parser.add_argument(
        "--cpu-linear",
        choices=("auto", "onednn", "dense"),
        help="the rank's --cpu-linear (default: the rank's own, auto): dense shows the share of the packed weights",
    )
    parser.add_argument("--reference", help=argparse.SUPPRESS)  # internal: the transformers process
    args = parser.parse_args(argv)
    if args.reference:
        _reference_main(args.reference)
        return 0
    plans = PLANS["quick" if args.quick else "full"]
    if args.widths:
        wanted_widths = args.widths.split(",")
        unknown = set(wanted_widths) - {p.width for p in PLANS["full"]}
        if unknown:
            parser.error(f"--widths {args.widths}: unknown {sorted(unknown)}; choose from 2b, 7b, qwen3-2b")
        two_b = next(p for p in plans if p.width == "2b")
        plans = tuple(next((p for p in plans if p.width == w), Plan(w, two_b.jobs)) for w in wanted_widths)
    if args.jobs:
        wanted = set(args.jobs.split(","))
        plans = tuple(Plan(p.width, tuple(j for j in p.jobs if f"{j.name}:{j.n}" in wanted)) for p in plans)
        plans = tuple(p for p in plans if p.jobs)
        if not plans:
            parser.error(f"--jobs {args.jobs}: no job of the plan matches (names: equal, mixed, context)")
    env = dict(os.environ, PYTHONPATH=args.worker_tree) if args.worker_tree else None
    worker_args = ("--cpu-linear", args.cpu_linear) if args.cpu_linear else ()
    result = measure(plans, log=lambda m: print(m, file=sys.stderr, flush=True), env=env, worker_args=worker_args)
    result["cpu_linear"] = args.cpu_linear or "auto"
    print(write(args.out, result) if args.out else tables(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
