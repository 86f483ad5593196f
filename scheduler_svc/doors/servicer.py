"""The client-facing ``mmcast.v1.GenerationService`` servicer. It only translates: proto → domain objects (request_parsing.py),
the shared request path (completion.py) admits and streams, its chunks → proto. Status codes and their ``google.rpc`` details come from the
``common.errors`` exception, through ``common.rich_status`` (docs/ERRORS.md).

Any other exception is a bug of the server, not of the request: the client gets ``INTERNAL`` with the request id
(an id made for the call where the RPC has none) and the log holds the traceback under that id — never gRPC's
``UNKNOWN`` with a Python class name."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from datetime import timedelta

import grpc

from common import rich_status
from common.errors import InvalidArgument, MmcastError, ResourceExhausted, Status
from common.rich_status import grpc_code
from mmcast.v1 import generation_pb2, generation_pb2_grpc, logprob_pb2
from scheduler_svc.doors import grammar_requests, request_parsing
from scheduler_svc.engine import affinity_key
from scheduler_svc.engine.completion import Completion, CompletionRequest, Completions
from scheduler_svc.engine.tenancy import scoped_request_id

log = logging.getLogger(__name__)

_FINISH = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "cancelled": generation_pb2.FINISH_REASON_CANCELLED,
    "error": generation_pb2.FINISH_REASON_ERROR,
}


async def abort_internal(context, method: str, request_id: str) -> None:
    """Logs the exception being handled under ``request_id`` and ends the RPC with INTERNAL naming that id."""
    log.exception("unexpected error in %s", method, extra={"request_id": request_id})
    await context.abort(
        grpc.StatusCode.INTERNAL,
        f"internal server error in {method} (request_id={request_id}); the server log records the cause under this id",
    )


class GenerationServiceServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, *, completions: Completions, uploads, server_info, tokens=None) -> None:
        self.completions = completions  # the request path both client APIs share (completion.py)
        self.frontend = completions.frontend
        self.uploads = uploads
        self.config = completions.config
        self.server_info = server_info  # () -> generation_pb2.GetServerInfoResponse
        self.tokens = tokens  # common.auth.TokenTable, or None when authentication is off (one tenant, "")

    def _tenant(self, context) -> str:
        """The caller's tenant ("" when authentication is off). The interceptor has already checked the token;
        this only fails when the token file changed in between."""
        if self.tokens is None:
            return ""
        tenant, problem = self.tokens.authenticate(context.invocation_metadata())
        if tenant is None:
            raise MmcastError(problem, Status.UNAUTHENTICATED)
        return tenant

    def _completion_request(
        self, request: generation_pb2.GenerateRequest, client_id: str, tenant: str, received: float, context
    ) -> CompletionRequest:
        request_parsing.check_request_id(request.request_id)
        request_parsing.check_cache_salt(request.cache_salt)
        sampling = request_parsing.parse_sampling(
            request.sampling,
            max_tokens_limit=self.config.max_tokens_limit,
            max_logprobs=self.config.max_logprobs,
            vocab_size=self.frontend.vocab_size,
        )
        turns = request_parsing.parse_messages(request.messages, max_images=self.config.max_images_per_request)
        metadata = dict(context.invocation_metadata() or ())
        return CompletionRequest(
            client_id=client_id,
            tenant=tenant,
            sampling=sampling,
            received=received,
            turns=turns,
            cache_salt=request.cache_salt,
            add_generation_prompt=not request.continue_final_message,
            continue_final_message=request.continue_final_message,
            affinity=affinity_key.client_key(metadata.get),
            live=request_parsing.parse_live(request.live) if request.HasField("live") else None,
            grammar=grammar_requests.from_proto(request),
        )

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        received = time.monotonic()
        client_id = request.request_id or f"req-{uuid.uuid4().hex}"
        log_extra = {"request_id": client_id}
        try:
            tenant = self._tenant(context)
            log_extra = {"request_id": scoped_request_id(tenant, client_id)}
            completion = await self.completions.admit(
                self._completion_request(request, client_id, tenant, received, context)
            )
        except MmcastError as err:
            log.info("request rejected: %s", err.message, extra={**log_extra, "code": err.status.value})
            await rich_status.abort(context, err)
            return
        except Exception:
            await abort_internal(context, "Generate", client_id)
            return
        try:
            async for response in self._stream(completion, client_id, context):
                yield response
        except grpc.aio.AbortError:  # a status the stream set on purpose
            raise
        except Exception:
            await abort_internal(context, "Generate", client_id)

    async def _stream(self, completion: Completion, client_id: str, context):
        return_logprobs = completion.sampling.return_logprobs
        # The conversation key, for a client that routes through a proxy without the SDK: it sends it back as the
        # x-mmcast-affinity request header on its later turns (scheduler_svc/engine/affinity_key.py). Sent with the first
        # message, not before: a failure before the first token stays a trailers-only status that gRPC's retry
        # policy (and a proxy's) may still retry, which response headers would commit.
        headers_sent = first_written = False
        try:
            async for chunk in completion.chunks():
                if not headers_sent:
                    await context.send_initial_metadata(((affinity_key.AFFINITY_HEADER, completion.affinity),))
                    headers_sent = True
                delta = generation_pb2.TokenDelta(token_ids=chunk.token_ids, text=chunk.text)
                if return_logprobs:
                    for tok, (logprob, top) in zip(chunk.token_ids, chunk.logprobs, strict=False):
                        delta.logprobs.append(
                            generation_pb2.TokenLogprob(
                                token_id=tok,
                                logprob=logprob,
                                top_logprobs=[logprob_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top],
                            )
                        )
                if not first_written and chunk.token_ids:  # handed to grpc, which writes it (not resumed when written)
                    completion.first_byte_written()
                    first_written = True
                yield generation_pb2.GenerateResponse(delta=delta)
        except MmcastError as err:  # failed before its first token: a plain status, which clients may retry
            await rich_status.abort(context, err)
        final = self._final(completion)
        final.request_id = client_id
        if not headers_sent:
            await context.send_initial_metadata(((affinity_key.AFFINITY_HEADER, completion.affinity),))
        yield generation_pb2.GenerateResponse(final=final)

    @staticmethod
    def _final(completion: Completion) -> generation_pb2.GenerateFinal:
        """The final message; what the finished-request log line also carries comes from the result's summary."""
        result = completion.result
        summary, u = result.summary, result.usage
        final = generation_pb2.GenerateFinal(
            finish_reason=_FINISH.get(result.finish_reason, generation_pb2.FINISH_REASON_ERROR),
            request_id=summary.request_id,
            stop_reason=result.stop_reason,
            usage=generation_pb2.Usage(
                prompt_tokens=summary.prompt_tokens,
                completion_tokens=summary.completion_tokens,
                cached_tokens=summary.cached_tokens,
                images=summary.images,
                videos=summary.videos,
                images_sent=u.items_sent,
                images_stripped=u.items_stripped,
                images_rank_cached=u.items_rank_cached,
                payload_bytes_broadcast=summary.payload_bytes_broadcast,
                payload_bytes_saved=summary.payload_bytes_saved,
                preemptions=summary.preemptions,
                encoder_runs=u.encoder_runs,
                encoder_output_bytes_shared=u.encoder_output_bytes_shared,
                image_cpu_time=timedelta(seconds=completion.processed.image_cpu_seconds),
                images_encoder_shared=u.items_encoder_shared,
            ),
            timings=generation_pb2.Timings(
                time_to_first_token=timedelta(seconds=summary.time_to_first_token_seconds or 0.0),
                total_time=timedelta(seconds=summary.total_seconds),
                queue_time=timedelta(seconds=summary.queue_seconds),
            ),
        )
        state = completion.live.state if completion.live is not None else None
        if state is not None:
            final.live.CopyFrom(generation_pb2.LiveSessionState(**state))
        if result.error is not None:
            final.error.grpc_code = grpc_code(result.error).value[0]
            final.error.message = result.error.message
        return final

    async def UploadImage(self, request_iterator, context: grpc.aio.ServicerContext):
        limit = self.config.max_upload_bytes
        digest = hashlib.sha256()
        parts: list[bytes] = []
        size = 0
        expected = ""
        tenant = None
        try:
            tenant = self._tenant(context)
            async for chunk in request_iterator:
                if chunk.expected_sha256:
                    expected = chunk.expected_sha256
                if size + len(chunk.data) > limit:
                    raise ResourceExhausted(f"upload exceeds {limit} bytes (--max-upload-bytes)", field="data")
                # Counted before it is kept; released below on every exit (done, refused, client gone).
                self.uploads.pending.reserve(tenant, len(chunk.data))
                size += len(chunk.data)
                digest.update(chunk.data)
                parts.append(chunk.data)
            if size == 0:
                raise InvalidArgument(
                    "upload is empty: send the encoded image bytes in UploadImageRequest.data", field="data"
                )
            sha = digest.hexdigest()
            if expected and expected != sha:
                raise InvalidArgument(
                    f"expected_sha256={expected[:80]} does not match the received bytes' sha256 {sha}",
                    field="expected_sha256",
                )
            data = b"".join(parts)
            parts.clear()
            await self.completions.run_in_executor(self.frontend.check_upload, data, "upload")
            sha2, already = self.uploads.put(data, sha256_hex=sha, tenant=tenant)
        except MmcastError as err:
            if err.fields == ("upload",):  # the image checks name the upload "upload"; on the wire it is `data`
                err.fields = ("data",)
            await rich_status.abort(context, err)
            return None
        except Exception:
            await abort_internal(context, "UploadImage", f"upload-{uuid.uuid4().hex}")
            return None
        finally:
            if tenant is not None and size:
                self.uploads.pending.release(tenant, size)
        return generation_pb2.UploadImageResponse(sha256=sha2, byte_size=size, already_present=already)

    async def GetServerInfo(self, request, context):
        try:
            return self.server_info()
        except Exception:
            await abort_internal(context, "GetServerInfo", f"info-{uuid.uuid4().hex}")
            return None
