"""The client-facing ``mmcast.v1.GenerationService`` servicer. It only translates: proto → domain objects (request_parsing.py),
the frontend and the engine decide, events → proto. Status codes and their ``google.rpc`` details come from the
``common.errors`` exception, through ``common.rich_status`` (docs/ERRORS.md).

Any other exception is a bug of the server, not of the request: the client gets ``INTERNAL`` with the request id
(an id made for the call where the RPC has none) and the log holds the traceback under that id — never gRPC's
``UNKNOWN`` with a Python class name."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc

from common import rich_status, tracing
from common.errors import InvalidArgument, MmcastError, ResourceExhausted, Status, Unavailable
from common.rich_status import grpc_code
from mmcast.v1 import generation_pb2, generation_pb2_grpc, logprob_pb2
from scheduler_svc import request_parsing
from scheduler_svc.detok import TextStream
from scheduler_svc.engine import Engine, FinishEvent, RequestHandle, TokenEvent
from scheduler_svc.request_log import RequestSummary
from scheduler_svc.tenancy import scoped_cache_salt, scoped_request_id

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


def _summary(handle: RequestHandle, finish: FinishEvent, processed, completion_tokens: int, ttft: float | None,
              tenant: str) -> RequestSummary:
    """What the final message and the finished-request log line report, taken once."""
    u = handle.usage
    now = time.monotonic()
    error = finish.error
    return RequestSummary(
        request_id=handle.request_id,
        tenant=tenant,
        finish_reason=finish.reason,
        prompt_tokens=len(processed.token_ids),
        completion_tokens=completion_tokens,
        cached_tokens=u.cached_tokens,
        images=len(processed.mm_features),
        payload_bytes_broadcast=u.payload_bytes_sent,
        payload_bytes_saved=(u.payload_bytes_saved_prefix_covered + u.payload_bytes_saved_rank_cached
                             + u.payload_bytes_saved_encoder_shared),
        preemptions=u.preemptions,
        time_to_first_token_seconds=ttft,
        total_seconds=now - handle.received_at,
        queue_seconds=(handle.first_scheduled_at or now) - handle.received_at,
        error_code=error.status.value if error is not None else "",
        error=error.message if error is not None else "",
    )


class GenerationServiceServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self, *, engine: Engine, frontend, uploads, config, tokenizer, make_request, server_info, tokens=None
    ) -> None:
        self.engine = engine
        self.frontend = frontend
        self.uploads = uploads
        self.config = config
        self.tokenizer = tokenizer
        self.make_request = make_request  # (request_id, processed prompt, SamplingSpec, cache_salt) -> core Request
        self.server_info = server_info  # () -> generation_pb2.GetServerInfoResponse
        self.tokens = tokens  # common.auth.TokenTable, or None when authentication is off (one tenant, "")
        # Every header check, decode and tokenization runs here, never on the event loop; the frontend bounds how
        # many decodes run at once (--max-concurrent-decodes) and gives each thread its own tokenizer.
        self.executor = ThreadPoolExecutor(max_workers=config.frontend_threads, thread_name_prefix="frontend")
        self.draining = False

    def _tenant(self, context) -> str:
        """The caller's tenant ("" when authentication is off). The interceptor has already checked the token;
        this only fails when the token file changed in between."""
        if self.tokens is None:
            return ""
        tenant, problem = self.tokens.authenticate(context.invocation_metadata())
        if tenant is None:
            raise MmcastError(problem, Status.UNAUTHENTICATED)
        return tenant

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        received = time.monotonic()
        client_id = request.request_id or f"req-{uuid.uuid4().hex}"
        request_id = client_id
        log_extra = {"request_id": request_id}
        handle = None
        try:
            if self.draining:
                raise Unavailable("the server is draining for shutdown; retry on another replica")
            tenant = self._tenant(context)
            request_id = scoped_request_id(tenant, client_id)
            log_extra = {"request_id": request_id}
            request_parsing.check_request_id(request.request_id)
            request_parsing.check_cache_salt(request.cache_salt)
            sampling = request_parsing.parse_sampling(
                request.sampling,
                max_tokens_limit=self.config.max_tokens_limit,
                max_logprobs=self.config.max_logprobs,
                vocab_size=self.frontend.vocab_size,
            )
            turns = request_parsing.parse_messages(request.messages, max_images=self.config.max_images_per_request)
            loop = asyncio.get_running_loop()
            add_gen = not request.continue_final_message
            with tracing.span("mmcast.frontend", request_id=request_id) as current:  # decode, preprocess, tokenize
                processed = await loop.run_in_executor(
                    self.executor,
                    functools.partial(self.frontend.process, turns, add_generation_prompt=add_gen, tenant=tenant,
                                      reserve_tokens=sampling.max_tokens, context=self.engine.max_model_len),
                )
                tracing.set_attributes(current, prompt_tokens=len(processed.token_ids),
                                       images=len(processed.mm_features))
            limit = self.engine.max_model_len
            if len(processed.token_ids) + sampling.max_tokens > limit:
                raise InvalidArgument(
                    f"prompt has {len(processed.token_ids)} tokens and sampling.max_tokens={sampling.max_tokens}: "
                    f"together {len(processed.token_ids) + sampling.max_tokens} exceed the model context {limit}",
                    field=("messages", "sampling.max_tokens"),
                )
            salt = scoped_cache_salt(tenant, request.cache_salt)
            handle = self.engine.submit(self.make_request(request_id, processed, sampling, salt), received)
            self.frontend.commit(processed)  # admitted: only now may its new images enter the processor cache
        except MmcastError as err:
            log.info("request rejected: %s", err.message, extra={**log_extra, "code": err.status.value})
            await rich_status.abort(context, err)
            return
        except Exception:
            if handle is not None:  # admitted before the failure: free what it holds
                self.engine.finish(handle.request_id, "cancelled")
            await abort_internal(context, "Generate", client_id)
            return
        log.info("request admitted", extra={**log_extra, "prompt_tokens": len(processed.token_ids)})
        try:
            async for response in self._stream(handle, processed, sampling, received, context, client_id, tenant):
                yield response
        except grpc.aio.AbortError:  # a status the stream set on purpose
            raise
        except Exception:
            await abort_internal(context, "Generate", client_id)

    async def _stream(
        self, handle: RequestHandle, processed, sampling: request_parsing.SamplingSpec, received: float, context, client_id: str,
        tenant: str,
    ):
        text = TextStream(self.tokenizer, sampling.stop)
        completion_tokens = 0
        finish: FinishEvent | None = None
        ttft = None
        summary: RequestSummary | None = None
        try:
            while finish is None:
                event = await handle.events.get()
                if isinstance(event, FinishEvent):
                    finish = event
                    if event.error is not None and completion_tokens == 0:
                        # nothing streamed yet: a plain status, which clients may retry (UNAVAILABLE)
                        await rich_status.abort(context, event.error)
                    break
                assert isinstance(event, TokenEvent)
                ids = event.token_ids[: sampling.max_tokens - completion_tokens]
                completion_tokens += len(ids)
                if ttft is None:
                    ttft = time.monotonic() - received
                delta = generation_pb2.TokenDelta(token_ids=ids, text=text.add(ids))
                if sampling.return_logprobs:
                    for tok, lp in zip(ids, event.logprobs, strict=False):
                        logprob, top = lp
                        delta.logprobs.append(
                            generation_pb2.TokenLogprob(
                                token_id=tok,
                                logprob=logprob,
                                top_logprobs=[logprob_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top],
                            )
                        )
                if text.stopped_by is not None:
                    self.engine.finish(handle.request_id, "stop")
                    finish = FinishEvent("stop")
                yield generation_pb2.GenerateResponse(delta=delta)
            tail = text.flush()
            if tail:
                yield generation_pb2.GenerateResponse(delta=generation_pb2.TokenDelta(text=tail))
            summary = _summary(handle, finish, processed, completion_tokens, ttft, tenant)
            final = self._final(handle, finish, summary, processed, text)
            final.request_id = client_id
            yield generation_pb2.GenerateResponse(final=final)
        finally:
            if not handle.finished:
                self.engine.finish(handle.request_id, "cancelled")
                log.info("request cancelled by the client", extra={"request_id": handle.request_id})
                finish = FinishEvent("cancelled")
            if summary is None:  # no final message went out: the client left, or the request failed first
                summary = _summary(handle, finish or FinishEvent("cancelled"), processed, completion_tokens, ttft,
                                   tenant)
            summary.log(log)

    def _final(self, handle, finish: FinishEvent, summary: RequestSummary, processed, text) -> generation_pb2.GenerateFinal:
        """The final message; what the finished-request log line also carries comes from ``summary``."""
        u = handle.usage
        final = generation_pb2.GenerateFinal(
            finish_reason=_FINISH.get(finish.reason, generation_pb2.FINISH_REASON_ERROR),
            request_id=handle.request_id,
            stop_reason=text.stopped_by or "",
            usage=generation_pb2.Usage(
                prompt_tokens=summary.prompt_tokens,
                completion_tokens=summary.completion_tokens,
                cached_tokens=summary.cached_tokens,
                images=summary.images,
                images_sent=u.items_sent,
                images_stripped=u.items_stripped,
                images_rank_cached=u.items_rank_cached,
                payload_bytes_broadcast=summary.payload_bytes_broadcast,
                payload_bytes_saved=summary.payload_bytes_saved,
                preemptions=summary.preemptions,
                encoder_runs=u.encoder_runs,
                encoder_output_bytes_shared=u.encoder_output_bytes_shared,
                image_cpu_time=timedelta(seconds=processed.image_cpu_seconds),
                images_encoder_shared=u.items_encoder_shared,
            ),
            timings=generation_pb2.Timings(
                time_to_first_token=timedelta(seconds=summary.time_to_first_token_seconds or 0.0),
                total_time=timedelta(seconds=summary.total_seconds),
                queue_time=timedelta(seconds=summary.queue_seconds),
            ),
        )
        if finish.error is not None:
            final.error.grpc_code = grpc_code(finish.error).value[0]
            final.error.message = finish.error.message
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
                raise InvalidArgument("upload is empty: send the encoded image bytes in UploadImageRequest.data",
                                      field="data")
            sha = digest.hexdigest()
            if expected and expected != sha:
                raise InvalidArgument(f"expected_sha256={expected[:80]} does not match the received bytes' sha256 {sha}",
                                      field="expected_sha256")
            data = b"".join(parts)
            parts.clear()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.executor, self.frontend.check_image_header, data, "upload")
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
