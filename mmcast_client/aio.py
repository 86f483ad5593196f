"""The asyncio client: the same API as `Client`, with coroutines.

    async with AsyncClient("127.0.0.1:50051") as client:
        result = await client.generate("Describe it.", images=["cat.jpg"], max_tokens=64)
        stream = await client.generate(messages, max_tokens=64, stream=True)
        async for delta in stream:
            print(delta.text, end="")
        print(stream.result.usage)

Create it inside the event loop that uses it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Literal, Unpack, overload

import grpc
import grpc.aio

from mmcast.v1 import generation_pb2_grpc as pb_grpc
from mmcast_client import _core
from mmcast_client._core import NOT_GIVEN, ClientOptions, GenerateOptions, NotGiven
from mmcast_client.errors import InvalidArgument
from mmcast_client.types import Delta, Result


class AsyncClient(_core.ClientShell):
    """A connection to one scheduler or several replicas: `await generate(...)`, `upload_image`,
    `get_server_info`; `async with`. Every argument as for `Client` (mmcast_client/client.py); `channel` is a
    `grpc.aio` channel, `interceptors` are `grpc.aio` client interceptors (not with `channel`)."""

    def __init__(
        self, target: str = "", *, channel: grpc.aio.Channel | None = None, **options: Unpack[ClientOptions]
    ) -> None:
        if channel is not None and options.get("interceptors"):
            raise ValueError("interceptors= cannot be added to a grpc.aio channel= already made; make it with them")
        super().__init__(target, channel, options)
        s = self.settings
        interceptors_ = list(s.interceptors) or None
        if channel is not None:
            self._channel = channel
        elif s.credentials is None:
            self._channel = grpc.aio.insecure_channel(s.target, options=s.options, interceptors=interceptors_)
        else:
            self._channel = grpc.aio.secure_channel(
                s.target, s.credentials, options=s.options, interceptors=interceptors_
            )
        self._stub = pb_grpc.GenerationServiceStub(self._channel)

    async def close(self) -> None:
        if self._begin_close():
            await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def get_server_info(self, *, timeout: float | None | NotGiven = NOT_GIVEN) -> _core.ServerInfo:
        deadline = self._core.unary_deadline(timeout)
        request = self._core.server_info_request()
        reply = await self._unary(self._stub.GetServerInfo, request, deadline, self.settings.metadata)
        return _core.ServerInfo.from_proto(reply)

    async def upload_image(
        self,
        image: Any,
        *,
        force: bool = False,
        timeout: float | None | NotGiven = NOT_GIVEN,
        session_id: str | None = None,
    ) -> str:
        """As `Client.upload_image`: returns `"sha256:<hex>"`."""
        deadline = self._core.unary_deadline(timeout)
        ref = await asyncio.to_thread(self.images.resolve, image, "image")
        data = await asyncio.to_thread(self._core.upload_target, ref, force)
        if data is not None:
            await self._upload(ref.sha256, data, deadline, _core.upload_key(ref, session_id))
        return self._core.reference(ref)

    @overload
    async def generate(
        self, messages: str | Sequence[dict], *, stream: Literal[False] = ..., **options: Unpack[GenerateOptions]
    ) -> Result: ...
    @overload
    async def generate(
        self, messages: str | Sequence[dict], *, stream: Literal[True], **options: Unpack[GenerateOptions]
    ) -> AsyncGenerationStream: ...
    @overload
    async def generate(
        self, messages: str | Sequence[dict], *, stream: bool, **options: Unpack[GenerateOptions]
    ) -> Result | AsyncGenerationStream: ...
    async def generate(
        self, messages: str | Sequence[dict], *, stream: bool = False, **options: Unpack[GenerateOptions]
    ) -> Result | AsyncGenerationStream:
        """As `Client.generate`; stream=True returns an AsyncGenerationStream (`async for delta in stream`)."""
        started = time.monotonic()
        # Reading files and encoding PIL images can take tens of milliseconds: keep them off the event loop.
        o = self._core.generate_options(options)
        prepared = await asyncio.to_thread(self._core.prepare_messages, messages, o["images"])
        state = self._core.start_generate(prepared, started, o)
        s = AsyncGenerationStream(self, state)
        if stream:
            return s
        async with s:
            async for _ in s:
                pass
        return s._final()

    async def _unary(self, method: Any, request: Any, deadline: _core.Deadline, metadata: Any) -> Any:
        """One unary (or client-streaming) call; gRPC retries UNAVAILABLE per the channel's retry policy."""
        try:
            return await method(request, **self._core.unary_call(deadline, metadata))
        except grpc.RpcError as e:
            raise self._core.error(e) from None

    async def _upload(self, sha: str, data: bytes, deadline: _core.Deadline, key: str) -> None:
        metadata = self.settings.call_metadata(key)
        try:
            reply = await self._unary(self._stub.UploadImage, _core.upload_chunks(sha, data), deadline, metadata)
        except InvalidArgument as exc:
            if not _core.arrived_altered(exc):
                raise
            reply = await self._unary(self._stub.UploadImage, _core.upload_chunks(sha, data), deadline, metadata)
        self._core.uploaded(sha, reply)


class AsyncGenerationStream(_core.StreamShell):
    """As `GenerationStream`, for `async for`; `.result` after the last delta; `cancel()` stops it early."""

    def __init__(self, client: AsyncClient, state: _core.GenerateState) -> None:
        super().__init__(client, state)
        self._iter = self._run()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        return await self._iter.__anext__()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.result is None:
            self.cancel()
        await self._iter.aclose()

    def cancel(self) -> None:
        self.cancelled = True
        if self._call is not None:
            self._call.cancel()

    def _first_token_overdue(self, call: Any) -> None:
        if self._state.first_token_overdue():
            call.cancel()

    async def _run(self) -> AsyncGenerator[Delta, None]:
        client, state = self._client, self._state
        while True:
            plan = await asyncio.to_thread(state.uploads)
            for sha, data in plan:
                await client._upload(sha, data, state.upload_deadline(), state.key)
            request = await asyncio.to_thread(state.attempt_request)
            if self.cancelled:
                return
            call = self._call = client._stub.Generate(request, **state.generate_call())
            wait = state.first_token_wait()
            timer = (
                None if wait is None else asyncio.get_running_loop().call_later(wait, self._first_token_overdue, call)
            )
            try:
                async for response in call:
                    delta = self._on_response(response)
                    if delta is not None:
                        yield delta
                    elif self.result is not None:
                        await call.code()  # the OK status that follows the final message: the RPC completes normally
                        return
                if self.cancelled:
                    return
                if state.first_token_expired:
                    state.on_error(None)  # raises DeadlineExceeded
                raise state.ended_without_final()
            except asyncio.CancelledError:
                if self.cancelled:
                    return  # our own cancel(): grpc.aio ends the iteration this way
                if state.first_token_expired:
                    state.on_error(None)  # the first-token timer cancelled the call: raises DeadlineExceeded
                raise
            except grpc.RpcError as e:
                if self.cancelled:
                    return
                state.on_error(e)  # raises, unless the request goes again with its images inline
            finally:
                if timer is not None:
                    timer.cancel()
                if self.result is None and not call.done():
                    call.cancel()
