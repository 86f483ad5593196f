"""The sans-IO core of the SDK: everything `Client` (client.py) and `AsyncClient` (aio.py) share, so each of them is
a thin shell that only moves bytes. Here: constructor checks and channel settings (with the service config that
carries balancing, retries and health checking), deadlines, request building, upload planning, the folding of a
stream's responses into deltas and a Result, and the mapping of gRPC errors to the SDK's exceptions. Nothing here
does I/O on the network.

Modules: options.py (the keyword surface: ClientOptions, GenerateOptions and their defaults), client_settings.py
(settings, service config, credentials check), deadlines.py, request_building.py,
response_folding.py; this one holds `ClientCore` (a client without its channel) and `GenerateState` (one generate
call from first upload to final message), which the shells drive, and `ClientShell`/`StreamShell`, the state
both shells inherit.

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
from collections.abc import Mapping, Sequence
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
from mmcast_client._core.options import (
    CLIENT_DEFAULTS,
    GENERATE_DEFAULTS,
    ClientOptions,
    GenerateOptions,
    with_defaults,
)
from mmcast_client._core.request_building import (
    UPLOAD_CHUNK_BYTES,
    affinity_key,
    arrived_altered,
    can_inline,
    inline_retry_error,
    inline_retry_messages,
    live_session,
    new_request_id,
    request_messages,
    resolve_logprobs,
    sampling_params,
    structured_output,
    upload_chunks,
    upload_key,
    upload_plan,
)
from mmcast_client._core.response_folding import Accumulator, no_final_error
from mmcast_client.errors import Internal, MmcastError, NotFound, Unavailable, from_rpc_error
from mmcast_client.images import SHA_PREFIX, ImageRef, ImageStore
from mmcast_client.messages import Prepared, normalize, prepare
from mmcast_client.types import Delta, Result

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
    "ClientOptions",
    "ClientShell",
    "GenerateOptions",
    "Deadline",
    "GenerateState",
    "StreamShell",
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
    """What a client is, without its channel: settings, image bookkeeping, and the building of each call.

    `shell`: the class name the user called (in TypeErrors); `options`: the constructor's keywords (`ClientOptions`).
    """

    def __init__(self, shell: str, target: str, channel: Any, options: Mapping[str, Any]) -> None:
        resolved = with_defaults(shell, options, ClientOptions, CLIENT_DEFAULTS)
        self.settings = channel_settings(target, channel, resolved)
        # stacklevel 4: ClientCore.__init__, ClientShell.__init__, the shell's __init__, the caller.
        if channel is not None:
            warnings.warn(affinity.OWN_CHANNEL_WARNING, UserWarning, stacklevel=4)
        else:
            insecure = insecure_token_message(self.settings)
            if insecure is not None:
                warnings.warn(insecure, InsecureTokenWarning, stacklevel=4)
        store = resolved["image_store"]
        self.images = store if store is not None else ImageStore()

    def unary_call(self, deadline: Deadline, metadata: Any) -> dict[str, Any]:
        """The keywords of one unary (or client-streaming) gRPC call."""
        return {"timeout": deadline.remaining(), "metadata": metadata, "wait_for_ready": self.settings.wait_for_ready}

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
    @staticmethod
    def generate_options(options: Mapping[str, Any]) -> dict[str, Any]:
        """`generate`'s keywords checked against `GenerateOptions`, every default filled in."""
        return with_defaults("generate", options, GenerateOptions, GENERATE_DEFAULTS)

    def prepare_messages(self, messages: str | Sequence[dict], images: Sequence[Any] | None) -> Prepared:
        """Resolves every image (reads files, encodes arrays): the part of generate() that may block."""
        return prepare(normalize(messages, images), self.images)

    def start_generate(self, prepared: Prepared, started: float, options: Mapping[str, Any]) -> GenerateState:
        """One generate call's state; `options`: its keywords (`GenerateOptions`, checked by `generate_options`)."""
        o = options
        timeout, first_token_timeout = o["timeout"], o["first_token_timeout"]
        if timeout is NOT_GIVEN:
            timeout = self.settings.generate_timeout
        else:
            check_timeout("timeout", timeout)
        if first_token_timeout is NOT_GIVEN:
            first_token_timeout = self.settings.first_token_timeout
        else:
            check_timeout("first_token_timeout", first_token_timeout)
        request = pb.GenerateRequest(
            request_id=o["request_id"] or new_request_id(),
            sampling=sampling_params(
                max_tokens=o["max_tokens"],
                temperature=o["temperature"],
                top_p=o["top_p"],
                top_k=o["top_k"],
                seed=o["seed"],
                stop=o["stop"],
                stop_token_ids=o["stop_token_ids"],
                ignore_eos=o["ignore_eos"],
                logprobs=resolve_logprobs(o["logprobs"], o["return_logprobs"]),
                presence_penalty=o["presence_penalty"],
                frequency_penalty=o["frequency_penalty"],
                repetition_penalty=o["repetition_penalty"],
                logit_bias=o["logit_bias"],
                min_tokens=o["min_tokens"],
                bad_words=o["bad_words"],
            ),
            cache_salt=o["cache_salt"] or "",
            continue_final_message=o["continue_final_message"],
        )
        if o["live"]:
            request.live.CopyFrom(live_session(o["live"], o["session_id"]))
        if o["structured_output"]:
            request.structured_output.CopyFrom(structured_output(o["structured_output"]))
        deadline = Deadline(timeout, first_token_timeout, start=started)
        return GenerateState(self, prepared, request, deadline, started, affinity_key(prepared, o["session_id"]))

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

    def generate_call(self) -> dict[str, Any]:
        """The keywords of this attempt's Generate call."""
        return {
            "timeout": self.call_timeout(),
            "metadata": self.metadata,
            "wait_for_ready": self.core.settings.wait_for_ready,
        }

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


class ClientShell:
    """What `Client` and `AsyncClient` share besides their I/O: the core, the settings, the image record and the
    closed flag. `options`: the constructor's keywords (`ClientOptions`)."""

    def __init__(self, target: str, channel: Any, options: Mapping[str, Any]) -> None:
        self._core = ClientCore(type(self).__name__, target, channel, options)
        self.settings = self._core.settings
        self.images = self._core.images
        self._owns_channel = channel is None  # a channel the caller made is the caller's to close
        self.closed = False

    @property
    def target(self) -> str:
        return self.settings.target

    def _begin_close(self) -> bool:
        """Marks the client closed; True when the shell should now close its channel (first call, its own)."""
        first, self.closed = not self.closed, True
        return first and self._owns_channel


class StreamShell:
    """What `GenerationStream` and `AsyncGenerationStream` share: identity, outcome, and the call in flight."""

    def __init__(self, client: Any, state: GenerateState) -> None:
        self.request_id = state.request_id
        self.affinity_key = state.key  # the x-mmcast-affinity value its calls carry
        self.result: Result | None = None
        self.cancelled = False
        self._client = client
        self._state = state
        self._call: Any = None

    def _final(self) -> Result:
        """The Result of a stream read to its end (an error when the server never sent the final message)."""
        if self.result is None:
            raise no_final_error(self.request_id)
        return self.result

    def _on_response(self, response: pb.GenerateResponse) -> Delta | None:
        """A delta to yield, or None; sets `result` on the final message (the shell then reads the call's status)."""
        out = self._state.on_response(response)
        if isinstance(out, Result):
            self.result = out
            return None
        return out
