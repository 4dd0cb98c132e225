"""Build tests/data/tokenizer-bpe/: a small byte-level BPE (the ``tokenizers`` library, trained on
this repository's README) with a Llama-3-style chat template, and, when ``transformers`` is
importable, reference.json: what Hugging Face's own ``AutoTokenizer`` gives for the cases the
tests check (kvcompassd does not depend on transformers; run this once in a throwaway venv:
``python -m venv /tmp/tf && /tmp/tf/bin/pip install transformers jinja2 &&
/tmp/tf/bin/python tools/make_tokenizer_fixture.py``; ``--train`` retrains the BPE too).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "tokenizer-bpe"
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CHAT_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- if ns.system %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + ns.system + '<|eot_id|>' }}
{%- endif %}
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles are supported after the system message') }}
    {% endif %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{ message['content'] | trim }}{% endgeneration %}
    {%- else %}
        {{- message['content'] | trim }}
    {%- endif %}
    {{- '<|eot_id|>' }}
{% endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Another model's layout: the same vocabulary, a different chat (tojson, loop controls).
ALT_TEMPLATE = """{% for message in messages %}
{% if message['role'] == 'system' %}{% continue %}{% endif %}
{{ message['role'] | upper }}: {{ message['content'] | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""

CASES = {
    "texts": ["Hello, world!", "KV-cache probe: Größe, naïve café, 東京 and 🙂",
              "  leading spaces\tand tabs\n\nnew lines  ", "<|eot_id|> is special", ""],
    "chats": [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What is 12 × 7?"},
         {"role": "assistant", "content": "84"}, {"role": "user", "content": "And 日本語?"}],
        [{"role": "user", "content": "say \"quoted\" <b>html</b> & más"}, {"role": "assistant", "content": " ok "}],
    ],
    "failing_chats": [[{"role": "assistant", "content": "first"}], [{"role": "tool", "content": "x"}]],
}


def train() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[0]} $A", pair=f"{SPECIALS[0]} $A $B",
                                                       special_tokens=[(SPECIALS[0], bos)])
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"), pretty=False)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[4],
              "model_max_length": 8192, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (OUT / "alt_chat_template.jinja").write_text(ALT_TEMPLATE)


def reference() -> None:
    import jinja2
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(OUT))
    alt = (OUT / "alt_chat_template.jinja").read_text()
    out = {"transformers": transformers.__version__, "encode": [], "chats": [], "failing_chats": []}
    for text in CASES["texts"]:
        out["encode"].append({"text": text, "ids": tok.encode(text)})
    for messages in CASES["chats"]:
        for template in (None, alt):
            for gen in (True, False):
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                               chat_template=template)
                ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen,
                                              chat_template=template, return_dict=False)
                out["chats"].append({"messages": messages, "alt_template": template is not None,
                                     "add_generation_prompt": gen, "text": text, "ids": list(ids)})
    for messages in CASES["failing_chats"]:
        try:
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as exc:  # from raise_exception
            out["failing_chats"].append({"messages": messages, "error": str(exc)})
    lines = [f'"transformers": {json.dumps(out.pop("transformers"))}']
    for key, cases in out.items():  # one case a line: reviewable diffs
        lines.append(f'"{key}": [\n' + ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]")
    (OUT / "reference.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="retrain the BPE (changes every id)")
    args = parser.parse_args()
    if args.train or not (OUT / "tokenizer.json").exists():
        train()
    reference()
