"""The OpenAI-compatible HTTP API: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, as a Starlette application served beside the gRPC API in the scheduler process (http_server.py).

It only translates, as the gRPC servicer does: JSON (validated by openai_schema.py) -> a ``CompletionRequest`` for
the shared request path (completion.py), its chunks -> OpenAI's response objects or server-sent events; errors ->
OpenAI's error shape (openai_errors.py). The limits, tenants, caches and accounting are the gRPC API's own.

Images: ``image_url.url`` is a ``data:image/...;base64,`` URL (remote and local URLs only where the operator allowed
them: media_urls.py), or ``image_url`` is null and ``uuid`` is ``sha256:<hex>`` of an image the server holds — one
uploaded with ``UploadImage`` or sent inline in an earlier request of the same tenant (inline images are kept in
the upload store, within ``--upload-store-bytes``, once their request is admitted).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.errors import IMAGE_RESOURCE, InvalidArgument, MmcastError, NotFound, Status
from common.families.tool_calls import tool_calls_of
from scheduler_svc.doors import media_aliases, openai_errors, openai_sampling, openai_schema, request_parsing
from scheduler_svc.doors.http_server import HTTP_ROUTES
from scheduler_svc.doors.openai_answers import ChatAnswers
from scheduler_svc.doors.openai_bodies import BodyReading, Call, check_neutral
from scheduler_svc.doors.openai_choices import Choices
from scheduler_svc.doors.openai_completions import TextCompletions
from scheduler_svc.doors.openai_errors import HttpError
from scheduler_svc.doors.openai_media import MediaParts
from scheduler_svc.doors.openai_responses import Responses
from scheduler_svc.doors.openai_sse import ClientGone
from scheduler_svc.engine import affinity_key
from scheduler_svc.engine.completion import Completion, Completions

log = logging.getLogger(__name__)


class OpenAIApi(BodyReading, MediaParts, ChatAnswers):
    """The routes. ``tokens`` (common.auth.TokenTable or None) and tenants are exactly the gRPC API's."""

    def __init__(
        self,
        *,
        completions: Completions,
        uploads,
        media,
        model_name: str,
        tokens=None,
        max_body_bytes: int,
        metrics_registry=None,
    ) -> None:
        self.completions = completions
        self.frontend = completions.frontend
        self.config = completions.config
        self.uploads = uploads
        self.media = media  # media_urls.MediaLoader
        self.model_name = model_name
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self.tool_format = tool_calls_of(self.frontend.family.tool_format)  # the family's tool-call parser
        self.text = TextCompletions(self)  # /v1/completions: prompt lists, token-id prompts, echo
        self.responses = Responses(self)  # /v1/responses, with its previous_response_id store
        self.aliases = media_aliases.MediaAliases()  # caller-chosen uuids, per tenant
        # a data: URL's text (its sha256) -> the sha256 of its bytes, per tenant: sent again while the upload store
        # holds those bytes, it is neither decoded nor hashed again (openai_media.py)
        self.data_urls = media_aliases.MediaAliases()
        self.metrics_registry = metrics_registry  # the scheduler's, served at /metrics too (None: no route)

    def app(self, middleware=None) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.text_completions, methods=["POST"]),
            Route("/v1/responses", self.responses.serve, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        if self.metrics_registry is not None:
            from scheduler_svc.doors.http_metrics_route import MetricsRoute

            routes.append(Route("/metrics", MetricsRoute(self, self.metrics_registry).serve, methods=["GET"]))
        app = Starlette(
            routes=routes,
            middleware=middleware or [],
            exception_handlers={404: self._not_found, 405: self._method_not_allowed},
        )
        return app

    # --- routes -----------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.completions.engine.ready and not self.completions.draining:
            return Response(status_code=200)
        why = "draining for shutdown" if self.completions.draining else "the worker group is not serving"
        return self._error(HttpError(503, f"not ready: {why}", type="service_unavailable_error", code="unavailable"))

    async def models(self, request: Request) -> Response:
        try:
            self._tenant(request)
        except MmcastError as err:
            return self._error(openai_errors.from_mmcast(err))
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "mmcast",
            "max_model_len": self.completions.engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def text_completions(self, request: Request) -> Response:
        return await self._serve(request, "text")

    async def _serve(self, request: Request, kind: str) -> Response:
        received = time.monotonic()
        call: Call | None = None
        try:
            tenant = self._tenant(request)
            schema = openai_schema.ChatCompletionBody if kind == "chat" else openai_schema.CompletionBody
            body = await self._read(request, schema)
            check_neutral(body)
            openai_sampling.check_choices(body, self.config.max_choices)
            self._check_model(body.model)
            call = self._new_call(request, tenant, body.model, kind)
            if kind == "text":
                completion = await self.text.admit(request, call, body, received)
            else:
                req = await self._completion_request(call, body, received)
                if body.n > 1 and call.tools is not None:
                    raise HttpError(
                        400,
                        f"n={body.n} with tools is not served: each choice's tool calls would need a parser of its "
                        "own; send n=1 (or omit it) with tools, or tool_choice=none",
                        param="n",
                        code="unsupported",
                    )
                if body.n > 1:
                    choices = Choices(self, call, body, req)
                    first = await self._until_disconnect(request, choices.admit())
                else:
                    completion = await self._until_disconnect(request, self.completions.admit(req))
                self._keep_inline(call)
        except HttpError as err:
            return self._error(err)
        except MmcastError as err:
            log.info(
                "request rejected: %s",
                err.message,
                extra={"request_id": call.client_id if call else "", "code": err.status.value},
            )
            return self._error(self._http_error(err, call))
        except ClientGone:
            return Response(status_code=499)
        except Exception:
            return self._internal(call)
        if kind == "text":
            return await self.text.respond(request, call, body, completion)
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        if body.n > 1:
            return choices.stream(first, include_usage) if body.stream else await choices.whole(request, first)
        if body.stream:
            return await self._stream(request, call, completion, include_usage)
        return await self._whole(request, call, completion)

    # --- helpers ----------------------------------------------------------------------------------------------
    @staticmethod
    def _headers(call: Call, completion: Completion) -> dict:
        """An answer's headers: its request id, and the conversation key for a client routing through a proxy
        (it sends it back as the x-mmcast-affinity request header on later turns: affinity_key.py)."""
        return {"x-request-id": call.client_id, affinity_key.AFFINITY_HEADER: completion.affinity}

    def _tenant(self, request: Request) -> str:
        if self.tokens is None:
            return ""
        tenant, problem = self.tokens.authenticate(
            [("authorization", v) for v in request.headers.getlist("authorization")]
        )
        if tenant is None:
            raise MmcastError(problem.replace("metadata", "header"), Status.UNAUTHENTICATED)
        return tenant

    @staticmethod
    def _client_id(request: Request) -> str:
        """The request id to echo: x-request-id, else one made up. A label here, which clients may reuse
        (CompletionRequest.id_reusable)."""
        given = request.headers.get("x-request-id", "")
        try:
            request_parsing.check_request_id(given)
        except InvalidArgument as err:
            raise HttpError(
                400,
                err.message.replace("request_id", "the x-request-id header"),
                param="x-request-id",
                code="invalid_value",
            ) from None
        return given or uuid.uuid4().hex

    @staticmethod
    async def _until_disconnect(request: Request, awaitable):
        """``awaitable``'s result, or ``ClientGone`` (with the awaitable cancelled) if the client disconnects
        first: a client that leaves while its request waits for the model cancels it."""
        work = asyncio.ensure_future(awaitable)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():
            work.cancel()
            try:
                await work
            except (asyncio.CancelledError, Exception):
                pass
            raise ClientGone()
        return work.result()

    def _http_error(self, err: MmcastError, call: Call | None) -> HttpError:
        names = call.names if call else {}
        if (
            isinstance(err, NotFound)
            and err.resource is not None
            and err.resource.type == IMAGE_RESOURCE
            and call
            and err.resource.name in call.uuid_fields
        ):
            field, given = call.uuid_fields[err.resource.name]
            return HttpError(
                404,
                f"{field}={given} names no image this server holds (never "
                "sent or uploaded by this tenant, or evicted from the upload store, "
                "--upload-store-bytes); send the image itself",
                type="not_found_error",
                param=field,
                code="image_not_found",
            )
        return openai_errors.from_mmcast(err, names)

    @staticmethod
    def _error(err: HttpError) -> Response:
        return Response(
            openai_errors.body(err.message, err.type, err.param, err.code),
            status_code=err.status,
            media_type="application/json",
            headers=err.headers,
        )

    def _internal(self, call: Call | None) -> Response:
        return self._error(self._internal_error(call))

    @staticmethod
    def _internal_error(call: Call | None) -> HttpError:
        """Logs the exception being handled under the request id; the client gets the id, not the exception."""
        request_id = call.client_id if call else f"http-{uuid.uuid4().hex}"
        log.exception("unexpected error in the HTTP API", extra={"request_id": request_id})
        return HttpError(
            500,
            f"internal server error (request_id={request_id}); the server log records the cause under this id",
            type="server_error",
            code="internal",
        )

    async def _not_found(self, request: Request, exc) -> Response:
        return self._error(
            HttpError(
                404,
                f"no route {request.url.path[:200]!r}; this server serves "
                f"{', '.join(HTTP_ROUTES[:-1])} and {HTTP_ROUTES[-1]}",
                type="not_found_error",
                code="not_found",
            )
        )

    async def _method_not_allowed(self, request: Request, exc) -> Response:
        return self._error(
            HttpError(405, f"{request.method} is not allowed on {request.url.path[:200]}", code="method_not_allowed")
        )
