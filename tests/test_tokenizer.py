"""Tokenisation at the edge: the byte tokenizer, a real Hugging Face tokenizer directory, and the
chat template rendered as Hugging Face renders it.

The references are Hugging Face's own results: tests/data/tokenizer-bpe/reference.json was
written once by tools/make_tokenizer_fixture.py with `transformers` installed in a throwaway venv
(kvcompassd does not depend on it); it names the transformers version.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvcompassd.core.config import ConfigError, TokenizerConfig, WorkerConfig, load_config
from kvcompassd.tokenizer import (
    BYTE,
    ByteTokenizer,
    HuggingFaceTokenizer,
    TokenizerError,
    byte_tokenizer_refusal,
    load_tokenizer,
)

DATA = Path(__file__).parent / "data" / "tokenizer-bpe"
REFERENCE = json.loads((DATA / "reference.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def bpe() -> HuggingFaceTokenizer:
    return load_tokenizer(str(DATA))


@pytest.fixture(scope="module")
def bpe_alt() -> HuggingFaceTokenizer:
    return load_tokenizer(str(DATA), str(DATA / "alt_chat_template.jinja"))


@given(st.text(max_size=300))
def test_byte_tokenizer_array_holds_the_ids_of_encode(text):
    tok = ByteTokenizer()
    ids = tok.encode_array(text)
    assert ids.dtype == np.uint32 and ids.flags.c_contiguous
    assert ids.tolist() == tok.encode(text)


def test_byte_tokenizer_round_trips_and_renders_llama3_chats():
    tok = ByteTokenizer()
    assert tok.name == BYTE
    assert tok.decode(tok.encode("héllo")) == "héllo"
    ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert tok.decode(ids) == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "a b"}])
    with pytest.raises(TokenizerError):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(TokenizerError):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_encodings_match_hugging_face(bpe):
    assert REFERENCE["encode"], "reference.json holds no encodings"
    for case in REFERENCE["encode"]:
        assert bpe.encode(case["text"]) == case["ids"], case["text"]
        assert bpe.decode(case["ids"]) == case["text"].replace("<|eot_id|>", "")  # special tokens skipped


def test_chat_templates_render_as_hugging_face_apply_chat_template(bpe, bpe_alt):
    """Texts and ids, with and without add_generation_prompt, with the config's template (trim
    and lstrip blocks, namespace, {% generation %}, bos_token) and a replacement one (tojson,
    loop controls, eos_token)."""
    assert len(REFERENCE["chats"]) == 12
    for case in REFERENCE["chats"]:
        tok = bpe_alt if case["alt_template"] else bpe
        text = tok.render_chat(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert text == case["text"]
        if case["add_generation_prompt"] and case["messages"][-1]["role"] != "assistant":
            # what a chat completion (and SGLang's /v1/tokenize) runs, on a chat ending on a user turn
            assert tok.apply_chat_template(case["messages"]) == case["ids"]


def test_a_chat_ending_with_an_assistant_message_is_rendered_as_sglang_does(bpe, bpe_alt):
    """SGLang turns a final assistant message into a user one before rendering a chat completion
    or /v1/tokenize's messages (serving_chat._handle_last_assistant_message): the edge's ids must
    be the ones the engine would compute for the same chat."""
    ending = [c for c in REFERENCE["chats"] if c["messages"][-1]["role"] == "assistant"]
    assert ending
    for case in ending:
        tok = bpe_alt if case["alt_template"] else bpe
        as_user = [*case["messages"][:-1], {"role": "user", "content": case["messages"][-1]["content"]}]
        try:
            expected = tok.encode(tok.render_chat(as_user), add_special_tokens=False)
        except TokenizerError as exc:  # the config's template refuses two user turns in a row
            with pytest.raises(TokenizerError, match=str(exc)[-40:]):
                tok.apply_chat_template(case["messages"])
            continue
        assert tok.apply_chat_template(case["messages"]) == expected
        assert tok.apply_chat_template(case["messages"]) != case["ids"]  # not Hugging Face's own
    # a lone assistant message: Hugging Face's rendering refuses it (the reference), SGLang's passes
    lone = [{"role": "assistant", "content": "first"}]
    assert bpe.apply_chat_template(lone) == bpe.apply_chat_template([{"role": "user", "content": "first"}])
    byte = ByteTokenizer()
    assert byte.decode(byte.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])) \
        .endswith("user<|end_header_id|>\n\na<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_null_content_and_input_text_parts_are_rendered_as_sglang_does():
    """An assistant turn with only tool calls has content null (SGLang renders ""); the Responses
    API's "input_text" parts are text parts to SGLang."""
    tok = ByteTokenizer()
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}, {"role": "user", "content": "r"}]
    empty = [chat[0], {"role": "assistant", "content": ""}, chat[2]]
    assert tok.apply_chat_template(chat) == tok.apply_chat_template(empty)
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "a b"}])


def test_raise_exception_in_a_template_is_a_request_error(bpe):
    assert REFERENCE["failing_chats"]
    for case in REFERENCE["failing_chats"]:
        with pytest.raises(TokenizerError) as err:
            bpe.render_chat(case["messages"])  # Hugging Face's rendering, as the reference ran it
        assert case["error"] in str(err.value)
        if case["messages"][-1]["role"] != "assistant":  # SGLang would render that one as a user turn
            with pytest.raises(TokenizerError, match=case["error"][:30]):
                bpe.apply_chat_template(case["messages"])


def test_templates_run_sandboxed(tmp_path):
    shutil.copy(DATA / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    tok = load_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="chat template failed"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}{{ ns }}")
    with pytest.raises(TokenizerError, match="underscore"):
        load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sources_and_bad_directories(tmp_path):
    shutil.copy(DATA / "tokenizer.json", tmp_path / "tokenizer.json")
    messages = [{"role": "user", "content": "hi"}]
    # No template anywhere: chats are refused rather than rendered in an invented layout.
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(str(tmp_path)).apply_chat_template(messages)
    # Hugging Face's list of named templates: the "default" one.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|eot_id|>"}, "chat_template": [
            {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "D:{{ eos_token }}"}]}))
    assert load_tokenizer(str(tmp_path)).render_chat(messages) == "D:<|eot_id|>"
    # chat_template.jinja beside it wins over the config's; the tokenizer.json path works too.
    (tmp_path / "chat_template.jinja").write_text("J:{{ messages[0]['content'] }}")
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).render_chat(messages) == "J:hi"
    for bad, why in (("[1]", "not a JSON object"), ("{bad", "is not JSON")):
        (tmp_path / "tokenizer_config.json").write_text(bad)
        with pytest.raises(TokenizerError, match=why):
            load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="fixed chat template"):
        load_tokenizer(BYTE, str(tmp_path / "chat_template.jinja"))


def test_the_fixture_is_a_real_bpe():
    vocab = Tokenizer.from_file(str(DATA / "tokenizer.json")).get_vocab()
    assert len(vocab) == 1000 and vocab["<|begin_of_text|>"] == 0


def _worker(wid: str, emulated: bool) -> WorkerConfig:
    return WorkerConfig(wid, "us", 0.1, 1.0, 1000, 0, emulated=emulated)


def test_byte_tokenizer_is_refused_in_front_of_real_engines(bpe):
    workers = [_worker("us-0", True), _worker("us-1", False)]
    reason = byte_tokenizer_refusal(ByteTokenizer(), workers)
    assert reason is not None and "us-1" in reason and "us-0" not in reason and "[tokenizer] path" in reason
    assert byte_tokenizer_refusal(ByteTokenizer(), workers[:1]) is None
    assert byte_tokenizer_refusal(bpe, workers) is None


def test_tokenizer_config_section(tmp_path):
    base = Path(__file__).resolve().parent.parent / "config" / "production-3region.toml"
    text = base.read_text()
    (tmp_path / "model").mkdir()
    assert load_config(base).tokenizer == TokenizerConfig("/opt/models/Llama-3.1-8B-Instruct")
    text = text.replace('path = "/opt/models/Llama-3.1-8B-Instruct"', 'path = "model"\nchat_template = "/abs/t.jinja"')
    (tmp_path / "cluster.toml").write_text(text)
    cfg = load_config(tmp_path / "cluster.toml")
    # Relative to the config file, not to wherever the daemon was started.
    assert cfg.tokenizer == TokenizerConfig(str(tmp_path / "model"), "/abs/t.jinja")
    # No path: the byte tokenizer.
    (tmp_path / "byte.toml").write_text(text.replace('path = "model"\nchat_template = "/abs/t.jinja"', ""))
    assert load_config(tmp_path / "byte.toml").tokenizer == TokenizerConfig()
    with pytest.raises(ConfigError, match="chat_template"):
        TokenizerConfig(chat_template="t.jinja")
    with pytest.raises(ConfigError, match="emulated"):
        WorkerConfig("w", "us", 0.1, 1.0, 1000, 0, emulated="yes")
    (tmp_path / "bad.toml").write_text(text.replace('path = "model"', 'vocab = "x"'))
    with pytest.raises(ConfigError, match=r"\[tokenizer\].*vocab"):
        load_config(tmp_path / "bad.toml")
