"""Peak resident memory of a rank against one plain transformers process, on the demo conversation:
``python -m benchmarks.rank.rank_memory [--tps 1,2,4] [--out DIR]`` (also part of ``make bench``).

The model is the real-width 2-layer Qwen2-VL checkpoint (``common.tiny_model``, ``width="real"``: Qwen2-VL-2B's
widths, random weights, float32, built once under ``benchmarks/results/.model``). The conversation is ``mmcast
demo``'s (``mmcast_local/demo.py``: 8 turns, one new 1280x720 JPEG per turn, the whole history resent, 16 greedy
tokens a turn). For each TP size a local group (default ``--kv-blocks``, transfer mode ``lazy`` as the demo) serves
it; afterwards every rank's ``VmHWM`` (peak RSS) and ``VmRSS`` are read from ``/proc/<pid>/status``. The reference is
one process that loads the same folder with ``AutoModelForImageTextToText.from_pretrained`` and runs
``generate`` on each turn's whole history (the served answers as the assistant turns), as a user of plain
transformers would; its tokens are compared with the served ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.support.proc_memory import status_mib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = os.path.join(ROOT, "benchmarks", "results", ".model", "qwen2_vl-real-width")
TURNS, MAX_TOKENS, SEED = 8, 16, 0  # mmcast demo's defaults


def demo_images(directory: str) -> list[str]:
    """The demo conversation's JPEGs, written to ``directory``."""
    from mmcast_local.demo import conversation_turns

    paths = []
    for i, (_, jpeg) in enumerate(conversation_turns(TURNS, SEED)):
        path = os.path.join(directory, f"turn{i + 1}.jpg")
        with open(path, "wb") as f:
            f.write(jpeg)
        paths.append(path)
    return paths


def serve(model_dir: str, tp: int, images: list[str]) -> dict:
    """Runs the demo conversation on a fresh local group; returns the answers, tokens and every process's memory."""
    from mmcast_client.client import Client
    from mmcast_local.demo import QUESTIONS
    from mmcast_local.supervisor import LocalGroup

    history: list[dict] = []
    answers, tokens = [], []
    # the pool of 1,024 blocks the figures were taken with, not one sized from free memory (a fixed share of RAM)
    with (
        LocalGroup(model_dir, tp=tp, transfer_mode="lazy", kv_blocks=1024) as group,
        Client(group.target, timeout=900) as client,
    ):
        for turn, path in enumerate(images):
            history.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": path},
                        {"type": "text", "text": QUESTIONS[turn % len(QUESTIONS)]},
                    ],
                }
            )
            result = client.generate(history, max_tokens=MAX_TOKENS, temperature=0.0, seed=SEED)
            history.append({"role": "assistant", "content": result.text})
            answers.append(result.text)
            tokens.append(list(result.token_ids))
        memory = {name: status_mib(pid) for name, pid in group.pids().items() if pid}
    return {"answers": answers, "tokens": tokens, "memory": memory}


def plain_transformers(model_dir: str, images: list[str], answers: list[str]) -> dict:
    """Runs the same conversation in a fresh process with plain transformers; returns its tokens and memory."""
    spec = json.dumps({"model_dir": model_dir, "images": images, "answers": answers})
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.rank.rank_memory", "--plain", spec],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    if done.returncode != 0:
        raise RuntimeError(f"the plain transformers process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _plain_main(spec: dict) -> None:
    """The reference process (``--plain``): the conversation as a user of transformers would run it."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.image_utils import load_image

    from common.processor import load_processor
    from mmcast_local.demo import QUESTIONS

    processor = load_processor(spec["model_dir"])
    model = AutoModelForImageTextToText.from_pretrained(spec["model_dir"]).eval()
    loaded = status_mib()
    history: list[dict] = []
    tokens = []
    for turn in range(len(spec["images"])):
        history.append(
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[turn % len(QUESTIONS)]}]}
        )
        text = processor.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=[load_image(p) for p in spec["images"][: turn + 1]], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        tokens.append(out[0, inputs["input_ids"].shape[1] :].tolist())
        history.append({"role": "assistant", "content": spec["answers"][turn]})
    print(json.dumps({"tokens": tokens, "memory": status_mib(), "after_load": loaded}))


def measure(tps: list[int], model_dir: str = MODEL_DIR, log=print) -> dict:
    from common.tiny_model import ensure_tiny_model

    model_dir = str(ensure_tiny_model(model_dir, width="real", replace_stale=True))
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmcast-rank-memory-") as tmp:
        images = demo_images(tmp)
        plain = None
        for tp in tps:
            t0 = time.monotonic()
            served = serve(model_dir, tp, images)
            log(f"rank memory: TP={tp} served in {time.monotonic() - t0:.0f} s: {served['memory']}")
            if plain is None:  # one reference: the served answers are the history it replays
                plain = plain_transformers(model_dir, images, served["answers"])
                log(f"rank memory: plain transformers {plain['memory']}")
            ranks = {k: v for k, v in served["memory"].items() if k.startswith("rank")}
            rows.append({
                "tp": tp,
                "rank_peak_mib": max(v["VmHWM"] for v in ranks.values()),
                "rank_rss_after_mib": max(v["VmRSS"] for v in ranks.values()),
                "scheduler_peak_mib": served["memory"].get("scheduler", {}).get("VmHWM"),
                "plain_peak_mib": plain["memory"]["VmHWM"],
                "plain_after_load_mib": plain["after_load"]["VmRSS"],
                "ranks": ranks,
                # the first turn has no earlier answer in its history: its tokens must match exactly
                "first_turn_tokens_equal": served["tokens"][0] == plain["tokens"][0],
                "tokens_equal": served["tokens"] == plain["tokens"],
            })  # fmt: skip
    return {"model_dir": model_dir, "turns": TURNS, "max_tokens": MAX_TOKENS, "rows": rows}


def table(result: dict) -> str:
    lines = [
        "| TP | rank peak RSS | rank RSS after | plain transformers peak | rank / plain | tokens equal |",
        "|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['tp']} | {r['rank_peak_mib']:,.0f} MiB | {r['rank_rss_after_mib']:,.0f} MiB | "
            f"{r['plain_peak_mib']:,.0f} MiB | {r['rank_peak_mib'] / r['plain_peak_mib']:.2f} | "
            f"{'yes' if r['tokens_equal'] else 'no'} |"
        )
    return "\n".join(lines)


def write(out_dir: str, result: dict) -> str:
    """Writes rank_memory.md, rank_memory.json and (with matplotlib) rank_memory.png; returns the table."""
    os.makedirs(out_dir, exist_ok=True)
    md = table(result)
    with open(os.path.join(out_dir, "rank_memory.md"), "w") as f:
        f.write("# Rank peak RSS, demo conversation, real-width 2-layer Qwen2-VL (float32)\n\n" + md + "\n")
    with open(os.path.join(out_dir, "rank_memory.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return md
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["rank_peak_mib"] for r in rows], 0.4, label="rank peak RSS")
    ax.bar([x + 0.2 for x in xs], [r["plain_peak_mib"] for r in rows], 0.4, label="plain transformers peak")
    ax.set_xticks(list(xs), [f"TP={r['tp']}" for r in rows])
    ax.set_ylabel("MiB")
    ax.set_title("Demo conversation, real-width 2-layer Qwen2-VL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "rank_memory.png"), dpi=120)
    plt.close(fig)
    return md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rank.rank_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tps", default="1,2,4", help="comma-separated TP sizes (default 1,2,4)")
    parser.add_argument("--model-dir", default=MODEL_DIR, help="real-width checkpoint folder (built if missing)")
    parser.add_argument("--out", help="folder for rank_memory.md/.json/.png")
    parser.add_argument("--plain", help=argparse.SUPPRESS)  # internal: run the reference process
    args = parser.parse_args(argv)
    if args.plain:
        _plain_main(json.loads(args.plain))
        return 0
    result = measure([int(t) for t in args.tps.split(",")], args.model_dir, log=lambda m: print(m, file=sys.stderr))
    print(write(args.out, result) if args.out else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
