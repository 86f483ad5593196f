"""The synchronous client of an mmcast scheduler.

    with Client("127.0.0.1:50051") as client:
        result = client.generate("Describe the picture.", images=["cat.jpg"], max_tokens=64)
        print(result.text, result.usage.cached_tokens)
        stream = client.generate(messages, max_tokens=64, stream=True)
        for delta in stream:
            print(delta.text, end="")
        print(stream.result.finish_reason)

A Client is thread-safe; share one per process so its record of uploaded images is shared too.

Several replicas: give every address (`Client("ipv4:10.0.0.5:50051,10.0.0.6:50051")`, or a DNS name that resolves
to all of them, `Client("dns:///mmcast-clients.ns.svc.cluster.local:50051")`); each conversation then stays on
one replica (gRPC's ring_hash on the `x-mmcast-affinity` header; see mmcast_client/affinity.py).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from mmcast.v1 import generation_pb2 as pb
from mmcast.v1 import generation_pb2_grpc as pb_grpc
from mmcast_client import _core, affinity
from mmcast_client.errors import NotFound, from_rpc_error
from mmcast_client.images import SHA_PREFIX, ImageStore
from mmcast_client.messages import Prepared, normalize, prepare
from mmcast_client.types import Backoff, Delta, Result


class Client:
    """A connection to one scheduler or several replicas: `generate`, `upload_image`, `get_server_info`; `close()`
    or `with`.

    `options`: extra gRPC channel options (they win over the SDK's; one that picks a balancing policy,
    `grpc.service_config` or `grpc.lb_policy_name`, replaces the SDK's ring-hash default). `channel`: a channel
    made by the caller, used as is (its balancing is then the caller's; the client does not close it).
    `interceptors`: gRPC client interceptors wrapped around the channel. `wait_for_ready`: passed on every call
    (True queues a call while no replica is reachable, until its deadline, instead of failing at once).
    """

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
        channel: grpc.Channel | None = None,
        interceptors: Sequence[Any] = (),
        wait_for_ready: bool | None = None,
    ) -> None:
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
        if channel is not None:
            warnings.warn(affinity.OWN_CHANNEL_WARNING, UserWarning, stacklevel=2)
            self._channel = channel
        elif s.credentials is None:
            self._channel = grpc.insecure_channel(s.target, options=s.options)
        else:
            self._channel = grpc.secure_channel(s.target, s.credentials, options=s.options)
        calls = grpc.intercept_channel(self._channel, *s.interceptors) if s.interceptors else self._channel
        self._stub = pb_grpc.GenerationServiceStub(calls)
        self.images = ImageStore()
        self.closed = False

    @property
    def target(self) -> str:
        return self.settings.target

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._owns_channel:
                self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls -----------------------------------------------------------------------------------------------------
    def get_server_info(self, *, timeout: float | None = None) -> _core.ServerInfo:
        deadline = _core.Deadline(self._timeout(timeout))
        s = self.settings
        reply = self._unary(
            lambda t: self._stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=t, metadata=s.metadata, wait_for_ready=s.wait_for_ready
            ),
            deadline,
        )
        return _core.ServerInfo.from_proto(reply)

    def upload_image(
        self, image: Any, *, force: bool = False, timeout: float | None = None, session_id: str | None = None
    ) -> str:
        """Uploads one image (path, bytes, PIL image, ...) unless the server holds it per this client's record;
        returns its reference `"sha256:<hex>"` for use in messages. With several replicas, pass the `session_id`
        the conversation's `generate` calls use, so the upload lands on the replica that will need it."""
        deadline = _core.Deadline(self._timeout(timeout))
        ref = self.images.resolve(image, "image")
        key = _core.upload_key(ref, session_id)
        if force or not self.images.is_held(ref.sha256):
            data = self.images.load(ref)
            if data is None:
                raise NotFound(message=f"sha256:{ref.sha256}: this client has no bytes for it to upload")
            self._upload(ref.sha256, data, deadline, key)
        return SHA_PREFIX + ref.sha256

    def generate(
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
    ) -> Result | GenerationStream:
        """Generates one chat completion. `messages`: chat dicts, or a prompt string (with `images=` shown first).

        stream=False returns the Result; stream=True a GenerationStream yielding Deltas whose `.result` is set once
        the stream is exhausted. Failures raise `MmcastError` subclasses; one raised after the first token carries
        the tokens received (`token_ids`, `text`). `session_id`: the conversation's name for replica affinity
        (default: a hash of its first user message); give one where many conversations open alike.
        """
        started = time.monotonic()
        deadline = _core.Deadline(self._timeout(timeout))
        prepared = prepare(normalize(messages, images), self.images)
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
        s = GenerationStream(self, prepared, request, deadline, started, key)
        if stream:
            return s
        with s:
            for _ in s:
                pass
        if s.result is None:
            raise _core.no_final_error(s.request_id)
        return s.result

    # -- internals -------------------------------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.settings.timeout

    def _unary(self, call, deadline: _core.Deadline):
        """A unary call retried on UNAVAILABLE with backoff (these calls are idempotent)."""
        retry = _core.RetryState(self.settings, deadline)
        while True:
            try:
                return call(deadline.remaining())
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                action = retry.on_error(error, tokens_seen=False, inlinable=lambda: False)
                if action == "raise":
                    raise error from None
                time.sleep(action)

    def _upload(self, sha: str, data: bytes, deadline: _core.Deadline, key: str) -> None:
        s = self.settings
        reply = self._unary(
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

    def _upload_missing(self, prepared: Prepared, deadline: _core.Deadline, key: str) -> None:
        for sha, data in _core.upload_plan(prepared, self.images):
            self._upload(sha, data, deadline, key)


class GenerationStream:
    """An in-flight generation: iterate for Deltas; `.result` after the last one; `cancel()` to stop it early.

    Use it as a context manager (or exhaust it) so an abandoned stream is cancelled on the server.
    """

    def __init__(
        self,
        client: Client,
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
        self._call: grpc.Call | None = None
        self._lock = threading.Lock()
        self._iter = self._run()

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        return next(self._iter)

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.result is None:
            self.cancel()
        self._iter.close()

    def cancel(self) -> None:
        """Cancels the RPC (the server frees the request); iteration then ends without a result."""
        with self._lock:
            self.cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def _run(self) -> Iterator[Delta]:
        client, settings = self._client, self._client.settings
        retry = _core.RetryState(settings, self._deadline)
        metadata = settings.call_metadata(self.affinity_key)
        inline: list[pb.ChatMessage] | None = None  # the messages of the retry after a replica missed an upload
        while True:
            if inline is None:
                if settings.upload_images:
                    client._upload_missing(self._prepared, self._deadline, self.affinity_key)
                messages = _core.request_messages(self._prepared, client.images, settings.upload_images)
            else:
                messages = inline
            self._request.ClearField("messages")
            self._request.messages.extend(messages)
            with self._lock:
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
                for response in call:
                    if response.HasField("delta"):
                        yield self._acc.delta(response.delta)
                    elif response.HasField("final"):
                        self.result = self._acc.final(response.final)
                        for _ in call:  # the server ends the stream right after the final message: read its
                            pass  # OK status, so the RPC completes normally instead of being cancelled
                        return
                raise self._acc.partial(_core.no_final_error(self.request_id))
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
                if action == "inline":
                    # This replica lacks uploads (another replica holds them, or it evicted them): forget them so
                    # the conversation's next turn uploads them again, and retry now with the bytes in the request.
                    client.images.forget(ref.sha256 for ref in self._prepared.images)
                    inline = _core.inline_retry_messages(
                        self._prepared, client.images, retry.not_found, settings.max_message_bytes
                    )
                    continue
                time.sleep(action)
            finally:
                if self.result is None and not call.done():
                    call.cancel()
