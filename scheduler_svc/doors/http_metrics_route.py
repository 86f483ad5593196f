"""``GET /metrics`` on the HTTP port too (as vLLM serves it beside its API), so a deployment that exposes one port
can be scraped through it. The scheduler's registry is the one ``--metrics-port`` serves; when authentication is on
(``--auth-tokens-file``) the route asks for a bearer token of any tenant, as every API route does: the metrics name
request counts and cache sizes an unauthenticated caller has no business reading."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from common.errors import MmcastError
from scheduler_svc.doors import openai_errors


class MetricsRoute:
    """The route's handler: ``api`` (openai_api.OpenAIApi) authenticates; ``registry`` is the scheduler's."""

    def __init__(self, api, registry) -> None:
        self.api, self.registry = api, registry

    async def serve(self, request: Request) -> Response:
        try:
            self.api._tenant(request)
        except MmcastError as err:
            return self.api._error(openai_errors.from_mmcast(err))
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
