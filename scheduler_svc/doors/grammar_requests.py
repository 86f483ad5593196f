"""Which grammar a request asks for, read from either door's fields: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and ``guided_*`` extras, and the gRPC ``StructuredOutput``. At most one may be given;
each refusal names the field. The grammar itself is compiled at admission (``structured_output.py``)."""

from __future__ import annotations

import json

from common.errors import InvalidArgument
from scheduler_svc.core.structured_output import GrammarSpec

# vLLM's StructuredOutputsParams keys that mmcast serves (grammar and structural_tag are refused by name).
_STRUCTURED_KEYS = ("json", "regex", "choice", "json_object")


def _schema(value: object, field: str) -> GrammarSpec:
    if isinstance(value, str):  # vLLM accepts the schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidArgument(f"{field} is not valid JSON: {exc}", field=field) from None
    return GrammarSpec.json_schema(value, field)


def _regex(value: object, field: str) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{field} must be a non-empty regular expression", field=field)
    return GrammarSpec("regex", value, field)


def _response_format(fmt: dict) -> GrammarSpec | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidArgument(
                "response_format.json_schema.schema is missing: give the JSON Schema the answer must follow",
                field="response_format.json_schema.schema",
            )
        return _schema(spec["schema"], "response_format.json_schema.schema")
    raise InvalidArgument(
        f"response_format.type={str(kind)[:40]!r} is not supported; one of 'text', 'json_object', 'json_schema'",
        field="response_format.type",
    )


def _structured_outputs(so: dict) -> GrammarSpec | None:
    given = [k for k, v in so.items() if v not in (None, False)]
    unknown = [k for k in given if k not in _STRUCTURED_KEYS and k not in ("disable_fallback", "whitespace_pattern")]
    if unknown:
        raise InvalidArgument(
            f"structured_outputs.{unknown[0]} is not supported; one of {', '.join(_STRUCTURED_KEYS)}",
            field=f"structured_outputs.{unknown[0]}",
        )
    kinds = [k for k in given if k in _STRUCTURED_KEYS]
    if len(kinds) > 1:
        raise InvalidArgument(f"structured_outputs: give one of {kinds}, not several", field="structured_outputs")
    if not kinds:
        return None
    key, value = kinds[0], so[kinds[0]]
    field = f"structured_outputs.{key}"
    if key == "json":
        return _schema(value, field)
    if key == "regex":
        return _regex(value, field)
    if key == "choice":
        return GrammarSpec.choice(value if isinstance(value, list) else [], field)
    return GrammarSpec("json_object", "", field)


def from_openai(body) -> GrammarSpec | None:
    """The grammar an OpenAI-API body asks for (None: unconstrained)."""
    found: list[GrammarSpec] = []
    fmt = getattr(body, "response_format", None)
    if fmt:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(spec)
    so = getattr(body, "structured_outputs", None)
    if so:
        spec = _structured_outputs(so)
        if spec is not None:
            found.append(spec)
    if getattr(body, "guided_json", None) is not None:
        found.append(_schema(body.guided_json, "guided_json"))
    if getattr(body, "guided_regex", None) is not None:
        found.append(_regex(body.guided_regex, "guided_regex"))
    if getattr(body, "guided_choice", None) is not None:
        found.append(GrammarSpec.choice(body.guided_choice, "guided_choice"))
    if len(found) > 1:
        names = ", ".join(s.field for s in found)
        raise InvalidArgument(f"give one structured-output constraint, not several ({names})", field=found[1].field)
    return found[0] if found else None


def from_proto(msg) -> GrammarSpec | None:
    """The grammar of a gRPC ``GenerateRequest`` (its ``structured_output``; None when unset)."""
    if not msg.HasField("structured_output"):
        return None
    so = msg.structured_output
    kind = so.WhichOneof("kind")
    field = f"structured_output.{kind}"
    if kind == "json_schema":
        return _schema(so.json_schema, field)
    if kind == "json_object":
        return GrammarSpec("json_object", "", field) if so.json_object else None
    if kind == "regex":
        return _regex(so.regex, field)
    if kind == "choice":
        return GrammarSpec.choice(list(so.choice.choices), "structured_output.choice.choices")
    return None
