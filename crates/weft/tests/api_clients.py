"""Drives `weft serve` with the real client packages people's tools use: openai (tool
calls, structured output, Responses), anthropic (Messages) and ollama.

usage: api_clients.py BASE_URL API_KEY MODEL openai|anthropic|ollama|forced
Prints one JSON line of results; exits non-zero (with the reason) on any failed check.
`forced` is for a model that writes nothing sensible (a synthetic one): only what
constrained decoding guarantees is checked, through every API.
"""

import json
import sys

import jsonschema

base, key, model, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
results = {}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two small whole numbers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 999},
                "b": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def valid(instance, schema, what):
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError as e:
        raise SystemExit(f"FAILED: {what}: {e.message} in {instance!r}")


def expect(exc_type, fn, what):
    try:
        fn()
    except exc_type as e:
        return e
    raise SystemExit(f"FAILED: {what}: no {exc_type.__name__} raised")


# ---------------------------------------------------------------- openai


def openai_tools(client, greedy=True):
    import openai

    t = {"temperature": 0} if greedy else {}
    # Room for the longest output the schemas allow, even a byte at a time (sampled noise).
    room = 80 if greedy else 400
    # A forced call, whole: well-formed whatever the model would write.
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=room, **t
    )
    c = r.choices[0]
    check(c.finish_reason == "tool_calls", f"finish {c.finish_reason}")
    calls = c.message.tool_calls
    check(calls and len(calls) == 1, f"one call: {calls}")
    fn = calls[0].function
    check(fn.name in ("get_weather", "add"), f"declared tool: {fn.name}")
    spec = WEATHER if fn.name == "get_weather" else ADD
    args = json.loads(fn.arguments)
    valid(args, spec["function"]["parameters"], "required call arguments")
    check(calls[0].id.startswith("call_") and calls[0].type == "function", f"call id {calls[0]}")
    results["openai_call"] = {"name": fn.name, "arguments": args}
    # A named function: that one, whatever the prompt says.
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=room, **t,
    )
    fn = r.choices[0].message.tool_calls[0].function
    check(fn.name == "add", f"named call went to {fn.name}")
    valid(json.loads(fn.arguments), ADD["function"]["parameters"], "named call arguments")
    # The same call streamed: deltas with index, id, name, then argument pieces.
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=room,
        stream=True, stream_options={"include_usage": True}, **t,
    )
    ids, names, pieces, finish, usage = {}, {}, {}, None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                if d.id:
                    ids[d.index] = d.id
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                if d.function and d.function.arguments:
                    pieces.setdefault(d.index, []).append(d.function.arguments)
            if ch.finish_reason:
                finish = ch.finish_reason
    check(finish == "tool_calls", f"streamed finish {finish}")
    check(list(names.values()) == ["get_weather"] and 0 in ids, f"streamed call {ids} {names}")
    check(len(pieces[0]) >= 1, "arguments arrive in pieces")
    streamed_args = json.loads("".join(pieces[0]))
    valid(streamed_args, WEATHER["function"]["parameters"], "streamed call arguments")
    check(usage and usage.completion_tokens > 0, f"usage {usage}")
    results["openai_streamed_call"] = streamed_args
    # Two turns: the call and its result go back in; the answer is text.
    call_id = ids[0]
    turn2 = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(streamed_args)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r2 = client.chat.completions.create(
        model=model, messages=turn2, tools=[WEATHER], tool_choice="none", max_tokens=24, **t
    )
    c2 = r2.choices[0]
    check(c2.finish_reason in ("stop", "length") and not c2.message.tool_calls, f"turn 2: {c2}")
    check(isinstance(c2.message.content, str), "turn 2 content")
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=1, **t)
    check(r2.usage.prompt_tokens > plain.usage.prompt_tokens + 20, "the call and its result are in the prompt")
    results["openai_turn2"] = c2.message.content
    # Structured output: json_schema and json_object, both parse (and validate).
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a programmer as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        max_tokens=room + 120, **t,
    )
    check(r.choices[0].finish_reason == "stop", f"json_schema finish {r.choices[0].finish_reason}")
    person = json.loads(r.choices[0].message.content)
    valid(person, PERSON, "json_schema output")
    results["openai_json_schema"] = person
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A JSON object with one key."}],
        response_format={"type": "json_object"}, max_tokens=60,
        **t,
    )
    if r.choices[0].finish_reason == "stop":
        check(isinstance(json.loads(r.choices[0].message.content), dict), "json_object output")
    # Malformed: each error is OpenAI's shape with the field named.
    e = expect(openai.BadRequestError, lambda: client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=4), "unknown tool")
    check(e.status_code == 400 and e.body.get("param") == "tool_choice", f"unknown tool: {e.body}")
    e = expect(openai.BadRequestError, lambda: client.chat.completions.create(
        model=model, messages=ASK, response_format={"type": "yaml"}, max_tokens=4), "bad format")
    check(e.body.get("param") == "response_format.type", f"bad format: {e.body}")
    e = expect(openai.BadRequestError, lambda: client.chat.completions.create(
        model=model, messages=ASK + [{"role": "tool", "content": "x"}], max_tokens=4), "tool turn")
    check(e.body.get("param") == "messages[1].tool_call_id", f"tool turn: {e.body}")


def openai_responses(client, greedy=True):
    import openai

    t = {"temperature": 0} if greedy else {}
    r = client.responses.create(
        model=model, instructions="Answer briefly.", input="Name a colour.",
        max_output_tokens=16, **t,
    )
    check(r.status in ("completed", "incomplete"), f"status {r.status}")
    check(r.output[0].type == "message", f"output {r.output}")
    check(r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, "usage")
    whole = r.output_text
    # Streamed: typed events whose deltas add up to the final text.
    deltas, kinds, final = [], [], None
    for ev in client.responses.create(
        model=model, instructions="Answer briefly.", input=[{"role": "user", "content": "Name a colour."}],
        max_output_tokens=16, stream=True, **t,
    ):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    check(kinds[0] == "response.created", f"first event {kinds[:3]}")
    check(final is not None, f"no final event in {kinds}")
    check("".join(deltas) == final.output_text, "deltas add up to the final text")
    if greedy:
        check(final.output_text == whole, f"streamed {final.output_text!r} != whole {whole!r}")
    results["responses_text"] = whole
    # A forced call as an output item, then its result fed back as an input item.
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = client.responses.create(model=model, input=ASK, tools=[tool], tool_choice="required",
                                max_output_tokens=80, **t)
    calls = [o for o in r.output if o.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "get_weather", f"responses call {r.output}")
    valid(json.loads(calls[0].arguments), WEATHER["function"]["parameters"], "responses call arguments")
    r2 = client.responses.create(model=model, input=ASK + [
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C, clear"},
    ], tools=[tool], tool_choice="none", max_output_tokens=12, **t)
    check(r2.output[0].type == "message", f"responses turn 2 {r2.output}")
    # Structured output through text.format.
    r = client.responses.create(model=model, input="Describe a programmer as JSON.", max_output_tokens=120,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}}, **t)
    valid(json.loads(r.output_text), PERSON, "responses json_schema")
    e = expect(openai.BadRequestError, lambda: client.responses.create(
        model=model, input=[{"type": "image_generation_call", "id": "x"}], max_output_tokens=4), "bad item")
    check(e.body.get("param") == "input[0].type", f"bad item: {e.body}")


def run_openai(greedy=True):
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    openai_tools(client, greedy)
    openai_responses(client, greedy)


# ---------------------------------------------------------------- anthropic


def run_anthropic(greedy=True):
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120)
    t = {"temperature": 0} if greedy else {}
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    m = client.messages.create(model=model, max_tokens=24, system="You are brief.", messages=msgs, **t)
    check(m.type == "message" and m.role == "assistant", f"message {m}")
    check(m.content and m.content[0].type == "text", f"content {m.content}")
    check(m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason}")
    check(m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 24, f"usage {m.usage}")
    text = m.content[0].text
    results["anthropic_text"] = text
    # Streamed, with the SDK's own accumulation: the same text.
    with client.messages.stream(model=model, max_tokens=24, system="You are brief.", messages=msgs, **t) as s:
        joined = "".join(s.text_stream)
        final = s.get_final_message()
    check(final.content[0].text == joined, "streamed deltas equal the final message")
    if greedy:
        check(joined == text, f"streamed {joined!r} != whole {text!r}")
        # A stop sequence taken from the greedy text ends it there, and is named.
        words = [w for w in text.split() if len(w) > 2]
        if len(words) > 1:
            stop = words[1]
            m = client.messages.create(model=model, max_tokens=24, system="You are brief.", messages=msgs,
                                       stop_sequences=[stop], **t)
            check(m.stop_reason == "stop_sequence" and m.stop_sequence == stop, f"stop: {m.stop_reason} {m.stop_sequence}")
            check(stop not in m.content[0].text, "the stop sequence is not in the text")
    # Tool use, forced ("any"): a tool_use block whose input validates; then its result.
    tool = {"name": "get_weather", "description": "The current weather in a city.",
            "input_schema": WEATHER["function"]["parameters"]}
    m = client.messages.create(model=model, max_tokens=80, messages=ASK, tools=[tool],
                               tool_choice={"type": "any"}, **t)
    check(m.stop_reason == "tool_use", f"tool stop_reason {m.stop_reason}")
    uses = [b for b in m.content if b.type == "tool_use"]
    check(len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_"), f"tool_use {m.content}")
    valid(uses[0].input, tool["input_schema"], "tool_use input")
    results["anthropic_tool_use"] = uses[0].input
    with client.messages.stream(model=model, max_tokens=80, messages=ASK, tools=[tool],
                                tool_choice={"type": "tool", "name": "get_weather"}, **t) as s:
        final = s.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    check(len(uses) == 1, f"streamed tool_use {final.content}")
    valid(uses[0].input, tool["input_schema"], "streamed tool_use input")
    m2 = client.messages.create(model=model, max_tokens=16, tools=[tool], tool_choice={"type": "none"}, messages=ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 C, clear"}]},
    ], **t)
    check(m2.stop_reason in ("end_turn", "max_tokens") and m2.content[0].type == "text", f"turn 2 {m2}")
    # Errors in Anthropic's shape, the field named.
    e = expect(anthropic.BadRequestError, lambda: client.messages.create(model=model, max_tokens=0, messages=msgs), "max_tokens 0")
    check(e.status_code == 400 and e.body["error"]["type"] == "invalid_request_error"
          and "max_tokens" in e.body["error"]["message"], f"max_tokens 0: {e.body}")
    e = expect(anthropic.BadRequestError, lambda: client.messages.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "image")
    check("messages.0.content.0.type" in e.body["error"]["message"], f"image: {e.body}")
    e = expect(anthropic.NotFoundError, lambda: client.messages.create(model="claude-x", max_tokens=4, messages=msgs), "model")
    check(e.body["error"]["type"] == "not_found_error", f"model: {e.body}")
    bad = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0)
    e = expect(anthropic.AuthenticationError, lambda: bad.messages.create(model=model, max_tokens=4, messages=msgs), "key")
    check(e.body["error"]["type"] == "authentication_error", f"key: {e.body}")


# ---------------------------------------------------------------- ollama


def run_ollama(greedy=True):
    import ollama

    client = ollama.Client(host=base, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    opts = {"num_predict": 16, **({"temperature": 0} if greedy else {})}
    tags = client.list()
    check([m.model for m in tags.models] == [f"{model}:latest"], f"tags {tags}")
    check(tags.models[0].size > 0 and tags.models[0].details.format == "gguf", f"tag details {tags.models[0]}")
    info = client.show(model)
    check(info.details.family and info.modelinfo, f"show {info}")
    msgs = [{"role": "user", "content": "Name three colours."}]
    r = client.chat(model=model, messages=msgs, options=opts, stream=False)
    check(r.done and r.message.role == "assistant" and r.message.content, f"chat {r}")
    check(r.eval_count > 0 and r.eval_duration > 0 and r.prompt_eval_count > 0, f"chat stats {r}")
    parts = list(client.chat(model=model, messages=msgs, options=opts, stream=True))
    check(parts[-1].done and not any(p.done for p in parts[:-1]), "one final chat part")
    joined = "".join(p.message.content for p in parts)
    if greedy:
        check(joined == r.message.content, f"streamed chat {joined!r} != {r.message.content!r}")
    results["ollama_chat"] = r.message.content
    results["ollama_tok_s"] = r.eval_count / (r.eval_duration / 1e9)
    g = client.generate(model=model, prompt="The capital of France is", options=opts, stream=False)
    check(g.done and g.response and g.done_reason in ("stop", "length"), f"generate {g}")
    parts = list(client.generate(model=model, prompt="The capital of France is", options=opts, stream=True))
    if greedy:
        check("".join(p.response for p in parts) == g.response, "streamed generate")
    j = client.chat(model=model, messages=[{"role": "user", "content": "Describe a programmer as JSON."}],
                    format=PERSON, options={**opts, "num_predict": 120}, stream=False)
    valid(json.loads(j.message.content), PERSON, "ollama format schema")
    j = client.generate(model=model, prompt="A JSON object:", format="json", options={**opts, "num_predict": 60}, stream=False)
    if j.done_reason == "stop":
        check(isinstance(json.loads(j.response), dict), "ollama format json")
    # Tools are accepted; a tool result fed back is part of the next prompt.
    r = client.chat(model=model, messages=ASK, tools=[WEATHER], options=opts, stream=False)
    check(r.done, "chat with tools")
    e = expect(ollama.ResponseError, lambda: client.chat(model="nope", messages=msgs, stream=False), "unknown model")
    check(e.status_code == 404 and "nope" in e.error, f"unknown model: {e.status_code} {e.error}")
    e = expect(ollama.ResponseError, lambda: client.generate(model=model, prompt="x", options={"num_predict": -5}, stream=False), "num_predict")
    check(e.status_code == 400 and "num_predict" in e.error, f"num_predict: {e.error}")


if mode == "openai":
    run_openai()
elif mode == "anthropic":
    run_anthropic()
elif mode == "ollama":
    run_ollama()
elif mode == "forced":
    # Whatever this model writes, what constrained decoding holds must hold, sampled.
    import openai
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    openai_tools(client, greedy=False)
else:
    raise SystemExit(f"unknown mode {mode}")
print(json.dumps(results))
