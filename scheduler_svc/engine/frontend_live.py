"""A live session's turn in the frontend (frontend.py; the sessions themselves: core/live_sessions.py): its new
messages' tokens as the chat template renders them after an earlier assistant turn."""

from __future__ import annotations

from common.errors import FailedPrecondition, InvalidArgument
from common.mrope import mrope_positions


class LiveTurns:
    """The live-session part of ``Frontend`` (mixed into it)."""

    def process_live(self, turns, *, first: bool, tenant: str = "", reserve_tokens: int = 1, context=None):
        """A live session's turn (``scheduler_svc/core/live_sessions.py``): its new messages' tokens as the chat template
        renders them after an earlier assistant turn, with the template's prefix (its default system prompt, or the
        turn's own system message) ahead of them on the ``first`` turn. Returns ``(ProcessedPrompt, turn_start,
        extent, close_ids)``: where the messages begin, their position span under the model's rule (the next token
        after them sits at ``extent``), and the template's end of an assistant turn."""
        context = self.max_model_len if context is None else context
        for i, turn in enumerate(turns):
            if turn.role != "user" and not (first and i == 0 and turn.role == "system"):
                raise InvalidArgument(
                    f"messages[{i}].role={turn.role!r}: a live session's turn sends only user messages (the first "
                    "turn may start with a system message); the server holds the answers",
                    field=f"messages[{i}].role",
                )
        messages, images = self._collect(turns)
        media = self._media(images, tenant, context, reserve_tokens)
        prefix_text, turn_text, close_text = self._live_texts(messages, first)
        tokenizer = self._thread_tokenizer()
        prefix_ids = tokenizer(prefix_text)["input_ids"] if prefix_text else []
        processed = self._prompt(prefix_ids + tokenizer(turn_text)["input_ids"], media, context)
        self._count("prompts_tokenized", 1)
        if self.uses_mrope:
            _, delta = mrope_positions(processed.token_ids, processed.mm_features, **self._rope_kwargs)
            extent = delta + len(processed.token_ids)
        else:
            extent = len(processed.token_ids)
        return processed, len(prefix_ids), extent, tokenizer(close_text)["input_ids"]

    def _live_texts(self, messages: list[dict], first: bool) -> tuple[str, str, str]:
        """(prefix, the messages, the end of an assistant turn) as the chat template renders them: the messages
        are what rendering them after a user and an assistant turn adds, the end is what follows an assistant
        message's text. Refuses a template that does not render a conversation as the concatenation of its turns."""
        render = self.processor.apply_chat_template
        user = {"role": "user", "content": [{"type": "text", "text": "\x01"}]}
        answer = {"role": "assistant", "content": [{"type": "text", "text": "\x02"}]}
        before = render([user, answer], tokenize=False)
        users = [m for m in messages if m["role"] == "user"]
        after = render([user, answer, *users], tokenize=False, add_generation_prompt=True)
        end = before.rfind("\x02")
        if not after.startswith(before) or end < 0:
            raise FailedPrecondition(
                "this model's chat template does not render turns one after another; live sessions need one",
                field="live",
            )
        turn_text, close_text = after[len(before) :], before[end + 1 :]
        prefix_text = ""
        if first:
            whole = render(messages, tokenize=False, add_generation_prompt=True)
            if not whole.endswith(turn_text):
                raise FailedPrecondition(
                    "this model's chat template renders a first turn differently from a later one; live sessions "
                    "need it to render turns one after another",
                    field="live",
                )
            prefix_text = whole[: len(whole) - len(turn_text)]
        return prefix_text, turn_text, close_text
