"""OpenAI conformance as the real ``openai`` client sees it, against a front door on a loopback
socket and an emulated worker: model_not_found, parameters refused by name (never ignored),
sampling values SGLang would refuse, stream opening and usage rules, stops and max_tokens=0."""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio
from frontdoor_helpers import MODEL, Served, worker_fixture  # noqa: F401 (the worker fixture)

from kvcompassd.core.config import FrontDoorLimits

MESSAGES = [{"role": "user", "content": "say something"}]


@pytest_asyncio.fixture
async def client(worker):
    async with (Served(FrontDoorLimits(), worker.http_url) as edge,
                openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as c):
        c.edge = edge
        yield c


async def test_a_wrong_model_is_a_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=1)


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3, "logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"extra_body": {"chat_template_kwargs": {"x": 1}}}, "chat_template_kwargs"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"seed": 2**64}, "seed"),  # the wire carries 64 bits: was a 500 on the cross-region path
    ({"stop": ["x"] * 17}, "stop"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"extra_body": {"max_tokens": -1}}, "max_tokens"),
    ({"max_completion_tokens": 10**9}, "max_completion_tokens"),
])
async def test_chat_parameters_the_edge_cannot_honour_are_refused_by_name(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
    assert caught.value.param == param, caught.value.body
    assert isinstance(caught.value.code, str) and caught.value.code


@pytest.mark.parametrize("kwargs,param", [
    ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"), ({"logprobs": 2}, "logprobs"), ({"suffix": "x"}, "suffix"),
    ({"extra_body": {"top_k": 0, "temperature": 0.7}}, "top_k"), ({"extra_body": {"min_p": 2}}, "min_p"),
])
async def test_completion_parameters_the_edge_cannot_honour_are_refused_by_name(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)
    assert caught.value.param == param, caught.value.body


async def test_supported_sampling_parameters_are_carried(client):
    comp = await client.completions.create(
        model=MODEL, prompt="hello", max_tokens=3, temperature=0, top_p=0.9, seed=7, frequency_penalty=0.5,
        presence_penalty=-0.5, logit_bias={"5": 1.0}, n=1, best_of=1, echo=False,
        extra_body={"top_k": 0, "min_p": 0.1, "repetition_penalty": 1.1})  # top_k 0 is fine when greedy
    assert comp.usage.completion_tokens == 3 and comp.choices[0].finish_reason == "length"


async def test_chat_stream_opens_with_the_role_and_has_no_usage_unless_asked(client):
    chunks = [c async for c in await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                                    stream=True)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("chat", [True, False])
async def test_stream_usage_comes_last_with_empty_choices_when_asked(client, chat):
    options = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 5, "model": MODEL}
    if chat:
        stream = await client.chat.completions.create(messages=MESSAGES, **options)
    else:
        stream = await client.completions.create(prompt="tell me", **options)
    chunks = [c async for c in stream]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5 and last.usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


async def test_stop_strings_end_the_completion_as_sglang_does(client):
    whole = await client.completions.create(model=MODEL, prompt="a fixed prompt", max_tokens=24)
    text = whole.choices[0].text
    stop = text[10:12]
    cut = await client.completions.create(model=MODEL, prompt="a fixed prompt", max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    chunks = [c async for c in await client.completions.create(model=MODEL, prompt="a fixed prompt", max_tokens=24,
                                                               stop=stop, stream=True)]
    assert "".join(c.choices[0].text for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_max_tokens_zero_prefills_and_returns_nothing(client):
    comp = await client.completions.create(model=MODEL, prompt="only a prefill", max_tokens=0)
    assert comp.choices[0].text == "" and comp.usage.completion_tokens == 0
    assert comp.usage.prompt_tokens == len("only a prefill") and comp.choices[0].finish_reason == "length"


async def test_errors_are_openai_shaped_with_string_codes(client):
    edge = client.edge
    async with edge.session.post(edge.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 3}) as r:
        err = (await r.json())["error"]
    assert r.status == 400 and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_parameter" and err["param"] == "n"


@pytest.mark.parametrize("params,param", [
    ({"temperature": -1}, "sampling_params.temperature"),
    ({"custom_params": {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}}}, "sampling_params"),  # deeper than the wire
    ({"sampling_seed": 2**64}, "sampling_params.sampling_seed"),
    ({"min_new_tokens": 9, "max_new_tokens": 4}, "sampling_params.min_new_tokens"),
    ({"regex": "a", "ebnf": "b"}, "sampling_params.regex"),
    ({"bogus": 1}, "sampling_params.bogus"),
])
async def test_generate_refuses_what_sglang_would_refuse(client, params, param):
    edge = client.edge
    async with edge.session.post(edge.url + "/generate", json={"text": "hi", "sampling_params": params}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == param


async def test_generate_honours_stop_token_ids_and_zero_new_tokens(client):
    edge = client.edge
    async with edge.session.post(edge.url + "/generate", json={"text": "stop here",
                                                               "sampling_params": {"max_new_tokens": 12}}) as r:
        whole = await r.json()
    token = whole["output_ids"][5]
    first = whole["output_ids"].index(token)
    async with edge.session.post(edge.url + "/generate", json={
            "text": "stop here", "sampling_params": {"max_new_tokens": 12, "stop_token_ids": [token]}}) as r:
        cut = await r.json()
    assert cut["output_ids"] == whole["output_ids"][: first + 1]
    assert cut["text"] == whole["text"][:first] and cut["meta_info"]["finish_reason"]["type"] == "stop"
    async with edge.session.post(edge.url + "/generate", json={"text": "stop here",
                                                               "sampling_params": {"max_new_tokens": 0}}) as r:
        zero = await r.json()
    assert r.status == 200 and zero["output_ids"] == [] and zero["text"] == ""


@pytest.mark.parametrize("message,param", [
    ({"role": "assistant", "content": None,
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     "messages[1].tool_calls"),
    ({"role": "user", "content": "hi", "name": "alice"}, "messages[1].name"),
])
async def test_message_fields_the_edge_would_not_render_are_refused_by_name(client, message, param):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=[MESSAGES[0], message], max_tokens=2)
    assert caught.value.param == param and caught.value.code == "unsupported_parameter", caught.value.body
