"""A real benchmark client against ``mmcast serve-local``: AIPerf's multimodal chat load on the HTTP door, then the same
load through the gRPC SDK (``benchmarks/http_api/sdk_load.py``), side by side. ``make bench-aiperf`` runs it:

    python -m benchmarks.http_api.aiperf_load --aiperf .venv-aiperf/bin/aiperf --model-dir DIR [--requests 32]
        [--concurrency 4] [--max-tokens 16] [--out benchmarks/results/<timestamp>-aiperf]

AIPerf lives in its own virtual environment (``.venv-aiperf``, made by the Makefile; never the project's) and is run
as a program. The load: ``--requests`` entries of AIPerf's ``single_turn`` JSONL, each a question and one never-seen
448x448 synthetic JPEG (AIPerf sends it as a data: URL), streamed, greedy with ``ignore_eos`` and ``--max-tokens``
output tokens, ``--concurrency`` requests in flight, entries in order. Each client gets a fresh ``serve-local``
(TP1, the defaults), warmed by two requests of its own on other images, so neither finds the other's images in a
cache. Nothing is downloaded: the tokenizer is the model folder, AIPerf's dataset is the local file, and AIPerf
counts output tokens from the server's usage (``--use-server-token-count``).

Output: ``results.md`` (the table, the commands, load averages), ``results.json``, and AIPerf's own artifacts under
``aiperf/`` (``profile_export_aiperf.json``, ``.csv``, ``profile_export.jsonl``, its log).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

from benchmarks.http_api import sdk_load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
SEED = 250_000  # the load's images; the warm-up's are SEED + 10_000 + k
# Metrics of the table: (label, AIPerf's key in profile_export_aiperf.json, sdk_load's key).
METRICS = (
    ("TTFT (ms)", "time_to_first_token"),
    ("ITL = TPOT (ms)", "inter_token_latency"),
    ("request latency (ms)", "request_latency"),
)


class ServeLocal:
    """``mmcast serve-local`` as a child process: started, its READY line read, stopped with SIGTERM."""

    def __init__(self, model_dir: str, log_path: str, ready_timeout: float = 300.0) -> None:
        mmcast = os.path.join(os.path.dirname(sys.executable), "mmcast")
        self.argv = [mmcast, "serve-local", "--model", model_dir, "--port", "0", "--http-port", "0"]
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self.log, text=True)
        deadline = time.monotonic() + ready_timeout
        self.ready: dict = {}
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.write(line)
            if line.startswith("READY "):
                self.ready = json.loads(line[len("READY ") :])
                return
        self.stop()
        raise RuntimeError(f"serve-local did not print READY (log: {log_path})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def aiperf_command(aiperf: str, served: str, base_url: str, model_dir: str, dataset: str, args, out: str) -> list[str]:
    return [aiperf, "profile", "--model", served, "--url", base_url.removesuffix("/v1"), "--endpoint-type", "chat",
            "--streaming", "--tokenizer", model_dir, "--custom-dataset-type", "single_turn", "--input-file", dataset,
            "--dataset-sampling-strategy", "sequential", "--concurrency", str(args.concurrency),
            "--request-count", str(args.requests), "--osl", str(args.max_tokens), "--extra-inputs", "ignore_eos:true",
            "--use-server-token-count", "--random-seed", "0", "--output-artifact-dir", out, "--ui-type", "none",
            "--workers-max", str(args.concurrency), "--record-processors", "1"]  # fmt: skip


def aiperf_env() -> dict[str, str]:
    env = dict(os.environ)
    # No hub at run time. HF_HUB_OFFLINE is *not* set: AIPerf 0.13.0 then looks the tokenizer up as a hub-cache repo id
    # and refuses a local folder (HFValidationError); online, a local path short-circuits its alias lookup and
    # transformers reads the folder without a request. The machine has no route to a hub either way.
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    env.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"})
    return env


def warm_http(base_url: str, served: str, images) -> None:
    import openai

    from benchmarks.http_api.http_overhead import data_url

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    for k in range(2):
        with open(images.path(SEED + 10_000 + k), "rb") as f:
            url = data_url(f.read(), "jpeg")
        client.chat.completions.create(
            model=served,
            max_tokens=4,
            extra_body={"ignore_eos": True},
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Warm up."}],
                }
            ],
        )
    client.close()


def warm_sdk(target: str, images) -> None:
    from mmcast_client.client import Client

    with Client(target, timeout=600) as client:
        for k in range(2):
            client.generate("Warm up.", images=[images.path(SEED + 10_000 + k)], max_tokens=4, ignore_eos=True)


def _cpu_seconds_of_children() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


def measure(args) -> dict:
    from benchmarks.support.scenarios import Images

    os.makedirs(args.out, exist_ok=True)
    images = Images(os.path.join(RESULTS, ".images"), (448, 448))
    dataset = os.path.join(args.out, "load.jsonl")
    entries = sdk_load.write_dataset(dataset, images, args.requests, SEED)
    served = os.path.basename(os.path.normpath(args.model_dir))  # serve-local's default --served-model-name
    out: dict = {
        "settings": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "image": "448x448 jpeg",
            "model": served,
        }
    }

    load0 = [round(x, 2) for x in os.getloadavg()]
    server = ServeLocal(args.model_dir, os.path.join(args.out, "serve-local-http.log"))
    try:
        base_url = server.ready["openai_base_url"]
        warm_http(base_url, served, images)
        cmd = aiperf_command(
            args.aiperf, served, base_url, args.model_dir, dataset, args, os.path.join(args.out, "aiperf")
        )
        out["aiperf_command"] = shlex.join(cmd)
        print(f"[aiperf] {out['aiperf_command']}", file=sys.stderr, flush=True)
        cpu0 = _cpu_seconds_of_children()
        t0 = time.monotonic()
        with open(os.path.join(args.out, "aiperf.log"), "w") as log:
            rc = subprocess.run(
                cmd, env=aiperf_env(), stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
            ).returncode
        out["aiperf_wall_s"] = time.monotonic() - t0
        out["aiperf_cpu_s"] = _cpu_seconds_of_children() - cpu0  # the tool's own processes, on the same 2 cores
        if rc != 0:
            raise RuntimeError(f"aiperf exited {rc}; see {args.out}/aiperf.log")
    finally:
        server.stop()
    with open(os.path.join(args.out, "aiperf", "profile_export_aiperf.json")) as f:
        out["aiperf"] = json.load(f)
    load1 = [round(x, 2) for x in os.getloadavg()]

    server = ServeLocal(args.model_dir, os.path.join(args.out, "serve-local-sdk.log"))
    try:
        warm_sdk(server.ready["target"], images)
        out["sdk"] = sdk_load.run(server.ready["target"], entries, args.concurrency, args.max_tokens)
    finally:
        server.stop()
    out["loadavg"] = {
        "before_aiperf": load0,
        "after_aiperf": load1,
        "after_sdk": [round(x, 2) for x in os.getloadavg()],
    }
    return out


def _fmt(d: dict | None, key: str) -> str:
    v = (d or {}).get(key)
    return "–" if v is None else f"{v:.1f}"


def markdown(result: dict) -> str:
    a, s = result["aiperf"], result["sdk"]
    st = result["settings"]
    lines = [
        f"{st['requests']} requests, each one new {st['image']} and a question, {st['concurrency']} in flight, "
        f"streamed, greedy, `ignore_eos`, {st['max_tokens']} output tokens; model `{st['model']}` (the embedded "
        "tiny Qwen2-VL), TP1, a fresh `serve-local` per client. AIPerf on the OpenAI HTTP door (images as data: "
        "URLs); the SDK on gRPC (images uploaded once, by hash after).",
        "",
        "| metric | AIPerf → HTTP p50 | p90 | p99 | avg | SDK → gRPC p50 | p90 | p99 | avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, key in METRICS:
        x, y = a.get(key), s.get(key)
        lines.append(
            f"| {label} | {_fmt(x, 'p50')} | {_fmt(x, 'p90')} | {_fmt(x, 'p99')} | {_fmt(x, 'avg')} | "
            f"{_fmt(y, 'p50')} | {_fmt(y, 'p90')} | {_fmt(y, 'p99')} | {_fmt(y, 'avg')} |"
        )
    a_rps, a_tps = a["request_throughput"]["avg"], a["output_token_throughput"]["avg"]
    lines += [
        f"| request throughput (req/s) | {a_rps:.2f} | | | | {s['request_throughput']:.2f} | | | |",
        f"| output token throughput (tok/s) | {a_tps:.1f} | | | | {s['output_token_throughput']:.1f} | | | |",
        f"| requests completed / errors | {a['request_count']['avg']:.0f} / "
        f"{sum(e.get('count', 0) for e in a.get('error_summary') or [])} | | | | {s['request_count']} / "
        f"{len(s['errors'])} | | | |",
        "",
        f"AIPerf's own processes used {result['aiperf_cpu_s']:.0f} CPU seconds in {result['aiperf_wall_s']:.0f} s "
        "of wall time on the same 2 cores as the server (the SDK client runs in one process). Load average "
        f"(1, 5, 15 min) before AIPerf {result['loadavg']['before_aiperf']}, after it "
        f"{result['loadavg']['after_aiperf']}, after the SDK run {result['loadavg']['after_sdk']}.",
        "",
        "```bash",
        result["aiperf_command"],
        "```",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.http_api.aiperf_load", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--aiperf", default=os.path.join(ROOT, ".venv-aiperf", "bin", "aiperf"))
    parser.add_argument(
        "--model-dir",
        default=os.path.join(RESULTS, ".model", "mmcast-tiny"),
        help="model folder (mmcast make-tiny-model DIR); its name is the served model name",
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds AIPerf may run")
    parser.add_argument("--out", default=None, help="default benchmarks/results/<timestamp>-aiperf")
    args = parser.parse_args(argv)
    args.model_dir = os.path.abspath(args.model_dir)
    args.out = os.path.abspath(args.out or os.path.join(RESULTS, f"{time.strftime('%Y%m%d-%H%M%S')}-aiperf"))
    if not os.access(args.aiperf, os.X_OK):
        print(f"error: no AIPerf at {args.aiperf} (make bench-aiperf installs it into .venv-aiperf)", file=sys.stderr)
        return 2
    result = measure(args)
    md = markdown(result)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("# AIPerf on the HTTP door beside the SDK on gRPC (issue 24)\n\n" + md + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(md)
    return 0 if result["sdk"]["request_count"] == args.requests and not result["sdk"]["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
