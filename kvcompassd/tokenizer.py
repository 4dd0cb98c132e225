"""Tokenisation at the edge: the token ids the edge hashes are the ids the engine runs.

``HuggingFaceTokenizer`` loads the served model's tokenizer directory (``tokenizer.json`` with
the ``tokenizers`` package; ``tokenizer_config.json`` for the chat template and the special
tokens) and renders chats exactly as Hugging Face's ``apply_chat_template`` does, which is what
SGLang runs: the same sandboxed Jinja environment (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, ``tojson``, ``raise_exception``, ``strftime_now``, ``namespace``), the special
tokens as template variables, ``add_generation_prompt``, then the text encoded without adding
special tokens (the template wrote them). ``ByteTokenizer`` (one token per UTF-8 byte) is what
the demo and the emulated worker use by default; an edge may only run it in front of emulated
workers (:func:`byte_tokenizer_refusal`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import numpy as np

BYTE = "byte"
# The byte tokenizer's chat layout: Llama 3's, spelled out as text (one token per byte).
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
BYTE_BOS = "<|begin_of_text|>"
# Largest tokenizer_config.json / chat template read (real ones are tens of KiB).
MAX_CONFIG_BYTES = 4 << 20
# tokenizer_config.json keys whose values the template sees as variables (as Hugging Face's
# special_tokens_map), strings or AddedToken objects ({"content": ...}).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """The request's text or messages cannot be tokenised."""


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]: ...


def _message_text(messages: Sequence[dict]) -> list[dict]:
    """Validate OpenAI chat messages; flatten list-of-parts content into text joined by spaces,
    as SGLang does for templates that read ``content`` as a string
    (``jinja_template_utils.process_content_for_template_format``, "string" format)."""
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TokenizerError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if content is None:  # an assistant turn with tool calls only: SGLang renders ""
            content = ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("text", "input_text") or not isinstance(part.get("text"), str):
                    raise TokenizerError(f"messages[{i}].content: only text parts are supported")
                parts.append(part["text"])
            content = " ".join(parts)
        if not isinstance(content, str):
            raise TokenizerError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


# ---------------------------------------------------------------- Hugging Face's template environment


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: Hugging Face marks assistant spans with it;
    rendering only emits the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; Hugging Face's does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` in templates, without attribute access to the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (no CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def compile_chat_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc


class _Templated:
    def __init__(self, template: str | None, special_tokens: dict[str, Any]):
        self._template = compile_chat_template(template) if template else None
        self.special_tokens = special_tokens

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    chat_completion: bool = False) -> str:
        """The prompt text Hugging Face's ``apply_chat_template(..., tokenize=False)`` gives.

        ``chat_completion``: the messages as SGLang renders a chat completion (and
        ``/v1/tokenize`` with ``messages``): a final assistant message becomes a user message, so
        the generation prompt always follows a user turn
        (``serving_chat._handle_last_assistant_message``, ``continue_final_message`` false)."""
        if self._template is None:
            raise TokenizerError("the model's tokenizer has no chat template")
        texts = _message_text(messages)
        if chat_completion and texts[-1]["role"] == "assistant":
            texts[-1] = {"role": "user", "content": texts[-1]["content"]}
        try:
            return self._template.render(messages=texts, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc


class ByteTokenizer(_Templated):
    """Token id = byte value of the UTF-8 text (vocabulary of 256)."""

    name = BYTE

    def __init__(self):
        super().__init__(BYTE_CHAT_TEMPLATE, {"bos_token": BYTE_BOS})

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as a uint32 array, made from the UTF-8 bytes in one numpy call (the
        front door's form: a list of thousands of ints copied into an array cost more than all
        the rest of its parsing)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        return self.encode(self.render_chat(messages, chat_completion=True))


def _read_text(path: Path, what: str) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise TokenizerError(f"{what} {path} is {size} bytes (at most {MAX_CONFIG_BYTES})")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read {what} {path}: {exc}") from exc


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _config_template(data: dict) -> str | None:
    """``chat_template``: a string, or Hugging Face's list of named templates (the "default" one)."""
    template = data.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class HuggingFaceTokenizer(_Templated):
    """A model's tokenizer directory (or its ``tokenizer.json``, with the config beside it).

    The chat template is, first found: ``chat_template`` given here, ``chat_template.jinja`` in
    the directory (newer Hugging Face repositories), ``tokenizer_config.json``'s.
    """

    def __init__(self, path: str | Path, chat_template: str | None = None):
        from tokenizers import Tokenizer as HfTokenizer

        path = Path(path)
        directory, file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
        try:
            self._tok = HfTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises plain Exception on a bad file
            raise TokenizerError(f"cannot load {file}: {exc}") from exc
        self.name = str(directory)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        data: dict = {}
        config = directory / "tokenizer_config.json"
        if config.is_file():
            try:
                data = json.loads(_read_text(config, "tokenizer config"))
            except ValueError as exc:
                raise TokenizerError(f"{config} is not JSON: {exc}") from exc
            if not isinstance(data, dict):
                raise TokenizerError(f"{config} is not a JSON object")
        jinja_file = directory / "chat_template.jinja"
        if chat_template is None and jinja_file.is_file():
            chat_template = _read_text(jinja_file, "chat template")
        special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(data.get(k))) is not None}
        extra = [t for t in map(_token_text, data.get("additional_special_tokens") or ()) if t is not None]
        if extra:
            special["additional_special_tokens"] = extra
        super().__init__(chat_template or _config_template(data), special)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        # The template already wrote the special tokens it wants.
        return self._tok.encode(self.render_chat(messages, chat_completion=True), add_special_tokens=False).ids


def load_tokenizer(path: str | None, chat_template_path: str | None = None) -> Tokenizer:
    """``None``/``"byte"``: the byte tokenizer; else a Hugging Face tokenizer directory."""
    if not path or path == BYTE:
        if chat_template_path:
            raise TokenizerError("the byte tokenizer has a fixed chat template")
        return ByteTokenizer()
    template = _read_text(Path(chat_template_path), "chat template") if chat_template_path else None
    return HuggingFaceTokenizer(path, template)


def byte_tokenizer_refusal(tokenizer: Tokenizer, workers: Sequence[Any]) -> str | None:
    """Why an edge must not start with this tokenizer, or None. Byte ids are only what an
    emulated worker runs: in front of SGLang they would be wrong prompts and unmatched keys."""
    if tokenizer.name != BYTE:
        return None
    real = [w.id for w in workers if not getattr(w, "emulated", False)]
    if not real:
        return None
    shown = ", ".join(real[:5]) + (f" and {len(real) - 5} more" if len(real) > 5 else "")
    return (f"the byte tokenizer only fits emulated workers, and {shown} "
            f"{'is' if len(real) == 1 else 'are'} not marked `emulated = true`: "
            "set [tokenizer] path to the served model's tokenizer directory")
