"""Renders README.md's table of OpenAI request parameters — served, refused or ignored, per endpoint — from the
request schema and from what the HTTP door really refuses, so the table cannot drift from the code.

    .venv/bin/python scripts/openai_params_doc.py          # rewrite the table in README.md
    .venv/bin/python scripts/openai_params_doc.py --check  # exit 1 when the committed table differs

Every top-level field of the endpoints' pydantic models (``scheduler_svc/doors/openai_schema.py``) is a row. Its status
comes from the door itself: the script builds the HTTP app in-process (no model, no engine) and sends each endpoint
a body with that field at a non-default value and a model name the server does not serve. The door checks
unsupported parameters before the model, so a 400 ``unsupported`` naming the field means "refused unless left at
its neutral value", and the model's 404 means the value got through ("served"). Fields the schema accepts and does
not use are listed in ``openai_schema.IGNORED``. The table replaces what stands between the
``<!-- openai-params:begin -->`` / ``<!-- openai-params:end -->`` markers.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- openai-params:begin -->", "<!-- openai-params:end -->"
# Values tried for a field, in order: the first that the schema accepts and that differs from the default is sent.
CANDIDATES = (
    True,
    2,
    0.5,
    "required",
    "probe",
    {"type": "json_object", "format": {"type": "json_object"}},  # response_format, and the Responses API's text
    {"1": 1.0},
    [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    ["probe"],
    [1],
)
# What each endpoint needs besides the probed field (the model is one the server does not serve).
REQUIRED = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
    "/v1/completions": {"prompt": "x"},
    "/v1/responses": {"input": "x"},
}


def _schemas() -> dict:
    from scheduler_svc.doors import openai_schema

    return {
        "/v1/chat/completions": openai_schema.ChatCompletionBody,
        "/v1/completions": openai_schema.CompletionBody,
        "/v1/responses": openai_schema.ResponsesBody,
    }


def _client():
    from starlette.testclient import TestClient

    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.doors.openai_api import OpenAIApi

    family = types.SimpleNamespace(tool_format="hermes")  # the Qwen-VL families' tool calls
    frontend = types.SimpleNamespace(vocab_size=1024, image_token_id=None, video_token_id=None, family=family)
    completions = types.SimpleNamespace(frontend=frontend, config=SchedulerConfig(), tokenizer=None)
    api = OpenAIApi(
        completions=completions, uploads=None, media=None, model_name="served", tokens=None, max_body_bytes=1 << 20
    )
    return TestClient(api.app())


def _samples(schema, field: str, path: str) -> list:
    """The candidate values of ``field`` the schema accepts (read as JSON, as the door reads it) and that differ
    from its default."""
    default, found = schema.model_fields[field].default, []
    for value in CANDIDATES:
        try:
            got = getattr(schema.model_validate_json(json.dumps({"model": "m", **REQUIRED[path], field: value})), field)
        except ValueError:  # not a value of this field
            continue
        if got != default or type(got) is not type(default):
            found.append(value)
    return found


def statuses() -> dict[str, dict[str, str]]:
    """parameter -> endpoint -> "served" | "refused" | "ignored". Refused: some value of it other than the default
    gets a 400 ``unsupported`` naming it."""
    from scheduler_svc.doors.openai_schema import IGNORED

    client, table = _client(), {}
    for path, schema in _schemas().items():
        for field in schema.model_fields:
            status = "served"
            if field in IGNORED:
                status = "ignored"
            elif field not in ("model", *REQUIRED[path]):
                for value in _samples(schema, field, path):
                    error = client.post(path, json={"model": "not-served", **REQUIRED[path], field: value}).json()
                    error = error.get("error", {})
                    if error.get("code") == "unsupported" and (error.get("param") or "").startswith(field):
                        status = "refused"
                        break
            table.setdefault(field, {})[path] = status
    return table


def render_table(table: dict[str, dict[str, str]] | None = None) -> str:
    paths = list(REQUIRED)
    rows = [
        "| parameter | " + " | ".join(f"`{p}`" for p in paths) + " |",
        "|---|" + "---|" * len(paths),
    ]
    for field, by_path in sorted((table or statuses()).items()):
        rows.append(f"| `{field}` | " + " | ".join(by_path.get(p, "—") for p in paths) + " |")
    return "\n".join(rows)


def render(current: str, table: dict[str, dict[str, str]] | None = None) -> str:
    head, found, rest = current.partition(BEGIN)
    if not found or END not in rest:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
    return f"{head}{BEGIN}\n{render_table(table)}\n{END}{rest.partition(END)[2]}"


def main(argv: list[str]) -> int:
    current = README.read_text()
    fresh = render(current)
    if "--check" in argv:
        if fresh != current:
            print("README.md's OpenAI parameter table is stale: run .venv/bin/python scripts/openai_params_doc.py")
            return 1
        return 0
    if fresh != current:
        README.write_text(fresh)
        print("rewrote: README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
