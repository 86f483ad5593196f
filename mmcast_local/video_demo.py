"""`mmcast demo --video`: the two video workloads on a local group, with what each turn costs.

1. **Video agent**: one synthetic clip, re-read every turn with a new question. From turn 2 the clip's tokens are
   in the prefix cache: its file travels to no rank and no encoder runs.
2. **Live stream** (exact mode): each turn appends the stream's next segment (its own MP4 file, 2 s) and keeps
   the last ``window`` segments; the prompt is rebuilt from the retained segments. Once the window slides, the
   prompt's prefix changes, so the prefix cache misses from the first segment on — yet the retained segments cost
   no payload and no encoder run, because every rank still holds their encoder outputs (keyed by identifier).
   Only the new segment's file travels, once, to the rank that encodes it.
3. **Live stream** (live mode, ``live=``): the same stream as a live session keeping the last ``window`` turns.
   Each turn sends only its new segment and question; the server keeps the session's KV and evicts the oldest
   turn in place, so a turn's prefill is its own tokens only (cached tokens: the retained ones). The answers
   differ from exact mode's: kept turns keep the KV and positions they were computed with.

The table's counters are the server's usage of each request: prompt and cached tokens, TTFT, payload bytes
broadcast (and what `full` would have broadcast), encoder runs.
"""

from __future__ import annotations

import sys

from mmcast_local.progress import Progress, human_bytes

AGENT_QUESTIONS = (
    "What happens in this video?",
    "Which way does the camera move?",
    "What colours dominate the clip?",
    "Is there a sun in the sky?",
)
STREAM_QUESTION = "What is new in the latest segment?"

HEADER = (
    f"{'turn':>4} {'videos':>6} {'prompt tok':>10} {'cached tok':>10} {'TTFT':>9} "
    f"{'broadcast':>11} {'full would':>11} {'encoder runs':>12}"
)


def format_row(turn: int, result) -> str:
    u = result.usage
    return (
        f"{turn:>4} {u.videos:>6} {u.prompt_tokens:>10} {u.cached_tokens:>10} {result.ttft_seconds * 1000:>7.0f}ms "
        f"{human_bytes(u.payload_bytes_broadcast):>11} {human_bytes(u.payload_bytes_full):>11} {u.encoder_runs:>12}"
    )


def agent_turns(client, *, seed: int, turns: int, fps: float, max_tokens: int):
    """The video agent: yields (turn, Result)."""
    from mmcast_local.synthetic_video import synthetic_clip

    clip = synthetic_clip(seed, seconds=4.0)
    history: list[dict] = []
    for turn in range(1, turns + 1):
        question = AGENT_QUESTIONS[(turn - 1) % len(AGENT_QUESTIONS)]
        content: list[dict] = [{"type": "text", "text": question}]
        if turn == 1:
            content.insert(0, {"type": "video", "video": clip, "fps": fps})
        history.append({"role": "user", "content": content})
        result = client.generate(history, max_tokens=max_tokens, temperature=0.0, seed=seed)
        history.append({"role": "assistant", "content": result.text})
        yield turn, result


def stream_turns(client, *, seed: int, turns: int, window: int, fps: float, max_tokens: int):
    """The live stream in exact mode: turn k sends segments max(0, k - window) .. k - 1; yields (turn, Result)."""
    from mmcast_local.synthetic_video import stream_segment

    segments: list[bytes] = []
    for turn in range(1, turns + 1):
        segments.append(stream_segment(seed + 1, turn - 1))
        kept = segments[-window:]
        content: list[dict] = [{"type": "video", "video": s, "fps": fps} for s in kept]
        content.append({"type": "text", "text": STREAM_QUESTION})
        messages = [{"role": "user", "content": content}]
        yield turn, client.generate(messages, max_tokens=max_tokens, temperature=0.0, seed=seed)


def live_turns(client, *, seed: int, turns: int, window: int, fps: float, max_tokens: int):
    """The live stream as a live session: turn k sends segment k - 1 only; yields (turn, Result)."""
    from mmcast_local.synthetic_video import stream_segment

    for turn in range(1, turns + 1):
        content = [
            {"type": "video", "video": stream_segment(seed + 1, turn - 1), "fps": fps},
            {"type": "text", "text": STREAM_QUESTION},
        ]
        yield (
            turn,
            client.generate(
                [{"role": "user", "content": content}],
                max_tokens=max_tokens,
                temperature=0.0,
                seed=seed,
                session_id=f"demo-live-{seed}",
                live={"keep_turns": window, "close": turn == turns},
            ),
        )


def run_video_demo(
    client, *, turns: int, window: int = 3, fps: float = 2.0, max_tokens: int = 16, seed: int = 0, progress=None
) -> int:
    """Prints both tables; returns the process exit status."""
    from mmcast_client import MmcastError

    progress = progress or Progress(0)
    try:
        progress.print("video agent: one 4 s clip (320x180, 8 fps) sampled at 2 fps, a new question each turn")
        progress.print(HEADER)
        last = None
        for turn, result in agent_turns(client, seed=seed, turns=turns, fps=fps, max_tokens=max_tokens):
            progress.print(format_row(turn, result))
            last = result
        progress.print(f"answer of turn {turns}: {last.text!r}" if last else "no answer")
        progress.print("")
        progress.print(f"live stream: a new 2 s segment each turn, the last {window} kept (exact mode)")
        progress.print(HEADER)
        sent = runs = 0
        for turn, result in stream_turns(
            client, seed=seed, turns=turns + window, window=window, fps=fps, max_tokens=max_tokens
        ):
            progress.print(format_row(turn, result))
            sent += result.usage.payload_bytes_broadcast
            runs += result.usage.encoder_runs
        progress.print(
            f"stream: {turns + window} segments, {runs} encoder runs over the group, "
            f"{human_bytes(sent)} of payload broadcast in all"
        )
        progress.print("")
        progress.print(f"live stream, live mode: the same segments, one per turn; the session keeps {window} turns")
        progress.print(f"{HEADER} {'evicted':>7} {'kept tok':>8}")
        computed = 0
        for turn, result in live_turns(
            client, seed=seed, turns=turns + window, window=window, fps=fps, max_tokens=max_tokens
        ):
            live = result.live or {}
            progress.print(f"{format_row(turn, result)} {live.get('evicted_turns', 0):>7} {live.get('tokens', 0):>8}")
            computed += result.usage.prompt_tokens - result.usage.cached_tokens
        progress.print(f"live mode: {computed} prompt tokens computed in all (exact mode recomputes each window)")
    except MmcastError as e:
        progress.clear()
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
