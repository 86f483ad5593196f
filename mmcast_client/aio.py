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
import warnings
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio

from mmcast.v1 import generation_pb2 as pb
from mmcast.v1 import generation_pb2_grpc as pb_grpc
from mmcast_client import _core, affinity
from mmcast_client.errors import NotFound, from_rpc_error
from mmcast_client.images import SHA_PREFIX, ImageStore
from mmcast_client.messages import Prepared, normalize, prepare
from mmcast_client.types import Backoff, Delta, Result


class AsyncClient:
    """A connection to one scheduler or several replicas: `await generate(...)`, `upload_image`,
    `get_server_info`; `async with`. `options`, `channel` (a `grpc.aio` channel), `interceptors` (`grpc.aio`
    client interceptors; not with `channel`) and `wait_for_ready` as for `Client`."""

    def __init__(
        self,
        target: str = "",
        *,
        timeout: float | None = None,
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
    ) -> None:
        if channel is not None and interceptors:
            raise ValueError("interceptors= cannot be added to a grpc.aio channel= already made; make it with them")
        self.settings = _core.channel_settings(
            target,
            timeout=timeout,
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
            wait_for_ready=wait_for_ready,
            interceptors=interceptors,
            channel=channel,
        )
        s = self.settings
        self._owns_channel = channel is None
        interceptors_ = list(s.interceptors) or None
        if channel is not None:
            warnings.warn(affinity.OWN_CHANNEL_WARNING, UserWarning, stacklevel=2)
            self._channel = channel
        elif s.credentials is None:
            self._channel = grpc.aio.insecure_channel(s.target, options=s.options, interceptors=interceptors_)
        else:
            self._channel = grpc.aio.secure_channel(
                s.target, s.credentials, options=s.options, interceptors=interceptors_
            )
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self.images = ImageStore()
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

    async def get_server_info(self, *, timeout: float | None = None) -> _core.ServerInfo:
        deadline = _core.Deadline(self._timeout(timeout))
        s = self.settings
        reply = await self._unary(
            lambda t: self._stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=t, metadata=s.metadata, wait_for_ready=s.wait_for_ready
            ),
            deadline,
        )
        return _core.ServerInfo.from_proto(reply)

    async def upload_image(
        self, image: Any, *, force: bool = False, timeout: float | None = None, session_id: str | None = None
    ) -> str:
        """As `Client.upload_image`: returns `"sha256:<hex>"`."""
        deadline = _core.Deadline(self._timeout(timeout))
        ref = await asyncio.to_thread(self.images.resolve, image, "image")
        key = _core.upload_key(ref, session_id)
        if force or not self.images.is_held(ref.sha256):
            data = await asyncio.to_thread(self.images.load, ref)
            if data is None:
                raise NotFound(message=f"sha256:{ref.sha256}: this client has no bytes for it to upload")
            await self._upload(ref.sha256, data, deadline, key)
        return SHA_PREFIX + ref.sha256

    async def generate(
        self,
        messages: str | Sequence[dict],
        *,
        max_tokens: int,
        images: Sequence[Any] | None = None,
        temperature: float = 0.0,
        top_p: float | None = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int = 0,
        return_logprobs: bool = False,
        request_id: str | None = None,
        cache_salt: str | None = None,
        continue_final_message: bool = False,
        stream: bool = False,
        timeout: float | None = None,
        session_id: str | None = None,
    ) -> Result | AsyncGenerationStream:
        """As `Client.generate`; stream=True returns an AsyncGenerationStream (`async for delta in stream`)."""
        started = time.monotonic()
        deadline = _core.Deadline(self._timeout(timeout))
        # Reading files and encoding PIL images can take tens of milliseconds: keep them off the event loop.
        prepared = await asyncio.to_thread(lambda: prepare(normalize(messages, images), self.images))
        key = _core.affinity_key(prepared, session_id)
        request = pb.GenerateRequest(
            request_id=request_id or _core.new_request_id(),
            sampling=_core.sampling_params(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                stop=stop,
                stop_token_ids=stop_token_ids,
                ignore_eos=ignore_eos,
                logprobs=logprobs,
                return_logprobs=return_logprobs,
            ),
            cache_salt=cache_salt or "",
            continue_final_message=continue_final_message,
        )
        s = AsyncGenerationStream(self, prepared, request, deadline, started, key)
        if stream:
            return s
        async with s:
            async for _ in s:
                pass
        if s.result is None:
            raise _core.no_final_error(s.request_id)
        return s.result

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.settings.timeout

    async def _unary(self, call, deadline: _core.Deadline):
        retry = _core.RetryState(self.settings, deadline)
        while True:
            try:
                return await call(deadline.remaining())
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                action = retry.on_error(error, tokens_seen=False, inlinable=lambda: False)
                if action == "raise":
                    raise error from None
                await asyncio.sleep(action)

    async def _upload(self, sha: str, data: bytes, deadline: _core.Deadline, key: str) -> None:
        s = self.settings
        reply = await self._unary(
            lambda t: self._stub.UploadImage(
                _core.upload_chunks(sha, data),
                timeout=t,
                metadata=s.call_metadata(key),
                wait_for_ready=s.wait_for_ready,
            ),
            deadline,
        )
        _core.check_upload(sha, reply)
        self.images.mark_held(sha)

    async def _upload_missing(self, prepared: Prepared, deadline: _core.Deadline, key: str) -> None:
        plan = await asyncio.to_thread(_core.upload_plan, prepared, self.images)
        for sha, data in plan:
            await self._upload(sha, data, deadline, key)


class AsyncGenerationStream:
    """As `GenerationStream`, for `async for`; `.result` after the last delta; `cancel()` stops it early."""

    def __init__(
        self,
        client: AsyncClient,
        prepared: Prepared,
        request: pb.GenerateRequest,
        deadline: _core.Deadline,
        started: float,
        key: str,
    ) -> None:
        self.request_id = request.request_id
        self.affinity_key = key  # the x-mmcast-affinity value its calls carry
        self.result: Result | None = None
        self.cancelled = False
        self._client = client
        self._prepared = prepared
        self._request = request
        self._deadline = deadline
        self._acc = _core.Accumulator(request.request_id, started)
        self._call: grpc.aio.UnaryStreamCall | None = None
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

    async def _run(self) -> AsyncIterator[Delta]:
        client, settings = self._client, self._client.settings
        retry = _core.RetryState(settings, self._deadline)
        metadata = settings.call_metadata(self.affinity_key)
        inline: list[pb.ChatMessage] | None = None  # the messages of the retry after a replica missed an upload
        while True:
            if inline is None:
                if settings.upload_images:
                    await client._upload_missing(self._prepared, self._deadline, self.affinity_key)
                messages = await asyncio.to_thread(
                    _core.request_messages, self._prepared, client.images, settings.upload_images
                )
            else:
                messages = inline
            self._request.ClearField("messages")
            self._request.messages.extend(messages)
            if self.cancelled:
                return
            call = client._stub.Generate(
                self._request,
                timeout=self._deadline.remaining(),
                metadata=metadata,
                wait_for_ready=settings.wait_for_ready,
            )
            self._call = call
            try:
                async for response in call:
                    if response.HasField("delta"):
                        yield self._acc.delta(response.delta)
                    elif response.HasField("final"):
                        self.result = self._acc.final(response.final)
                        await call.code()  # the OK status that follows the final message: the RPC completes normally
                        return
                if self.cancelled:
                    return
                raise self._acc.partial(_core.no_final_error(self.request_id))
            except asyncio.CancelledError:
                if self.cancelled:
                    return  # our own cancel(): grpc.aio ends the iteration this way
                raise
            except grpc.RpcError as e:
                if self.cancelled:
                    return
                error = from_rpc_error(e)
                if inline is not None and retry.not_found is not None:
                    error = _core.inline_retry_error(error, retry.not_found)
                action = retry.on_error(
                    error, self._acc.tokens_seen, lambda: _core.can_inline(self._prepared, client.images)
                )
                if action == "raise":
                    raise self._acc.partial(error) from None
                if action == "inline":  # as in GenerationStream._run
                    client.images.forget(ref.sha256 for ref in self._prepared.images)
                    inline = await asyncio.to_thread(
                        _core.inline_retry_messages,
                        self._prepared,
                        client.images,
                        retry.not_found,
                        settings.max_message_bytes,
                    )
                    continue
                await asyncio.sleep(action)
            finally:
                if self.result is None and not call.done():
                    call.cancel()
