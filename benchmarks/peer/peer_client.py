"""The one client of the side-by-side benchmark (``benchmarks/peer/compare.py``): the ``openai`` package, streaming, against
any OpenAI-compatible base URL. Both engines get the same bytes from the same code, so what differs is the server.

TTFT is the time from the call to the first chunk that carries content (a role-only first chunk does not count);
inter-token latencies are the gaps between content chunks; token counts come from the final usage chunk
(``stream_options.include_usage``), as do the prompt and cached-prompt token counts.

Videos travel as vLLM takes them: a ``video_url`` part holding a ``data:video/mp4;base64,...`` URL, the sampling in
the body (``VIDEO_BODY``): ``mm_processor_kwargs`` ``{"fps": ...}`` (what transformers' video processor reads;
mmcast reads it too) and ``media_io_kwargs`` ``{"video": {"fps": ...}}``, which is where vLLM 0.32's video loader
takes its sampling rate from (it samples the frames before the processor sees them and ignores the processor's
fps; mmcast reads this key as well), so both engines are asked for the same frames the same way.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time

# A ``texts`` key under this prefix holds a reply the client stopped early (``Client.stream_lean``'s ``stop``): the
# engines' texts are compared up to the shorter one (``peer_report.agreement``).
PREFIX_KEY = "prefix/"
ANSWER = "I see the pictures."  # the assistant's fixed reply in every history: both engines see the same prompts
_QUESTION_WORDS = ("which", "colour", "is", "the", "sky", "there", "now")


def question(i: int) -> str:
    """The i-th of the permutations of one word set: distinct questions of equal token length (both engines
    tokenize with the checkpoint's tokenizer, which splits on spaces)."""
    import itertools

    perms = itertools.islice(itertools.permutations(_QUESTION_WORDS), i, i + 1)
    return " ".join(next(perms))


def image_part(jpeg: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()}}


VIDEO_FPS = 2.0  # frames sampled per second of video, on both engines


def video_part(mp4: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()}}


def video_body(fps: float = VIDEO_FPS) -> dict:
    """The request body's video sampling, the same for both engines (see the module docstring)."""
    return {"mm_processor_kwargs": {"fps": fps}, "media_io_kwargs": {"video": {"fps": fps}}}


def user(images: list[dict], text: str) -> dict:
    return {"role": "user", "content": [*images, {"type": "text", "text": text}]}


def assistant(text: str = ANSWER) -> dict:
    return {"role": "assistant", "content": text}


@dataclasses.dataclass
class Reply:
    ttft_ms: float
    e2e_ms: float
    text: str
    chunk_ms: list[float]  # content chunk arrival times from the call, ms
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    sent_at: float = 0.0  # monotonic time of the call (the load workload's clock)
    stopped: bool = False  # the client closed the stream early (``stream_lean``'s ``stop``): counts are the chunks seen

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first (e2e - TTFT over the remaining tokens)."""
        if self.completion_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.completion_tokens - 1)

    @property
    def itl_ms(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_ms, self.chunk_ms[1:], strict=False)]


class Client:
    """One AsyncOpenAI client per engine; greedy (temperature 0), a fixed number of tokens (``ignore_eos``, which
    both vLLM and mmcast take in the request body)."""

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        import httpx
        import openai

        self._client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", timeout=timeout)  # ``stream_lean``
        self.model: str | None = None

    async def resolve_model(self) -> str:
        if self.model is None:
            self.model = (await self._client.models.list()).data[0].id
        return self.model

    async def chat(
        self, messages: list[dict], max_tokens: int, first: asyncio.Event | None = None, extra: dict | None = None
    ) -> Reply:
        """One streamed request; ``first`` (optional) is set when its first content chunk arrives, so a workload
        can start something else while this request is decoding (the burst workload); ``extra``: more of the
        request body (the video sampling, ``video_body``)."""
        model = await self.resolve_model()
        t0 = time.monotonic()
        chunks: list[float] = []
        parts: list[str] = []
        usage = None
        stream = await self._client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **(extra or {})})  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks.append((time.monotonic() - t0) * 1e3)
                parts.append(chunk.choices[0].delta.content)
                if first is not None:
                    first.set()
            if chunk.usage is not None:
                usage = chunk.usage
        e2e = (time.monotonic() - t0) * 1e3
        if not chunks or usage is None:
            raise RuntimeError(f"stream ended without content or usage (chunks {len(chunks)}, usage {usage})")
        details = usage.prompt_tokens_details
        return Reply(
            chunks[0],
            e2e,
            "".join(parts),
            chunks,
            usage.prompt_tokens,
            details.cached_tokens if details is not None else None,
            usage.completion_tokens,
            t0,
        )

    async def stream_lean(
        self, messages: list[dict], max_tokens: int, first: asyncio.Event, stop: asyncio.Event
    ) -> Reply:
        """``chat`` with ``first`` and ``stop`` for long decodes streamed beside other work (the burst): the same
        request body, the server-sent events read as lines and parsed with ``json.loads`` instead of the
        ``openai`` package's typed chunks. Eight streams of an engine at ~2.6 ms a token are ~3,000 chunks a
        second, which the typed path cannot parse beside the server on 2 cores: its backlog held the benchmark's
        event loop for tens of seconds, so the burst was sent only after the decodes had ended."""
        import json

        model = await self.resolve_model()
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
        t0 = time.monotonic()
        chunks: list[float] = []
        parts: list[str] = []
        usage = None
        async with self._http.stream("POST", "chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                choices = event.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    chunks.append((time.monotonic() - t0) * 1e3)
                    parts.append(choices[0]["delta"]["content"])
                    first.set()
                    if stop.is_set():  # leaving the block closes the stream: the server sees the client go
                        e2e = (time.monotonic() - t0) * 1e3
                        return Reply(chunks[0], e2e, "".join(parts), chunks, 0, None, len(chunks), t0, stopped=True)
                if event.get("usage"):
                    usage = event["usage"]
        e2e = (time.monotonic() - t0) * 1e3
        if not chunks or usage is None:
            raise RuntimeError(f"stream ended without content or usage (chunks {len(chunks)}, usage {usage})")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return Reply(chunks[0], e2e, "".join(parts), chunks, usage["prompt_tokens"], cached,
                     usage["completion_tokens"], t0)  # fmt: skip

    async def close(self) -> None:
        await self._client.close()
        await self._http.aclose()
