"""The base model's tokenizer at the door: chat templates and the text of single tokens.

The replicas tokenize text prompts themselves (the gRPC path's tokens are the truth); the
door needs a tokenizer only to render a chat into token ids, the way Hugging Face's
`apply_chat_template` does (the same sandboxed Jinja environment, the same variables, no
special tokens added on top of what the template writes), and to name each sampled token
in `logprobs`. It reads `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`
from a local folder with the `tokenizers` library alone: the proxy imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from rollwire.common.errors import FailedPrecondition, InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.proxy.http.dialect.messages import conversation
from rollwire.proxy.http.dialect.openai import template_takes_parts


class ChatTokenizer:
    """A local folder's tokenizer and chat template."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        root = Path(folder)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{root} has no tokenizer.json (http.model_path must be a local model folder)")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        jinja = root / "chat_template.jinja"
        template = jinja.read_text() if jinja.is_file() else config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.special = {k: _content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def encode(self, text: str, max_tokens: int = 0, *, special: bool = False) -> list[int]:
        """Token ids of `text`, adding the tokenizer's special tokens (BOS...) only when `special`
        (a rendered template holds its own).

        The batch call encodes with the GIL released (`encode` holds it for the whole text, which
        stalls every other thread of the proxy: audit A2; measured here, 0.5 s for 128 KiB); the
        ids, built holding it, are built only when there are at most `max_tokens` of them (0: no
        limit), else PROMPT_TOO_LONG. Every tokenization at the door goes through here."""
        encoding = self.tokenizer.encode_batch([text], add_special_tokens=special)[0]
        if max_tokens and len(encoding) > max_tokens:
            raise InvalidArgument(
                f"the chat's prompt is {len(encoding)} tokens; a prompt may have at most {max_tokens} here",
                reason=Reason.PROMPT_TOO_LONG,
            )
        return encoding.ids

    def vocabulary(self) -> tuple[set[str], set[str]]:
        """Every token's text, and those of the special tokens (which the replicas' text leaves out)."""
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        return set(self.tokenizer.get_vocab(with_added_tokens=True)), special

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (what vLLM names in `logprobs`)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: Mapping[str, Any],
    ) -> str:
        """The chat as the template writes it, given the messages as vLLM hands them to it
        (dialect/messages.py); FAILED_PRECONDITION without a template and INVALID_ARGUMENT when
        the template refuses the messages (its `raise_exception`)."""
        if self.chat_template is None:
            raise FailedPrecondition(
                "this model's tokenizer has no chat template; send the prompt to /v1/completions instead",
                reason=Reason.NO_CHAT_TEMPLATE,
            )
        from jinja2 import TemplateError

        variables = {**self.special, **kwargs}
        turns = conversation([dict(m) for m in messages], template_takes_parts(self.chat_template))
        try:
            text = _compiled(self.chat_template).render(
                messages=turns,
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateError as exc:
            raise InvalidArgument(
                f"the model's chat template refused these messages: {exc}", reason=Reason.BAD_REQUEST_BODY
            ) from None
        if continue_final_message:
            last = messages[-1].get("content") if messages else None
            if isinstance(last, str) and last.strip() and last.strip() in text:
                text = text[: text.rindex(last.strip()) + len(last.strip())]
        return text


def _content(token: object) -> str:
    if isinstance(token, Mapping):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""


@lru_cache(maxsize=4)
def _compiled(template: str):
    """The template in the environment transformers renders chat templates in: sandboxed,
    trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, and
    `tojson` that keeps non-ASCII characters."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
