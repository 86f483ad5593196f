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
from typing import Any, Literal, overload

import grpc
import grpc.aio

from mmcast.v1 import generation_pb2_grpc as pb_grpc
from mmcast_client import _core
from mmcast_client._core import NOT_GIVEN, NotGiven
from mmcast_client.errors import InvalidArgument
from mmcast_client.images import ImageStore
from mmcast_client.types import Backoff, Delta, Result


class AsyncClient:
    """A connection to one scheduler or several replicas: `await generate(...)`, `upload_image`,
    `get_server_info`; `async with`. Every argument as for `Client` (mmcast_client/client.py); `channel` is a
    `grpc.aio` channel, `interceptors` are `grpc.aio` client interceptors (not with `channel`)."""

    def __init__(
        self,
        target: str = "",
        *,
        timeout: float | None | NotGiven = NOT_GIVEN,
        first_token_timeout: float | None = _core.DEFAULT_FIRST_TOKEN_TIMEOUT,
        max_message_bytes: int = _core.DEFAULT_MAX_MESSAGE_BYTES,
        retries: int = 3,
        backoff: Backoff | float = Backoff(),
        upload_images: bool = True,
        tls: bool | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        token: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, Any]] = (),
        channel: grpc.aio.Channel | None = None,
        interceptors: Sequence[Any] = (),
        wait_for_ready: bool | None = None,
        image_store: ImageStore | None = None,
    ) -> None:
        if channel is not None and interceptors:
            raise ValueError("interceptors= cannot be added to a grpc.aio channel= already made; make it with them")
        self._core = _core.ClientCore(
            target,
            timeout=timeout,
            first_token_timeout=first_token_timeout,
            max_message_bytes=max_message_bytes,
            retries=retries,
            backoff=backoff,
            upload_images=upload_images,
            tls=tls,
            root_certificates=root_certificates,
            private_key=private_key,
            certificate_chain=certificate_chain,
            token=token,
            metadata=metadata,
            options=options,
            channel=channel,
            interceptors=interceptors,
            wait_for_ready=wait_for_ready,
            image_store=image_store,
        )
        s = self.settings = self._core.settings
        self.images = self._core.images
        self._owns_channel = channel is None
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
        self.closed = False

    @property
    def target(self) -> str:
        return self.settings.target

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._owns_channel:
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
        self,
        messages: str | Sequence[dict],
        *,
        max_tokens: int,
        images: Sequence[Any] | None = ...,
        temperature: float = ...,
        top_p: float | None = ...,
        top_k: int | None = ...,
        seed: int | None = ...,
        stop: str | Sequence[str] | None = ...,
        stop_token_ids: Sequence[int] | None = ...,
        ignore_eos: bool = ...,
        logprobs: int | None = ...,
        return_logprobs: bool | None = ...,
        request_id: str | None = ...,
        cache_salt: str | None = ...,
        continue_final_message: bool = ...,
        stream: Literal[False] = ...,
        timeout: float | None | NotGiven = ...,
        first_token_timeout: float | None | NotGiven = ...,
        session_id: str | None = ...,
    ) -> Result: ...

    @overload
    async def generate(
        self,
        messages: str | Sequence[dict],
        *,
        max_tokens: int,
        images: Sequence[Any] | None = ...,
        temperature: float = ...,
        top_p: float | None = ...,
        top_k: int | None = ...,
        seed: int | None = ...,
        stop: str | Sequence[str] | None = ...,
        stop_token_ids: Sequence[int] | None = ...,
        ignore_eos: bool = ...,
        logprobs: int | None = ...,
        return_logprobs: bool | None = ...,
        request_id: str | None = ...,
        cache_salt: str | None = ...,
        continue_final_message: bool = ...,
        stream: Literal[True],
        timeout: float | None | NotGiven = ...,
        first_token_timeout: float | None | NotGiven = ...,
        session_id: str | None = ...,
    ) -> AsyncGenerationStream: ...

    @overload
    async def generate(
        self,
        messages: str | Sequence[dict],
        *,
        max_tokens: int,
        images: Sequence[Any] | None = ...,
        temperature: float = ...,
        top_p: float | None = ...,
        top_k: int | None = ...,
        seed: int | None = ...,
        stop: str | Sequence[str] | None = ...,
        stop_token_ids: Sequence[int] | None = ...,
        ignore_eos: bool = ...,
        logprobs: int | None = ...,
        return_logprobs: bool | None = ...,
        request_id: str | None = ...,
        cache_salt: str | None = ...,
        continue_final_message: bool = ...,
        stream: bool,
        timeout: float | None | NotGiven = ...,
        first_token_timeout: float | None | NotGiven = ...,
        session_id: str | None = ...,
    ) -> Result | AsyncGenerationStream: ...

    async def generate(
        self,
        messages: str | Sequence[dict],
        *,
        max_tokens: int,
        images: Sequence[Any] | None = None,
        temperature: float = 0.0,
        top_p: float | None = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        return_logprobs: bool | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        continue_final_message: bool = False,
        stream: bool = False,
        timeout: float | None | NotGiven = NOT_GIVEN,
        first_token_timeout: float | None | NotGiven = NOT_GIVEN,
        session_id: str | None = None,
    ) -> Result | AsyncGenerationStream:
        """As `Client.generate`; stream=True returns an AsyncGenerationStream (`async for delta in stream`)."""
        started = time.monotonic()
        # Reading files and encoding PIL images can take tens of milliseconds: keep them off the event loop.
        prepared = await asyncio.to_thread(self._core.prepare_messages, messages, images)
        state = self._core.start_generate(
            prepared,
            started=started,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            return_logprobs=return_logprobs,
            request_id=request_id,
            cache_salt=cache_salt,
            continue_final_message=continue_final_message,
            timeout=timeout,
            first_token_timeout=first_token_timeout,
            session_id=session_id,
        )
        s = AsyncGenerationStream(self, state)
        if stream:
            return s
        async with s:
            async for _ in s:
                pass
        if s.result is None:
            raise _core.no_final_error(s.request_id)
        return s.result

    async def _unary(self, method: Any, request: Any, deadline: _core.Deadline, metadata: Any) -> Any:
        """One unary (or client-streaming) call; gRPC retries UNAVAILABLE per the channel's retry policy."""
        try:
            return await method(
                request, timeout=deadline.remaining(), metadata=metadata, wait_for_ready=self.settings.wait_for_ready
            )
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


class AsyncGenerationStream:
    """As `GenerationStream`, for `async for`; `.result` after the last delta; `cancel()` stops it early."""

    def __init__(self, client: AsyncClient, state: _core.GenerateState) -> None:
        self.request_id = state.request_id
        self.affinity_key = state.key  # the x-mmcast-affinity value its calls carry
        self.result: Result | None = None
        self.cancelled = False
        self._client = client
        self._state = state
        self._call: Any = None
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
            call = client._stub.Generate(
                request,
                timeout=state.call_timeout(),
                metadata=state.metadata,
                wait_for_ready=client.settings.wait_for_ready,
            )
            self._call = call
            wait = state.first_token_wait()
            timer = (
                None if wait is None else asyncio.get_running_loop().call_later(wait, self._first_token_overdue, call)
            )
            try:
                async for response in call:
                    out = state.on_response(response)
                    if isinstance(out, Delta):
                        yield out
                    elif isinstance(out, Result):
                        self.result = out
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
