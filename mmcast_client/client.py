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

Deadlines (seconds; None: no limit), set on the client and overridable per call:
- `timeout`: the deadline of every call, a whole generation included. Not given: 60 s (`DEFAULT_TIMEOUT`) for
  each unary call (`get_server_info`, `upload_image`, each upload inside `generate`) and none for a generation as a
  whole, whose length is the caller's choice;
- `first_token_timeout` (default 120 s, `DEFAULT_FIRST_TOKEN_TIMEOUT`): `generate` called -> first token, uploads,
  retries and queueing included; a stream past it is cancelled and raises `DeadlineExceeded`.
Retries: UNAVAILABLE before the server answers is retried by gRPC (`retries`, `backoff`; mmcast_client/_core/);
`wait_for_ready=True` waits for a serving replica instead of failing while none is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any, Literal, Unpack, overload

import grpc

from mmcast.v1 import generation_pb2_grpc as pb_grpc
from mmcast_client import _core
from mmcast_client._core import NOT_GIVEN, ClientOptions, GenerateOptions, NotGiven
from mmcast_client.errors import InvalidArgument
from mmcast_client.types import Delta, Result


class Client(_core.ClientShell):
    """A connection to one scheduler or several replicas: `generate`, `upload_image`, `get_server_info`; `close()`
    or `with`.

    `timeout`, `first_token_timeout`: default deadlines (module docstring). `retries` (0-4) and `backoff`: gRPC's
    retries of UNAVAILABLE. `token`: sent as `authorization: Bearer ...` (an `InsecureTokenWarning` when it would
    cross the network in plaintext). `options`: extra gRPC channel options (they win over the SDK's; a
    `grpc.service_config` replaces the SDK's balancing, retries and health checking, `grpc.lb_policy_name` its
    balancing). `channel`: a channel made by the caller, used as is (its balancing and retries are then the
    caller's; the client does not close it). `interceptors`: gRPC client interceptors wrapped around the channel.
    `wait_for_ready`: passed on every call (True queues a call while no replica is serving, until its deadline,
    instead of failing at once). `image_store`: the bounded record of images (mmcast_client/images.py), to size it
    or share it between clients.
    """

    def __init__(
        self, target: str = "", *, channel: grpc.Channel | None = None, **options: Unpack[ClientOptions]
    ) -> None:
        super().__init__(target, channel, options)
        s = self.settings
        if channel is not None:
            self._channel = channel
        elif s.credentials is None:
            self._channel = grpc.insecure_channel(s.target, options=s.options)
        else:
            self._channel = grpc.secure_channel(s.target, s.credentials, options=s.options)
        calls = grpc.intercept_channel(self._channel, *s.interceptors) if s.interceptors else self._channel
        self._stub = pb_grpc.GenerationServiceStub(calls)

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._begin_close():
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls -----------------------------------------------------------------------------------------------------
    def get_server_info(self, *, timeout: float | None | NotGiven = NOT_GIVEN) -> _core.ServerInfo:
        deadline = self._core.unary_deadline(timeout)
        reply = self._unary(
            self._stub.GetServerInfo, self._core.server_info_request(), deadline, self.settings.metadata
        )
        return _core.ServerInfo.from_proto(reply)

    def upload_image(
        self,
        image: Any,
        *,
        force: bool = False,
        timeout: float | None | NotGiven = NOT_GIVEN,
        session_id: str | None = None,
    ) -> str:
        """Uploads one image (path, bytes, PIL image, ...) unless the server holds it per this client's record;
        returns its reference `"sha256:<hex>"` for use in messages. With several replicas, pass the `session_id`
        the conversation's `generate` calls use, so the upload lands on the replica that will need it."""
        deadline = self._core.unary_deadline(timeout)
        ref = self.images.resolve(image, "image")
        data = self._core.upload_target(ref, force)
        if data is not None:
            self._upload(ref.sha256, data, deadline, _core.upload_key(ref, session_id))
        return self._core.reference(ref)

    @overload
    def generate(
        self, messages: str | Sequence[dict], *, stream: Literal[False] = ..., **options: Unpack[GenerateOptions]
    ) -> Result: ...
    @overload
    def generate(
        self, messages: str | Sequence[dict], *, stream: Literal[True], **options: Unpack[GenerateOptions]
    ) -> GenerationStream: ...
    @overload
    def generate(
        self, messages: str | Sequence[dict], *, stream: bool, **options: Unpack[GenerateOptions]
    ) -> Result | GenerationStream: ...
    def generate(
        self, messages: str | Sequence[dict], *, stream: bool = False, **options: Unpack[GenerateOptions]
    ) -> Result | GenerationStream:
        """Generates one chat completion. `messages`: chat dicts, or a prompt string (with `images=` shown first).

        stream=False returns the Result; stream=True a GenerationStream yielding Deltas whose `.result` is set once
        the stream is exhausted. `logprobs`: None (default) none, 0 the sampled tokens' log-probabilities, k also
        the k most likely alternatives (`return_logprobs` is deprecated). `timeout`: the whole generation's
        deadline, `first_token_timeout` the first token's (defaults: the client's; module docstring). Failures raise
        `MmcastError` subclasses; one raised after the first token carries the tokens received (`token_ids`,
        `text`). `session_id`: the conversation's name for replica affinity (default: a hash of its first user
        message); give one where many conversations open alike. `live`: this call is the next turn of the live
        session `session_id` (True, or `{"keep_turns": k, "close": bool}`): send only the turn's new messages; the
        server keeps the session's KV, drops its oldest turns past keep_turns, and `Result.live` says what it holds.
        `structured_output`: the grammar the answer follows, one of `{"json_schema": schema}`, `{"json_object":
        True}`, `{"regex": pattern}`, `{"choice": [strings]}`; the answer ends as soon as the grammar is complete.
        """
        started = time.monotonic()
        o = self._core.generate_options(options)
        state = self._core.start_generate(self._core.prepare_messages(messages, o["images"]), started, o)
        s = GenerationStream(self, state)
        if not stream:
            with s:
                for _ in s:
                    pass
            return s._final()
        return s

    # -- internals -------------------------------------------------------------------------------------------------
    def _unary(self, method: Any, request: Any, deadline: _core.Deadline, metadata: Any) -> Any:
        """One unary (or client-streaming) call; gRPC retries UNAVAILABLE per the channel's retry policy."""
        try:
            return method(request, **self._core.unary_call(deadline, metadata))
        except grpc.RpcError as e:
            raise self._core.error(e) from None

    def _upload(self, sha: str, data: bytes, deadline: _core.Deadline, key: str) -> None:
        metadata = self.settings.call_metadata(key)
        try:
            reply = self._unary(self._stub.UploadImage, _core.upload_chunks(sha, data), deadline, metadata)
        except InvalidArgument as exc:
            if not _core.arrived_altered(exc):
                raise
            reply = self._unary(self._stub.UploadImage, _core.upload_chunks(sha, data), deadline, metadata)
        self._core.uploaded(sha, reply)


class GenerationStream(_core.StreamShell):
    """An in-flight generation: iterate for Deltas; `.result` after the last one; `cancel()` to stop it early.

    Use it as a context manager (or exhaust it) so an abandoned stream is cancelled on the server.
    """

    def __init__(self, client: Client, state: _core.GenerateState) -> None:
        super().__init__(client, state)
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

    def _first_token_overdue(self, call: Any) -> None:
        with self._lock:
            overdue = self._state.first_token_overdue()
        if overdue:
            call.cancel()

    def _run(self) -> Generator[Delta, None, None]:
        client, state = self._client, self._state
        while True:
            for sha, data in state.uploads():
                client._upload(sha, data, state.upload_deadline(), state.key)
            request = state.attempt_request()
            with self._lock:
                if self.cancelled:
                    return
                call = self._call = client._stub.Generate(request, **state.generate_call())
            wait = state.first_token_wait()
            timer = None if wait is None else threading.Timer(wait, self._first_token_overdue, (call,))
            if timer is not None:
                timer.daemon = True
                timer.start()
            try:
                for response in call:
                    with self._lock:  # ordered against the first-token timer
                        delta = self._on_response(response)
                    if delta is not None:
                        yield delta
                    elif self.result is not None:
                        for _ in call:  # the server ends the stream right after the final message: read its
                            pass  # OK status, so the RPC completes normally instead of being cancelled
                        return
                raise state.ended_without_final()
            except grpc.RpcError as e:
                if self.cancelled:
                    return
                state.on_error(e)  # raises, unless the request goes again with its images inline
            finally:
                if timer is not None:
                    timer.cancel()
                if self.result is None and not call.done():
                    call.cancel()
