"""Tokenisation at the edge: the token ids the edge hashes are the ids the engine runs.

``ByteTokenizer`` (one token per UTF-8 byte) is what the demo, the tests and the emulated
worker use; ``HuggingFaceTokenizer`` loads a model's ``tokenizer.json`` (the ``tokenizers``
package) and renders chat messages with the model's Jinja chat template, so a deployment in
front of real SGLang workers keys the same tokens the engines cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, Sequence

import jinja2.sandbox

# A plain template for models without one (and the byte tokenizer): role tags and turns.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TokenizerError(ValueError):
    """The request's text or messages cannot be tokenised."""


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]: ...


def _message_text(messages: Sequence[dict]) -> list[dict]:
    """Validate OpenAI chat messages; flatten list-of-parts content into text."""
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TokenizerError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content", "")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise TokenizerError(f"messages[{i}].content: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise TokenizerError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


class _Templated:
    def __init__(self, template: str | None):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template or DEFAULT_CHAT_TEMPLATE)

    def render_chat(self, messages: Sequence[dict], **extra) -> str:
        try:
            return self._template.render(messages=_message_text(messages), add_generation_prompt=True, **extra)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc


class ByteTokenizer(_Templated):
    """Token id = byte value of the UTF-8 text (vocabulary of 256)."""

    name = "byte"

    def __init__(self, chat_template: str | None = None):
        super().__init__(chat_template)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        return self.encode(self.render_chat(messages))


class HuggingFaceTokenizer(_Templated):
    """A model's ``tokenizer.json``; the chat template comes from ``tokenizer_config.json``
    beside it unless given."""

    def __init__(self, path: str | Path, chat_template: str | None = None):
        from tokenizers import Tokenizer as HfTokenizer

        path = Path(path)
        self._tok = HfTokenizer.from_file(str(path))
        self.name = str(path)
        self._bos = self._eos = ""
        config = path.with_name("tokenizer_config.json")
        if config.is_file():
            data = json.loads(config.read_text())
            chat_template = chat_template or data.get("chat_template")
            self._bos = _token_text(data.get("bos_token"))
            self._eos = _token_text(data.get("eos_token"))
        super().__init__(chat_template)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        text = self.render_chat(messages, bos_token=self._bos, eos_token=self._eos)
        # The template already wrote the special tokens it wants.
        return self._tok.encode(text, add_special_tokens=False).ids


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""


def load_tokenizer(path: str | None, chat_template_path: str | None = None) -> Tokenizer:
    template = Path(chat_template_path).read_text() if chat_template_path else None
    if not path or path == "byte":
        return ByteTokenizer(template)
    return HuggingFaceTokenizer(path, template)
