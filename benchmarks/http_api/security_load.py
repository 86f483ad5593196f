"""What hostile and maximal inputs cost the scheduler, beside a live token stream: ``python -m benchmarks.http_api.security_load``
(also part of ``make bench``; ``--out DIR`` writes ``security.md`` and ``security.json`` there).

One scheduler + one rank (``LocalGroup``, the default limits, ``--max-model-len 16384``). For each case, while a
long greedy token stream runs: the scheduler's CPU time (``proc_memory.cpu_seconds``: utime + stime) and peak RSS
(``VmHWM`` after resetting it through ``/proc/<pid>/clear_refs``) over the case's request, the request's status and
wall time, the latency of a small request sent while the case's request is in flight, and the largest gap between
two token deltas of the stream while the case ran. The baseline row is the same with no case request. The peak is
reset to the current RSS before each case, and the allocator settings (``common/process.py``) keep freed
memory, so a case's peak includes what earlier cases left mapped: the cheap cases run first.

Cases (``benchmarks/http_api/hostile_inputs.py`` builds the bombs in memory):
- ``ico-bomb``: a 13000 x 13000 image in an .ico (issue 13: +645 MiB and a 2.5 s freeze of every stream);
- ``png-token-bomb``: a 5792 x 5792 solid PNG, 16384 tokens: over the context (issue 13: 4.4 s, 2.9 GiB);
- ``long-text``: 7.5 MB of text (issue 13: 14 s before its refusal; a small request waited 13.6 s);
- ``large-photo``: a 4000 x 3000 (12 MP) JPEG of 15301 tokens that passes every header check and is decoded and
  preprocessed, with ~1,500 tokens of text, so the whole prompt is refused after tokenizing and the rank does no
  work: the frontend's full cost of a legitimate large image;
- ``max-text``: text just under ``--max-prompt-bytes`` (16384 x 8 bytes), tokenized, then refused for its length.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

from benchmarks.support.proc_memory import cpu_seconds, peak_mib, reset_peak

CONTEXT = 16384
STREAM_TOKENS = 4000


def cases() -> list[tuple[str, str, object]]:
    """(name, what, request builder) for every case; builders return a GenerateRequest."""
    from benchmarks.http_api import hostile_inputs as hostile
    from mmcast.v1 import generation_pb2 as pb
    from mmcast_local.synthetic_images import synthetic_jpeg

    def req(*parts, max_tokens=1):
        return pb.GenerateRequest(
            messages=[pb.ChatMessage(role=pb.ROLE_USER, content=list(parts))],
            sampling=pb.SamplingParams(max_tokens=max_tokens),
        )

    def img(data):
        return pb.ContentPart(image=pb.ImageInput(data=data))

    def txt(s):
        return pb.ContentPart(text=s)

    english = "the quick brown fox jumps over the lazy dog "
    return [
        ("ico-bomb", "13000x13000 .ico", lambda: req(img(hostile.ico_bomb()), txt("Look."))),
        ("png-token-bomb", "5792x5792 PNG, 16384 tokens", lambda: req(img(hostile.png_bomb()), txt("Look."))),
        ("long-text", "7.5 MB of text", lambda: req(txt(english * 170_000))),
        (
            "max-text",
            f"{CONTEXT * 8 - 64} bytes of text, tokenized",
            lambda: req(txt(english * ((CONTEXT * 8 - 64) // 44))),
        ),
        (
            "large-photo",
            "12 MP JPEG decoded (15301 tokens)",
            lambda: req(img(synthetic_jpeg(5, (4000, 3000))), txt(english * 150)),
        ),
    ]


class Stream:
    """A long greedy generation; records when each delta arrived."""

    def __init__(self, stub) -> None:
        from mmcast.v1 import generation_pb2 as pb

        request = pb.GenerateRequest(
            messages=[pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text="Tell a long story.")])],
            sampling=pb.SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True),
        )
        self.call = stub.Generate(request, timeout=600)
        self.times: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import grpc

        try:
            for _ in self.call:
                self.times.append(time.perf_counter())
        except grpc.RpcError:
            pass  # cancelled at the end of the case

    def wait_tokens(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while len(self.times) < n:
            if time.monotonic() > deadline:
                raise RuntimeError("the token stream did not start")
            time.sleep(0.01)

    def max_gap_ms(self, start: float, end: float) -> float:
        ts = [t for t in self.times if start <= t <= end]
        return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=float("nan")) * 1e3

    def stop(self) -> None:
        self.call.cancel()
        self.thread.join(10)


def _small_request(stub) -> float:
    from mmcast.v1 import generation_pb2 as pb

    t0 = time.perf_counter()
    list(
        stub.Generate(
            pb.GenerateRequest(
                messages=[pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text="hi")])],
                sampling=pb.SamplingParams(max_tokens=1),
            ),
            timeout=600,
        )
    )
    return (time.perf_counter() - t0) * 1e3


def measure_case(stub, pid: int, name: str, what: str, build) -> dict:
    import grpc

    request = build() if build is not None else None
    stream = Stream(stub)
    stream.wait_tokens(20)
    time.sleep(0.2)
    reset_peak(pid)
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    outcome: dict = {"code": "OK"}

    def attack():
        try:
            list(stub.Generate(request, timeout=600))
        except grpc.RpcError as exc:
            outcome["code"], outcome["message"] = exc.code().name, (exc.details() or "")[:160]

    thread = threading.Thread(target=attack, daemon=True)
    if request is not None:
        thread.start()
    time.sleep(0.05)
    small_ms = _small_request(stub)
    if request is not None:
        thread.join(600)
    else:
        time.sleep(0.5)  # a window as long as a quick case's, for the stream's gaps
    t1, cpu1 = time.perf_counter(), cpu_seconds(pid)
    peak = peak_mib(pid)
    time.sleep(0.3)
    gap = stream.max_gap_ms(t0, time.perf_counter())
    stream.stop()
    return {
        "case": name,
        "what": what,
        "code": outcome["code"],
        "message": outcome.get("message", ""),
        "request_s": round(t1 - t0, 3),
        "scheduler_cpu_s": round(cpu1 - cpu0, 3),
        "peak_rss_mib": round(peak),
        "small_request_ms": round(small_ms, 1),
        "max_stream_gap_ms": round(gap, 1),
    }


def measure(model_dir: str, log=print) -> list[dict]:
    import grpc

    from mmcast.v1 import generation_pb2_grpc
    from mmcast_local.supervisor import LocalGroup

    rows = []
    with LocalGroup(model_dir, 1, "lazy", kv_blocks=4096, scheduler_args=["--max-model-len", str(CONTEXT)]) as group:
        pid = group.pids()["scheduler"]
        channel = grpc.insecure_channel(group.target, options=[("grpc.max_send_message_length", 64 << 20)])
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        _small_request(stub)  # warm
        for name, what, build in [("baseline", "no attack", None), *cases()]:
            row = measure_case(stub, pid, name, what, build)
            log(f"security: {row}")
            rows.append(row)
        channel.close()
    return rows


PREVIOUS = {  # issue 13, before these checks (same machine class, serve-local defaults)
    "ico-bomb": "+645 MiB (373 -> 1018), every stream frozen 2.5 s",
    "png-token-bomb": "4.4 s, 2.9 GiB; 315 MB left in the processor cache",
    "long-text": "14 s before its refusal; a small request waited 13.6 s",
}


def table(rows: list[dict]) -> str:
    lines = [
        "| case | input | status | request s | scheduler CPU s | peak RSS MiB | small request ms | "
        "max stream gap ms | before (issue 13) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['what']} | {r['code']} | {r['request_s']} | {r['scheduler_cpu_s']} | "
            f"{r['peak_rss_mib']} | {r['small_request_ms']} | {r['max_stream_gap_ms']} | "
            f"{PREVIOUS.get(r['case'], '')} |"
        )
    return "\n".join(lines)


def write(out_dir: str, rows: list[dict]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    md = table(rows)
    with open(os.path.join(out_dir, "security.md"), "w") as f:
        f.write("# Hostile inputs beside a token stream (benchmarks/http_api/security_load.py)\n\n" + md + "\n")
    with open(os.path.join(out_dir, "security.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return md


def main(argv: list[str] | None = None) -> int:
    from benchmarks.support.paths import RESULTS as root
    from common.tiny_model import ensure_tiny_model

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.http_api.security_load", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", default=os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-security"))
    parser.add_argument("--model-dir", default=os.path.join(root, ".model", "qwen2_vl"))
    args = parser.parse_args(argv)
    rows = measure(str(ensure_tiny_model(args.model_dir)))
    print(write(args.out, rows))
    return 0


if __name__ == "__main__":
    import sys

    from common.process import ensure_allocator_env

    ensure_allocator_env()
    sys.exit(main())
