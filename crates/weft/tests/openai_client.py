"""Drives `weft serve` with the real `openai` package, as users' tools do.

usage: openai_client.py BASE_URL API_KEY MODEL api|concurrent N
Prints one JSON line of results; exits non-zero (with the reason) on any failed check.
"""

import json
import sys
import threading

import urllib.error
import urllib.request

import openai

base, key, model, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
results = {}


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def expect_error(cls, status, fn, what, needle=None):
    try:
        fn()
    except cls as e:
        check(e.status_code == status, f"{what}: status {e.status_code}, wanted {status}")
        body = e.body if isinstance(e.body, dict) else {}
        msg = str(body.get("message", e))
        if needle:
            check(needle in msg or needle == body.get("param"), f"{what}: '{needle}' not in {body}")
        return body
    raise SystemExit(f"FAILED: {what}: no error raised")


def raw(path, body=None, auth=True):
    """A request without the client library: (status, parsed JSON body)."""
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def api():
    ids = [m.id for m in client.models.list().data]
    check(ids == [model], f"models lists {ids}")
    msgs = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=24, temperature=0, seed=1
    )
    choice = whole.choices[0]
    check(whole.object == "chat.completion", f"object {whole.object}")
    check(choice.message.role == "assistant", "assistant role")
    check(choice.finish_reason in ("stop", "length"), f"finish {choice.finish_reason}")
    check(whole.usage.completion_tokens > 0, "some tokens")
    check(whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens, "usage sums")
    parts, finish, roles, usage = [], None, 0, None
    stream = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        check(chunk.object == "chat.completion.chunk", f"chunk object {chunk.object}")
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles += 1
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    streamed = "".join(parts)
    check(streamed == choice.message.content, f"streamed {streamed!r} != whole {choice.message.content!r}")
    check(finish == choice.finish_reason, f"stream finish {finish}")
    check(roles == 1, f"{roles} role deltas")
    check(usage and usage.completion_tokens == whole.usage.completion_tokens, f"stream usage {usage}")
    results["chat"] = choice.message.content

    lp = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = lp.choices[0].logprobs.content
    check(len(content) == lp.usage.completion_tokens, "one logprob entry per token")
    for t in content:
        check(len(t.top_logprobs) == 3, "3 alternatives")
        check(t.logprob <= 0 and abs(t.logprob - max(a.logprob for a in t.top_logprobs)) < 1e-4,
              "greedy token is the most likely")

    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    check(comp.object == "text_completion", "completion object")
    check(comp.usage.completion_tokens == 8 and comp.choices[0].finish_reason == "length", "8 tokens, length")
    results["completion"] = comp.choices[0].text
    ids_prompt = client.completions.create(model=model, prompt=[2, 818, 5279, 529, 7001, 563], max_tokens=4, temperature=0)
    check(ids_prompt.usage.prompt_tokens == 6, "token-id prompt counted")
    stopped = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                        temperature=0, stop=[comp.choices[0].text.split()[1]])
    check(stopped.choices[0].finish_reason == "stop", "stop sequence ends the text")
    check(comp.choices[0].text.startswith(stopped.choices[0].text), "stopped text is a prefix")
    seeded = [client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                        temperature=0.9, seed=7).choices[0].text for _ in range(2)]
    check(seeded[0] == seeded[1], "same seed, same text")

    bad_key = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    expect_error(openai.AuthenticationError, 401, lambda: bad_key.models.list(), "wrong key")
    status, body = raw("/models", auth=False)
    check(status == 401 and body["error"]["code"] == "invalid_api_key", "missing key")
    expect_error(openai.BadRequestError, 400, lambda: client.chat.completions.create(
        model=model, messages=msgs, max_tokens=-1), "negative max_tokens", "max_tokens")
    expect_error(openai.BadRequestError, 400, lambda: client.chat.completions.create(
        model=model, messages=msgs, max_tokens=10**9), "oversized max_tokens", "max_tokens")
    expect_error(openai.BadRequestError, 400, lambda: client.chat.completions.create(
        model="no-such-model", messages=msgs), "unknown model", "model")
    expect_error(openai.BadRequestError, 400, lambda: client.completions.create(
        model=model, prompt="word " * 5000, max_tokens=4), "prompt past the context", "prompt")
    expect_error(openai.BadRequestError, 400, lambda: client.chat.completions.create(
        model=model, messages=[{"role": "wizard", "content": "x"}]), "unknown role", "role")
    status, body = raw("/chat/completions", b'{"model": "x", "messages": [}')
    check(status == 400 and body["error"]["type"] == "invalid_request_error", "malformed body")
    status, body = raw("/chat/completions", json.dumps({"model": model, "messages": "hi"}).encode())
    check(status == 400 and body["error"]["param"] == "messages", f"wrong type: {body}")


def concurrent(n):
    """n streaming requests at once; each must stream exactly its max_tokens tokens."""
    errors, counts = [], {}

    def one(i):
        try:
            want = 8 + i % 9
            got, finish = 0, None
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Count to {i}."}],
                max_tokens=want, temperature=0.7, seed=i, stream=True, logprobs=True,
                stream_options={"include_usage": True},
            )
            usage = None
            for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage
                for c in chunk.choices:
                    if c.logprobs and c.logprobs.content:
                        got += len(c.logprobs.content)
                    if c.finish_reason:
                        finish = c.finish_reason
            if finish == "length" and got != want:
                errors.append(f"request {i}: {got} tokens streamed, max_tokens {want}")
            if usage is None or usage.completion_tokens != got:
                errors.append(f"request {i}: usage {usage} but {got} tokens streamed")
            if finish not in ("stop", "length"):
                errors.append(f"request {i}: finish {finish}")
            counts[i] = got
        except Exception as e:  # noqa: BLE001 - report every failure, not the first
            errors.append(f"request {i}: {e!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(not errors, "; ".join(errors))
    check(len(counts) == n, f"{len(counts)} of {n} completed")
    results["tokens"] = sum(counts.values())


if mode == "api":
    api()
else:
    concurrent(int(sys.argv[5]))
print(json.dumps(results))
