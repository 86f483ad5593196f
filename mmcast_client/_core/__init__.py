"""The sans-IO core of the SDK: everything `Client` (client.py) and `AsyncClient` (aio.py) share, so each of them is
a thin shell that only moves bytes. Here: constructor checks and channel settings (with the service config that
carries balancing, retries and health checking), deadlines, request building, upload planning, the folding of a
stream's responses into deltas and a Result, and the mapping of gRPC errors to the SDK's exceptions. Nothing here
does I/O on the network.

Modules: client_settings.py (settings, service config, credentials check), deadlines.py, request_building.py,
response_folding.py; this one holds `ClientCore` (a client without its channel) and `GenerateState` (one generate
call from first upload to final message), which the shells drive.

Retries. UNAVAILABLE is retried by gRPC itself, from the channel's service config (`retryPolicy`: at most
`retries` more attempts, exponential backoff with gRPC's jitter); a stream is retried only until the server has
answered (its first response commits the call), so tokens are never repeated. The server's health status for the
generation service is watched by the channel (`healthCheckConfig`): a replica whose worker group is down or that is
draining takes no new calls, and with `wait_for_ready=True` a call waits for one that is serving instead of
failing. What stays here is application logic gRPC cannot know: a replica that misses an uploaded image answers
NOT_FOUND, and the request is sent once more with the images inline.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import grpc

from mmcast.v1 import generation_pb2 as pb
from mmcast_client import affinity
from mmcast_client._core.client_settings import (
    DEFAULT_FIRST_TOKEN_TIMEOUT,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT,
    GENERATION_SERVICE,
    MAX_RETRIES,
    NOT_GIVEN,
    ChannelSettings,
    InsecureTokenWarning,
    NotGiven,
    ServerInfo,
    channel_settings,
    check_timeout,
    insecure_token_message,
    is_loopback_target,
    target_hosts,
)
from mmcast_client._core.deadlines import Deadline, first_token_deadline_error
from mmcast_client._core.request_building import (
    UPLOAD_CHUNK_BYTES,
    affinity_key,
    arrived_altered,
    can_inline,
    inline_retry_error,
    inline_retry_messages,
    new_request_id,
    request_messages,
    resolve_logprobs,
    sampling_params,
    upload_chunks,
    upload_key,
    upload_plan,
)
from mmcast_client._core.response_folding import Accumulator, no_final_error
from mmcast_client.errors import Internal, MmcastError, NotFound, Unavailable, from_rpc_error
from mmcast_client.images import SHA_PREFIX, ImageRef, ImageStore
from mmcast_client.messages import Prepared, normalize, prepare
from mmcast_client.types import Backoff, Delta, Result

__all__ = [
    "DEFAULT_FIRST_TOKEN_TIMEOUT",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TIMEOUT",
    "GENERATION_SERVICE",
    "MAX_RETRIES",
    "NOT_GIVEN",
    "UPLOAD_CHUNK_BYTES",
    "Accumulator",
    "ChannelSettings",
    "ClientCore",
    "Deadline",
    "GenerateState",
    "InsecureTokenWarning",
    "NotGiven",
    "ServerInfo",
    "affinity_key",
    "arrived_altered",
    "channel_settings",
    "first_token_deadline_error",
    "insecure_token_message",
    "is_loopback_target",
    "map_rpc_error",
    "no_final_error",
    "sampling_params",
    "target_hosts",
    "upload_chunks",
    "upload_key",
]


class ClientCore:
    """What a client is, without its channel: settings, image bookkeeping, and the building of each call."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None | NotGiven,
        first_token_timeout: float | None,
        max_message_bytes: int,
        retries: int,
        backoff: Backoff | float,
        upload_images: bool,
        tls: bool | None,
        root_certificates: bytes | None,
        private_key: bytes | None,
        certificate_chain: bytes | None,
        token: str | None,
        metadata: Sequence[tuple[str, str]],
        options: Sequence[tuple[str, Any]],
        channel: Any,
        interceptors: Sequence[Any],
        wait_for_ready: bool | None,
        image_store: ImageStore | None,
    ) -> None:
        self.settings = channel_settings(
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
            wait_for_ready=wait_for_ready,
            interceptors=interceptors,
            channel=channel,
        )
        # stacklevel 3: ClientCore.__init__, the shell's __init__, the caller.
        if channel is not None:
            warnings.warn(affinity.OWN_CHANNEL_WARNING, UserWarning, stacklevel=3)
        else:
            insecure = insecure_token_message(self.settings)
            if insecure is not None:
                warnings.warn(insecure, InsecureTokenWarning, stacklevel=3)
        self.images = image_store if image_store is not None else ImageStore()

    # -- unary calls -------------------------------------------------------------------------------------------------
    def unary_deadline(self, timeout: float | None | NotGiven) -> Deadline:
        return Deadline(self.settings.unary_timeout if timeout is NOT_GIVEN else timeout)

    def server_info_request(self) -> pb.GetServerInfoRequest:
        return pb.GetServerInfoRequest()

    def upload_target(self, ref: ImageRef, force: bool) -> bytes | None:
        """The bytes to upload for `ref` (None: the server holds it per this client's record)."""
        if not force and self.images.is_held(ref.sha256):
            return None
        data = self.images.load(ref)
        if data is None:
            raise NotFound(message=f"sha256:{ref.sha256}: this client has no bytes for it to upload")
        return data

    def uploaded(self, sha: str, response: pb.UploadImageResponse) -> None:
        if response.sha256 != sha:
            raise Internal(message=f"the server stored the upload as sha256:{response.sha256}, expected sha256:{sha}")
        self.images.mark_held(sha)

    @staticmethod
    def reference(ref: ImageRef) -> str:
        return SHA_PREFIX + ref.sha256

    # -- generate ----------------------------------------------------------------------------------------------------
    def prepare_messages(self, messages: str | Sequence[dict], images: Sequence[Any] | None) -> Prepared:
        """Resolves every image (reads files, encodes arrays): the part of generate() that may block."""
        return prepare(normalize(messages, images), self.images)

    def start_generate(
        self,
        prepared: Prepared,
        *,
        started: float,
        max_tokens: int,
        temperature: float,
        top_p: float | None,
        top_k: int | None,
        seed: int | None,
        stop: str | Sequence[str] | None,
        stop_token_ids: Sequence[int] | None,
        ignore_eos: bool,
        logprobs: int | None,
        return_logprobs: bool | None,
        request_id: str | None,
        cache_salt: str | None,
        continue_final_message: bool,
        timeout: float | None | NotGiven,
        first_token_timeout: float | None | NotGiven,
        session_id: str | None,
    ) -> GenerateState:
        if timeout is NOT_GIVEN:
            timeout = self.settings.generate_timeout
        else:
            check_timeout("timeout", timeout)
        if first_token_timeout is NOT_GIVEN:
            first_token_timeout = self.settings.first_token_timeout
        else:
            check_timeout("first_token_timeout", first_token_timeout)
        request = pb.GenerateRequest(
            request_id=request_id or new_request_id(),
            sampling=sampling_params(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                stop=stop,
                stop_token_ids=stop_token_ids,
                ignore_eos=ignore_eos,
                logprobs=resolve_logprobs(logprobs, return_logprobs),
            ),
            cache_salt=cache_salt or "",
            continue_final_message=continue_final_message,
        )
        deadline = Deadline(timeout, first_token_timeout, start=started)
        return GenerateState(self, prepared, request, deadline, started, affinity_key(prepared, session_id))

    def error(self, rpc_error: grpc.RpcError) -> MmcastError:
        return map_rpc_error(rpc_error)


def map_rpc_error(rpc_error: grpc.RpcError) -> MmcastError:
    """The SDK's exception for a failed call, with a hint where gRPC's own message says little."""
    error = from_rpc_error(rpc_error)
    if isinstance(error, Unavailable) and "backend unhealthy" in error.message:
        error.message += (
            f" (the server reports {GENERATION_SERVICE} NOT_SERVING: its worker group is not ready or it is "
            "draining; wait_for_ready=True waits for a serving replica until the call's deadline)"
        )
        error.args = (f"{error.code.name}: {error.message}",)
    return error


class GenerateState:
    """One generate call from first upload to final message: what to send, and what each response or error means.

    The shells drive it: `uploads()` then `request()` before each attempt, `on_response()` for each response,
    `on_error()` when the call fails (it returns to retry with the images inline, or raises), and
    `first_token_overdue()` when the first-token timer fires (True: cancel the call).
    """

    def __init__(
        self,
        core: ClientCore,
        prepared: Prepared,
        request: pb.GenerateRequest,
        deadline: Deadline,
        started: float,
        key: str,
    ) -> None:
        self.core = core
        self.prepared = prepared
        self.request = request
        self.deadline = deadline
        self.key = key  # the x-mmcast-affinity value its calls carry
        self.metadata = core.settings.call_metadata(key)
        self.acc = Accumulator(request.request_id, started)
        self.not_found: NotFound | None = None  # set once a replica missed an uploaded image: retry inline, once
        self.inline: list[pb.ChatMessage] | None = None  # the messages of that retry
        self.first_token_expired = False  # the first-token timer cancelled the call

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def uploads(self) -> list[tuple[str, bytes]]:
        """What to upload before this attempt: (sha, bytes) of the request's images the server lacks per our
        record (none in inline mode, or on the inline retry)."""
        if self.inline is not None or not self.core.settings.upload_images:
            return []
        return upload_plan(self.prepared, self.core.images)

    def upload_deadline(self) -> Deadline:
        return self.deadline.bounded(self.core.settings.unary_timeout)

    def attempt_request(self) -> pb.GenerateRequest:
        """The request of the next attempt, with its messages as the images' state now says."""
        messages = self.inline
        if messages is None:
            messages = request_messages(self.prepared, self.core.images, self.core.settings.upload_images)
        self.request.ClearField("messages")
        self.request.messages.extend(messages)
        return self.request

    def call_timeout(self) -> float | None:
        """The gRPC deadline of the Generate call: the whole generation's (the first-token deadline is a timer)."""
        self.deadline.remaining(before_first_token=not self.acc.tokens_seen)  # raises when one has passed
        return self.deadline.remaining(before_first_token=False)

    def first_token_wait(self) -> float | None:
        """Seconds until the first-token timer should fire; None: no timer."""
        return None if self.acc.tokens_seen else self.deadline.first_token_wait()

    def first_token_overdue(self) -> bool:
        """The timer fired: True (cancel the call) unless a token arrived meanwhile."""
        if self.acc.tokens_seen:
            return False
        self.first_token_expired = True
        return True

    def on_response(self, response: pb.GenerateResponse) -> Delta | Result | None:
        if response.HasField("delta"):
            return self.acc.delta(response.delta)
        if response.HasField("final"):
            return self.acc.final(response.final)
        return None

    def ended_without_final(self) -> MmcastError:
        return self.acc.partial(no_final_error(self.request_id))

    def on_error(self, rpc_error: grpc.RpcError | None) -> None:
        """Returns when the request should be sent again with its images inline; otherwise raises the error (with
        the output received so far). `rpc_error` None: the call was cancelled by the first-token timer."""
        if self.first_token_expired and not self.acc.tokens_seen:
            raise self.acc.partial(first_token_deadline_error(self.deadline.first_token_timeout))
        assert rpc_error is not None
        error = map_rpc_error(rpc_error)
        if self.inline is not None and self.not_found is not None:
            error = inline_retry_error(error, self.not_found)
        if (
            isinstance(error, NotFound)
            and self.not_found is None
            and not self.acc.tokens_seen
            and can_inline(self.prepared, self.core.images)
        ):
            # This replica lacks uploads (another replica holds them, or it evicted them): forget them so the
            # conversation's next turn uploads them again, and retry now with the bytes in the request.
            self.not_found = error
            self.core.images.forget(ref.sha256 for ref in self.prepared.images)
            self.inline = inline_retry_messages(
                self.prepared, self.core.images, error, self.core.settings.max_message_bytes
            )
            return
        raise self.acc.partial(error)
