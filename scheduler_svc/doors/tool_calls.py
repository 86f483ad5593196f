"""Tool calling on the OpenAI API: ``tools`` and ``tool_choice`` read and checked, the grammar that enforces
``required`` and a named function, and the answer's tool calls found by the family's parser
(``common/families/tool_calls.py``), whole or while it streams. The tools themselves reach the model through its
own chat template (the frontend passes them to it); assistant ``tool_calls`` and ``role: "tool"`` messages go
back through the same template."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from common.errors import InvalidArgument
from scheduler_svc.core.structured_output import GrammarSpec

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for function names


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools as the template and the grammar need them."""

    tools: tuple[dict, ...]  # [{"type": "function", "function": {...}}] as the client sent them (for the template)
    functions: tuple[dict, ...]  # each tool's function: name, description, parameters
    choice: str  # "auto" | "none" | "required" | "function" (one named function: ``name``)
    name: str = ""  # the function ``tool_choice`` names
    parallel: bool = True  # parallel_tool_calls: several calls in one answer

    @property
    def parse_calls(self) -> bool:
        """Whether the answer's tool calls are looked for (not under ``tool_choice: none``)."""
        return self.choice != "none"


def _function(tool: object, k: int) -> dict:
    where = f"tools[{k}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidArgument(f"{where}.type must be 'function'", field=f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise InvalidArgument(f"{where}.function is missing: give its name and parameters", field=f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"{where}.function.name={str(name)[:80]!r} must be 1-64 characters of [A-Za-z0-9_.-]",
            field=f"{where}.function.name",
        )
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidArgument(
            f"{where}.function.parameters must be a JSON Schema object", field=f"{where}.function.parameters"
        )
    return fn


def _choice(tool_choice: object, names: list[str]) -> tuple[str, str]:
    if tool_choice is None:
        return ("auto" if names else "none"), ""
    if tool_choice in ("auto", "none", "required"):
        if tool_choice == "required" and not names:
            raise InvalidArgument("tool_choice='required' needs tools", field="tool_choice")
        return tool_choice, ""
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidArgument(
            "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
            field="tool_choice",
        )
    if name not in names:
        raise InvalidArgument(
            f"tool_choice names the function {name[:80]!r}, which is not among tools ({', '.join(names) or 'none'})",
            field="tool_choice.function.name",
        )
    return "function", name


def parse_tools(tools: list | None, tool_choice: object, parallel: bool | None, tool_format) -> ToolRequest | None:
    """The request's tools (None: no tools and no tool choice). ``tool_format``: the family's parser, None where the
    family writes no tool calls (tools are then refused)."""
    if not tools and tool_choice in (None, "none", "auto"):
        return None
    functions = [_function(t, k) for k, t in enumerate(tools or [])]
    names = [f["name"] for f in functions]
    choice, name = _choice(tool_choice, names)
    if tool_format is None and choice != "none":
        raise InvalidArgument(
            "this model's family has no tool-call format; send the request without tools", field="tools"
        )
    return ToolRequest(tuple(tools or ()), tuple(functions), choice, name, parallel is not False)


def forced_grammar(req: ToolRequest | None, tool_format) -> GrammarSpec | None:
    """The grammar ``required`` and a named function impose (one call of the named function; one or more calls
    of any tool for ``required``, one only when ``parallel_tool_calls`` is false); None otherwise."""
    if req is None or req.choice not in ("required", "function"):
        return None
    functions = [f for f in req.functions if req.choice == "required" or f["name"] == req.name]
    several = req.choice == "required" and req.parallel
    return GrammarSpec("lark", tool_format.grammar(functions, several=several), "tool_choice")


def openai_calls(calls) -> list[dict]:
    """OpenAI ``tool_calls`` of parsed calls, each with a fresh id."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


def turn_calls(message, i: int) -> tuple[dict, ...]:
    """An OpenAI message's ``tool_calls`` as the chat template renders them (only an assistant's)."""
    if not message.tool_calls:
        return ()
    if message.role != "assistant":
        raise InvalidArgument(
            f"messages[{i}].tool_calls: only assistant messages carry tool calls", field=f"messages[{i}].tool_calls"
        )
    return tuple(
        {
            "name": c.function.name,
            "arguments": template_arguments(c.function.arguments, f"messages[{i}].tool_calls[{k}].function.arguments"),
        }
        for k, c in enumerate(message.tool_calls)
    )


def template_arguments(arguments: object, where: str) -> dict:
    """An assistant message's tool-call arguments (OpenAI sends JSON text) as the object chat templates render."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be a JSON object (as text)", field=where)
    return value


class CallStream:
    """Splits a streamed answer into content and tool calls: text is passed on as content until a tool call may be
    starting (a prefix of the format's start marker is held back); from the first call on, text is held and the
    calls are parsed once the answer ends."""

    def __init__(self, tool_format) -> None:
        self.format = tool_format
        self.text = ""  # the whole answer so far
        self.sent = 0  # characters of text already passed on as content
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """Content to pass on now for ``delta`` (possibly "")."""
        self.text += delta
        if self.in_calls:
            return ""
        start = self.format.start
        at = self.text.find(start, self.sent)
        if at >= 0:
            self.in_calls = True
            out, self.sent = self.text[self.sent : at], at
            return out
        keep = 0  # the longest tail that could begin the start marker
        for n in range(min(len(start) - 1, len(self.text) - self.sent), 0, -1):
            if start.startswith(self.text[-n:]):
                keep = n
                break
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, list]:
        """(content not yet passed on, calls) once the answer has ended."""
        content, calls = self.format.parse(self.text)
        if not calls:
            return self.text[self.sent :], []
        return content[self.sent :], calls


def request_grammar(body, tool_format) -> tuple[ToolRequest | None, GrammarSpec | None]:
    """A chat body's tools and the one grammar it asks for: a forced tool call's, or its structured output's
    (grammar_requests.py); both at once is refused."""
    from scheduler_svc.doors import grammar_requests

    tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls, tool_format)
    forced = forced_grammar(tools, tool_format)
    grammar = grammar_requests.from_openai(body)
    if forced is not None and grammar is not None:
        raise InvalidArgument(
            f"tool_choice={tools.choice!r} forces a tool call; it cannot be combined with {grammar.field}",
            field=grammar.field,
        )
    return tools, forced or grammar


def whole_answer(text: str, finish_reason: str, tool_format) -> tuple[dict, str]:
    """The assistant message of a whole answer and its finish reason: with tool calls, ``tool_calls`` (the text
    before them is the content, None when empty) and "tool_calls"."""
    content, calls = tool_format.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content or None, "tool_calls": openai_calls(calls)}, "tool_calls"


def streamed_delta(calls) -> dict | None:
    """The ``tool_calls`` delta of a streamed answer's calls (each whole, with its index); None without calls."""
    return {"tool_calls": [{"index": k, **c} for k, c in enumerate(openai_calls(calls))]} if calls else None
