"""Tokenisation at the edge: the byte tokenizer, and a real Hugging Face tokenizer.json with the
model's chat template from tokenizer_config.json (built here with the tokenizers package)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kvcompassd.tokenizer import ByteTokenizer, HuggingFaceTokenizer, TokenizerError, load_tokenizer


@pytest.fixture
def hf_dir(tmp_path):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cache holds the prefix", "<s> </s> user assistant :"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant :"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return tmp_path


def test_byte_tokenizer_round_trips_and_renders_chats():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert tok.decode(ids) == "<|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(TokenizerError):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(TokenizerError):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_hugging_face_tokenizer_and_chat_template(hf_dir):
    tok = load_tokenizer(str(hf_dir / "tokenizer.json"))
    assert isinstance(tok, HuggingFaceTokenizer)
    ids = tok.encode("the cache holds the prefix")
    assert len(ids) == 5 and ids[0] == ids[3]  # "the" twice, one id
    assert tok.decode(ids) == "the cache holds the prefix"
    chat = tok.apply_chat_template([{"role": "user", "content": "the prefix"}])
    vocab = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).get_vocab()
    # The template wrote the BOS token itself; the words are the vocabulary's ids.
    assert chat[0] == vocab["<s>"] and chat[1:4] == [vocab["user"], vocab[":"], vocab["the"]]
    # The same messages always give the same ids: the edge's keys match the engine's cache.
    assert chat == tok.apply_chat_template([{"role": "user", "content": "the prefix"}])
