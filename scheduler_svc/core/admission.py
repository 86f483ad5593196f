"""Admission: the context limit, checked at every stage by one check with one message.

A request's prompt and the tokens it asks to generate must fit the context (``config.context_length``: the
``--max-model-len`` flag, else the model's ``max_position_embeddings``, narrowed by the group at connect). Every cost
a request can cause is bounded before it is paid (docs/SECURITY.md section 5), so the limit is checked at each stage
as soon as that stage knows a lower bound of the prompt — the checks stay where they are in time, only their rule and
message live here. ``CONTEXT_CHECKS`` lists the stages in the order a request meets them:

1. ``check_image_fits`` — one image, from its header: no request could hold it (an upload too);
2. ``check_images_fit`` — a request's images so far with the tokens to generate, before any image is decoded;
3. ``check_prompt_fits`` — the tokenized prompt with the tokens to generate (frontend.py);
4. ``check_request_fits`` — the prompt with the request's final ``max_tokens``, before it is queued (completion.py);
5. ``check_core_fits`` then ``check_max_tokens_fits`` — the core's own guards (scheduler.py, request.py): the core
   is usable without the service.

Each raises ``InvalidArgument`` (gRPC INVALID_ARGUMENT, HTTP 400) whose ``field`` names the field(s) at fault and
whose message has one shape, ``context_message``::

    <fields>: <P> prompt tokens (<detail>) + <G> to generate (sampling.max_tokens=<G>) = <P+G> tokens, over the
    context of <C> tokens (--max-model-len / the model's max_position_embeddings); send <a shorter prompt> or set
    sampling.max_tokens to at most <C-P>
"""

from __future__ import annotations

from collections.abc import Iterable

from common.errors import InvalidArgument

__all__ = [
    "CONTEXT_CHECKS",
    "CONTEXT_FLAG",
    "GENERATE_FIELD",
    "check_context",
    "check_core_fits",
    "check_image_fits",
    "check_images_fit",
    "check_max_tokens_fits",
    "check_prompt_fits",
    "check_request_fits",
    "context_message",
]

GENERATE_FIELD = "sampling.max_tokens"  # the OpenAI door renames it (max_tokens / max_completion_tokens)
CONTEXT_FLAG = "--max-model-len / the model's max_position_embeddings"


def _fields(fields: str | Iterable[str]) -> tuple[str, ...]:
    return (fields,) if isinstance(fields, str) else tuple(fields)


def context_message(
    fields: str | Iterable[str],
    prompt_tokens: int,
    generate: int,
    context: int,
    *,
    at_least: bool = False,
    detail: str = "",
    shorten: str = "a shorter prompt",
) -> str:
    """The context limit's one message: the field(s), the prompt's tokens (``at_least``: a lower bound, the prompt
    not yet tokenized), the tokens to generate, their sum, the limit and its flag, and what to change."""
    fields = _fields(fields)
    named = GENERATE_FIELD in fields  # the client chose how many to generate: say so, and how many would fit
    prompt = f"{'at least ' if at_least else ''}{prompt_tokens} prompt tokens" + (f" ({detail})" if detail else "")
    generated = f"{generate} to generate" + (f" ({GENERATE_FIELD}={generate})" if named else " (at least one)")
    change = f"send {shorten}"
    if named and context - prompt_tokens >= 1:
        change += f" or set {GENERATE_FIELD} to at most {context - prompt_tokens}"
    return (
        f"{' and '.join(fields)}: {prompt} + {generated} = {prompt_tokens + generate} tokens, over the context of "
        f"{context} tokens ({CONTEXT_FLAG}); {change}"
    )


def check_context(fields: str | Iterable[str], prompt_tokens: int, generate: int, context: int, **how) -> None:
    """The one check: refuses when the prompt and the tokens to generate exceed the context (0: unknown)."""
    if context and prompt_tokens + generate > context:
        fields = _fields(fields)
        raise InvalidArgument(
            context_message(fields, prompt_tokens, generate, context, **how),
            field=fields[0] if len(fields) == 1 else fields,
        )


def check_image_fits(field: str, width: int, height: int, tokens: int, context: int) -> None:
    """One image's placeholders, from its header, with at least one token to generate."""
    detail = f"the {width}x{height} image"
    check_context(field, tokens, 1, context, detail=detail, shorten="a smaller image")


def check_images_fit(images: Iterable[tuple[str, str, int]], generate: int, context: int) -> None:
    """``images``: (field, description, placeholder tokens) in prompt order. The prompt holds at least every image's
    placeholders: refuses at the first image whose running total, with the tokens to generate, is over."""
    total = 0
    for field, what, tokens in images:
        total += tokens
        detail = f"{what} takes {tokens}" + (f", the images up to it {total}" if total > tokens else "")
        how = {"at_least": True, "detail": detail, "shorten": "smaller or fewer images"}
        check_context((field, GENERATE_FIELD), total, generate, context, **how)


def check_prompt_fits(fields: str | Iterable[str], prompt_tokens: int, generate: int, context: int) -> None:
    """The tokenized prompt with the tokens to generate (at least one)."""
    check_context(fields, prompt_tokens, max(1, generate), context)


def check_request_fits(prompt_field: str, prompt_tokens: int, max_tokens: int, context: int) -> None:
    """The processed prompt with the request's final ``max_tokens``, before it is queued."""
    check_context((prompt_field, GENERATE_FIELD), prompt_tokens, max_tokens, context)


def check_core_fits(prompt_tokens: int, context: int) -> None:
    """The core's own guard (scheduler.py): the prompt leaves room for at least one generated token."""
    check_context("messages", prompt_tokens, 1, context)


def check_max_tokens_fits(prompt_tokens: int, max_tokens: int, context: int) -> None:
    """The core's ``validate_sampling`` (request.py), after ``max_tokens``' own bounds: the prompt and ``max_tokens``."""
    check_context(GENERATE_FIELD, prompt_tokens, max_tokens, context)


# The stages in the order a request meets them (docs/ARCHITECTURE.md §2.1).
CONTEXT_CHECKS = (
    check_image_fits,
    check_images_fit,
    check_prompt_fits,
    check_request_fits,
    check_core_fits,
    check_max_tokens_fits,
)
