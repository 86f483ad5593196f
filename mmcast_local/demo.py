"""`mmcast demo`: a growing multi-image conversation on a local group, showing what the prefix cache saves.

Each turn resends the whole conversation (as chat clients do) plus one new synthetic 1280x720 JPEG and a question.
The images of earlier turns are covered by the prefix cache, so `strip`/`lazy` broadcast only the new image's
payload, while `full` would broadcast every image of the context again; both numbers come from the same run's
usage counters (broadcast, and broadcast + saved).
"""

from __future__ import annotations

import sys
import time

from mmcast_local.progress import Progress, human_bytes

QUESTIONS = (
    "What is in this picture?",
    "How does this one differ from the previous picture?",
    "Where is the sun in this picture?",
    "Describe the hills here.",
    "Which picture so far has the most clouds?",
    "What colours stand out in this one?",
    "Is this scene brighter than the first?",
    "Summarise all the pictures so far.",
)


HEADER = (
    f"{'turn':>4} {'images':>6} {'prompt tok':>10} {'cached tok':>10} {'TTFT':>9} "
    f"{'broadcast':>11} {'full would':>11} {'saved':>6}"
)


def format_row(turn: int, result) -> str:
    u = result.usage
    full = u.payload_bytes_full
    saved = f"{100 * u.payload_bytes_saved / full:.0f}%" if full else "-"
    return (
        f"{turn:>4} {u.images:>6} {u.prompt_tokens:>10} {u.cached_tokens:>10} {result.ttft_seconds * 1000:>7.0f}ms "
        f"{human_bytes(u.payload_bytes_broadcast):>11} {human_bytes(full):>11} {saved:>6}"
    )


def conversation_turns(turns: int, seed: int):
    """(question, jpeg bytes) per turn; the images are deterministic from `seed`."""
    from mmcast_local.synthetic_images import synthetic_jpeg

    for i in range(turns):
        yield QUESTIONS[i % len(QUESTIONS)], synthetic_jpeg(seed * 100003 + i)


def run_conversation(client, turns: int, seed: int, max_tokens: int, progress: Progress | None = None):
    """Runs the growing conversation; yields (turn, Result) as each turn finishes."""
    history: list[dict] = []
    for turn, (question, jpeg) in enumerate(conversation_turns(turns, seed), start=1):
        if progress:
            progress.update(turn - 1, f"turn {turn}: {len(history) // 2 + 1} image(s) in context")
        history.append(
            {"role": "user", "content": [{"type": "image", "image": jpeg}, {"type": "text", "text": question}]}
        )
        result = client.generate(history, max_tokens=max_tokens, temperature=0.0, seed=seed)
        history.append({"role": "assistant", "content": result.text})
        if progress:
            progress.update(turn)
        yield turn, result


def run_demo(
    *,
    tp: int = 2,
    turns: int = 8,
    transfer_mode: str = "lazy",
    model_dir: str,
    max_tokens: int = 16,
    seed: int = 0,
    target: str | None = None,
    video: bool = False,
) -> int:
    """``video``: the video demo (mmcast_local/video_demo.py) instead of the image conversation."""
    import contextlib

    from mmcast_client import Client, MmcastError

    if turns < 1:
        print(f"error: --turns={turns} must be >= 1", file=sys.stderr)
        return 2
    own_group = target is None
    with Progress(turns) as progress, contextlib.ExitStack() as stack:
        if own_group:
            progress.update(0, f"building the tiny model in {model_dir} (if absent)")
            from common.tiny_model import ensure_tiny_model

            model_dir = str(ensure_tiny_model(model_dir, replace_stale=True))
            from mmcast_local.supervisor import LocalGroup

            progress.update(0, f"starting a local group: 1 scheduler + {tp} rank(s), transfer mode {transfer_mode}")
            started = time.monotonic()
            group = stack.enter_context(LocalGroup(model_dir, tp, transfer_mode))
            target = group.target
            progress.print(
                f"local group ready in {time.monotonic() - started:.1f} s: scheduler {target}, "
                f"TP={tp}, transfer mode {transfer_mode}, model {model_dir}"
            )
        client = stack.enter_context(Client(target, timeout=600))
        if video:
            from mmcast_local.video_demo import run_video_demo

            progress.total = 0  # the tables are the progress
            return run_video_demo(client, turns=turns, max_tokens=max_tokens, seed=seed, progress=progress)
        progress.print(HEADER)
        last = None
        total_broadcast = total_full = 0
        try:
            for turn, result in run_conversation(client, turns, seed, max_tokens, progress):
                progress.print(format_row(turn, result))
                total_broadcast += result.usage.payload_bytes_broadcast
                total_full += result.usage.payload_bytes_full
                last = result
        except MmcastError as e:
            progress.clear()
            print(f"error: {e}", file=sys.stderr)
            return 1
        progress.clear()
        print(
            f"payload broadcast over {turns} turns: {human_bytes(total_broadcast)} "
            f"(the full transfer mode: {human_bytes(total_full)})"
        )
        print(f"answer of turn {turns}: {last.text!r}" if last else "no answer", flush=True)
        if own_group:
            progress.update(turns, "stopping the local group")
    return 0
