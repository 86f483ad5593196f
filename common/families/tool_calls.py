"""How a family's checkpoints write tool calls in their answers: the parser that finds them, and the grammar that
forces them (``tool_choice`` ``required`` or a named function). A family names its format (``Family.tool_format``);
the Qwen-VL families use the Hermes style their chat templates teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Plain Python and json only: the light package rule of ``common/families`` holds.
"""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str  # the function's name
    arguments: str  # its arguments as JSON text (an object)


class HermesToolCalls:
    """``<tool_call>{json}</tool_call>`` blocks; text before the first block is the answer's content."""

    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a whole answer. A block that is not a JSON object with a string ``name`` and object
        ``arguments`` ends the calls: it and what follows stay content, as the model wrote them."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls: list[ParsedCall] = []
        at = first
        while at >= 0:
            close = text.find(self.end, at)
            body = text[at + len(self.start) : close if close >= 0 else len(text)]
            call = self._call(body)
            if call is None:
                break
            calls.append(call)
            at = -1 if close < 0 else text.find(self.start, close)
        if not calls:
            return text, []
        return text[:first].rstrip("\n"), calls

    @staticmethod
    def _call(body: str) -> ParsedCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def grammar(self, functions: list[dict], *, several: bool) -> str:
        """A Lark grammar (llguidance's, with ``%json``) whose sentences are tool calls of ``functions`` (each
        ``{"name": ..., "parameters": schema}``) as this format writes them: one call, or with ``several`` one or
        more separated by a newline."""
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        start = 'start: call ("\\n" call)*' if several else "start: call"
        return f'{start}\ncall: "{self.start}\\n" body "\\n{self.end}"\nbody: %json {json.dumps(schema)}\n'


FORMATS = {"hermes": HermesToolCalls()}


def tool_calls_of(format_name: str | None):
    """The parser of a family's ``tool_format``; None where the family has none (tools are then refused)."""
    return FORMATS.get(format_name) if format_name else None
