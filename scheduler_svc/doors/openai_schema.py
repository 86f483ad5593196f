"""The request bodies of the OpenAI-compatible HTTP API, as pydantic models.

What the models check is the JSON's shape: types, required fields, enumerations, and the ranges a value must have
to mean anything at all (``n >= 1``, ``max_tokens >= 1``). The server's own limits (``--max-tokens-limit``,
``--max-logprobs``, the context, image sizes) are checked afterwards by the same code the gRPC API uses
(request_parsing.py, frontend.py), so one limit has one check and one message.

Unknown fields are ignored, as OpenAI's API ignores them; parameters of OpenAI's API that mmcast does not implement
are accepted at their neutral value and refused otherwise (``UNSUPPORTED``), never silently dropped. vLLM's extra
sampling fields (``top_k``, ``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``, ``min_tokens``,
``bad_words``, ``cache_salt``, ``add_generation_prompt``, ``continue_final_message``) are read as vLLM reads them;
the penalties' ranges are common/penalties.py's, shared with the gRPC API.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_UINT31 = 2**31 - 1
_INT64 = 2**63


_TokenId = Annotated[int, Field(ge=0, le=_UINT31)]
# Top-level fields accepted and not used (README.md's parameter table lists them as ignored: scripts/openai_params_doc.py).
IGNORED = frozenset({"user", "parallel_tool_calls"})


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Body):
    url: str  # data:image/...;base64,..., or http(s):// / file:// where the server allows them
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the resolution


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class ImageContentPart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL | None = None  # null: ``uuid`` names an image the server already holds
    uuid: str | None = None  # "sha256:<hex>" of the bytes, or a caller-chosen id (media_aliases.py), per tenant


class VideoURL(_Body):
    url: str  # data:video/...;base64,..., or http(s):// / file:// where the server allows them


class VideoContentPart(_Body):
    type: Literal["video_url"]
    video_url: VideoURL | None = None  # null: ``uuid`` names a video the server already holds
    uuid: str | None = None  # "sha256:<hex>" of the file's bytes, or a caller-chosen id (media_aliases.py)


ContentPart = Annotated[TextContentPart | ImageContentPart | VideoContentPart, Field(discriminator="type")]


class ToolCallFunction(_Body):
    name: str
    arguments: str | dict[str, Any]  # JSON text (OpenAI); an object is taken as is


class ToolCall(_Body):
    id: str | None = None  # accepted; the template renders calls by name, a tool answer follows its call's order
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    # "developer" is OpenAI's newer name for "system"; "tool" carries a tool's result back (tool_calls.py)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted, not used: the chat template has no place for it
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls, rendered by the chat template
    tool_call_id: str | None = None  # a tool message's call (accepted; the template follows the calls' order)


class StreamOptions(_Body):
    include_usage: bool = False  # one more chunk before [DONE]: no choices, the whole request's usage


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=_UINT31)] | None = None  # None: chat, the context left; completions 16
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=-1, le=_UINT31)] | None = None  # vLLM: -1 and 0 = no top-k cut
    seed: Annotated[int, Field(ge=-_INT64, lt=2**64)] | None = None  # reduced modulo 2^64, as the ranks do
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_UINT31)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=_UINT31)] = 1  # choices; up to --max-choices (openai_choices.py)
    ignore_eos: bool = False
    user: str | None = None  # accepted, not used
    cache_salt: str | None = None  # requests share prefix-cache blocks only when their salts are equal
    # Ranges checked by common/penalties.py, as for the gRPC API:
    presence_penalty: float | None = None  # [-2, 2]
    frequency_penalty: float | None = None  # [-2, 2]
    repetition_penalty: float | None = None  # (0, 1000]; vLLM's: over prompt and output tokens
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    min_tokens: Annotated[int, Field(ge=0, le=_UINT31)] | None = None  # <= max_tokens
    best_of: Annotated[int, Field(ge=1, le=_UINT31)] | None = None  # only equal to n
    bad_words: list[str] | None = None  # vLLM's: words never generated
    # Structured output (vLLM's extras; chat also reads response_format): at most one, see grammar_requests.py.
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None  # a JSON Schema (object or JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


class ChatCompletionBody(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=_UINT31)] | None = None  # OpenAI's newer max_tokens
    logprobs: bool = False  # True: the sampled tokens' log-probabilities
    top_logprobs: Annotated[int, Field(ge=0, le=_UINT31)] | None = None  # alternatives per token; needs logprobs
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras for the processor and the media loader; mmcast reads the video sampling in them (fps,
    # num_frames, max_frames, min_pixels, max_pixels) and refuses any other key rather than drop it.
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None


class CompletionBody(_Sampling):
    # One prompt or several (one choice each, --max-prompts-per-request): text, or token ids taken as given.
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[_TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[_TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=_UINT31)] | None = None  # alternatives per token (the sampled one too)
    echo: bool = False  # the prompt's text before the generated text (not with logprobs)
    suffix: str | None = None


# --- /v1/responses (openai_responses.py) ---------------------------------------------------------------------


class InputText(_Body):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back in an assistant turn
    text: str


class InputImage(_Body):
    type: Literal["input_image"]
    image_url: str | None = None  # a data: URL (remote URLs where the operator allowed them)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor decides the resolution


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Annotated[InputText | InputImage, Field(discriminator="type")]]


class ResponsesBody(_Body):
    model: str
    input: str | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: str | None = None  # a system turn before the conversation, for this response only
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None  # None: what the context leaves
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=-_INT64, lt=2**64)] | None = None  # as in chat
    stream: bool = False
    previous_response_id: str | None = None  # continue that response's conversation (this tenant's)
    store: bool = True  # keep this response for a later previous_response_id
    metadata: dict[str, str] | None = None  # returned as given
    user: str | None = None  # accepted, not used
    tools: list[Any] | None = None  # refused unless empty
    tool_choice: Any = None  # refused unless "none"/"auto" without tools
    reasoning: dict[str, Any] | None = None  # refused: no reasoning models here
    text: dict[str, Any] | None = None  # {"format": {"type": "text"}} only
