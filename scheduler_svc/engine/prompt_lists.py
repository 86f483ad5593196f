"""The prompts of one ``/v1/completions`` request: a string, a list of strings, a token-id array or a list of them.

OpenAI's legacy completions API (and vLLM's) take all four shapes. Each prompt becomes one request of its own on the
shared path; their choices come back in one answer, indexed as OpenAI indexes them (``prompt_index * n +
sample_index``), with the usage summed. The number of prompts is bounded (``--max-prompts-per-request``) before any
of them is tokenized. A token-id prompt is taken as given, checked against the vocabulary and the media placeholders
(a placeholder without its image would leave the ranks without the features its positions need).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.errors import InvalidArgument
from scheduler_svc.core import admission
from scheduler_svc.engine.frontend import ProcessedPrompt

Prompt = str | tuple[int, ...]  # a text prompt, tokenized by the server, or the token ids of one


def prompt_list(prompt, limit: int) -> list[Prompt]:
    """The request's prompts in order; ``InvalidArgument`` naming ``prompt`` when there are more than ``limit``."""
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [tuple(prompt)]  # one token array
    else:
        prompts = [p if isinstance(p, str) else tuple(p) for p in prompt]
    if len(prompts) > limit:
        raise InvalidArgument(
            f"prompt lists {len(prompts)} prompts; the limit is {limit} (--max-prompts-per-request); split the request",
            field="prompt",
        )
    return prompts


def choice_index(prompt_index: int, sample_index: int, n: int) -> int:
    """OpenAI's index of the ``sample_index``-th of ``n`` choices of the ``prompt_index``-th prompt."""
    return prompt_index * n + sample_index


def prompt_field(prompt_index: int, count: int) -> str:
    """The body's path of one prompt: ``prompt`` alone, ``prompt[i]`` in a list of several."""
    return "prompt" if count == 1 else f"prompt[{prompt_index}]"


def placeholder_ids(frontend) -> tuple[int, ...]:
    """The media placeholder token ids of the served model."""
    return tuple(t for t in (frontend.image_token_id, frontend.video_token_id) if t is not None)


def check_token_ids(ids: Sequence[int], field: str, vocab_size: int, placeholders: Sequence[int]) -> None:
    """Refuses an empty array, an id outside the vocabulary and a media placeholder id, naming the position."""
    if not ids:
        raise InvalidArgument(f"{field} is an empty token array", field=field)
    for j, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(
                f"{field}[{j}]={t} is outside the vocabulary [0, {vocab_size})", field=f"{field}[{j}]"
            )
        if t in placeholders:
            raise InvalidArgument(
                f"{field}[{j}]={t} is a media placeholder token; send images to the chat completions API as "
                "image_url parts",
                field=f"{field}[{j}]",
            )


def process_token_ids(frontend, ids: Sequence[int], *, reserve_tokens: int, context: int) -> ProcessedPrompt:
    """A token-id prompt as the frontend's ``process_text`` returns a text one, not re-tokenized; the door checked
    its ids (``check_token_ids``, naming the prompt's place in the list)."""
    admission.check_prompt_fits(("prompt", admission.GENERATE_FIELD), len(ids), reserve_tokens, context)
    return ProcessedPrompt(list(ids), [], 0, [], 0)
