"""How the SDK reads to a type checker: `make lint` runs mypy on this file (pyproject.toml [tool.mypy]).

Never executed: every `assert_type` states what a user's editor and checker infer, and mypy fails when the SDK's
annotations stop saying it (a `generate` that returned `Result | GenerationStream` for every call would fail here).
"""

from __future__ import annotations

from typing import assert_type

from mmcast_client import (
    AsyncClient,
    AsyncGenerationStream,
    Client,
    Delta,
    FieldViolation,
    GenerationStream,
    MmcastError,
    ResourceInfo,
    Result,
    ServerInfo,
    TokenLogprob,
)


def sync_usage(client: Client, flag: bool) -> None:
    assert_type(client.generate("Describe it.", max_tokens=8), Result)
    assert_type(client.generate("Describe it.", max_tokens=8, stream=False), Result)
    assert_type(client.generate("Describe it.", max_tokens=8, top_k=40, top_p=0.9, temperature=0.7), Result)
    stream = client.generate("Describe it.", max_tokens=8, stream=True, logprobs=2, top_k=None)
    assert_type(stream, GenerationStream)
    for delta in stream:
        assert_type(delta, Delta)
        assert_type(delta.logprobs, tuple[TokenLogprob, ...])
    assert_type(stream.result, Result | None)
    # A flag known only at run time gives the union, as it must.
    assert_type(client.generate("x", max_tokens=1, stream=flag), Result | GenerationStream)
    assert_type(client.get_server_info(timeout=None), ServerInfo)
    assert_type(client.upload_image(b"...", timeout=5.0), str)


async def async_usage(client: AsyncClient, flag: bool) -> None:
    assert_type(await client.generate("Describe it.", max_tokens=8), Result)
    assert_type(await client.generate("Describe it.", max_tokens=8, stream=False), Result)
    stream = await client.generate("Describe it.", max_tokens=8, stream=True, first_token_timeout=None, top_k=5)
    assert_type(stream, AsyncGenerationStream)
    async for delta in stream:
        assert_type(delta, Delta)
    assert_type(await client.generate("x", max_tokens=1, stream=flag), Result | AsyncGenerationStream)
    assert_type(await client.get_server_info(), ServerInfo)


def error_usage(client: Client) -> None:
    try:
        client.generate("x", max_tokens=1)
    except MmcastError as e:
        assert_type(e.field_violations, list[FieldViolation])
        assert_type(e.retry_delay, float | None)
        assert_type(e.resource_info, ResourceInfo | None)
        for field, description in e.field_violations:
            assert_type(field, str)
            assert_type(description, str)
