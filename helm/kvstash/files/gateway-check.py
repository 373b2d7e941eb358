"""`helm test` through the gateway (gateway.enabled), with nothing but the
standard library: waits for GET /readiness to answer 200 (smg has registered
a scheduler and its tokenizer), then POSTs one /v1/completions for the first
model /v1/models lists and fails unless tokens came back."""

import json
import os
import time
import urllib.request

url = os.environ["GATEWAY_URL"]
deadline = time.monotonic() + float(os.environ["WAIT_SECONDS"])
why = "no answer"
while True:
    try:
        with urllib.request.urlopen(f"{url}/readiness", timeout=5) as reply:
            if reply.status == 200:
                break
            why = f"HTTP {reply.status}"
    except OSError as exc:  # refused, or an error status (503 until ready)
        why = str(exc)
    if time.monotonic() > deadline:
        raise SystemExit(f"{url}/readiness: not ready ({why})")
    time.sleep(2)

with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as reply:
    model = json.load(reply)["data"][0]["id"]
body = {"model": model, "prompt": os.environ["PROMPT"],
        "max_tokens": int(os.environ["MAX_TOKENS"]), "temperature": 0}
request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
with urllib.request.urlopen(request, timeout=120) as reply:
    completion = json.load(reply)
tokens = completion["usage"]["completion_tokens"]
if tokens < 1:
    raise SystemExit(f"{url}/v1/completions generated nothing: {completion}")
print(f"{model} through {url}: {tokens} tokens, {completion['choices'][0]['text']!r}")
