"""Agents in a process of their own sending long prompts through the official ``openai`` SDK, as
coding agents do: each of ``--clients`` sends ``--turns`` prompts of about ``--tokens`` prompt
tokens one after the other, streamed or not. A process of its own, so that the daemon under
test sees its connections as someone else's (kernel sight leaves the daemon's own out). Prints
one JSON line per finished request (``ok``, ``error``, ``prompt_tokens``, ``seconds``), then
exits 0::

    python tests/lab/agent.py URL --tokens 3600 --clients 1 --turns 3 --stream
    python tests/lab/agent.py URL --tokens 3600 --clients 3 --turns 2          # not streamed

Every prompt starts with its own words, so the server's prompt cache never shortens it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time

import openai

# " the" is one token of the lab's tiny model (tiny_model.py's corpus): a prompt of n of them,
# after a few words of its own, is about n + 14 tokens with the chat template.
FILLER = " the"


NONCE = random.randrange(10**6)  # this run's: an earlier run's prompt in the server's cache shortens none


def prompt(tokens: int, client: int, turn: int) -> str:
    return f"{NONCE} agent {client} turn {turn}:" + FILLER * max(1, tokens - 14)


def turn(sdk: openai.OpenAI, args: argparse.Namespace, client: int, n: int, lock: threading.Lock) -> None:
    started = time.time()
    out: dict = {"client": client, "turn": n, "stream": args.stream, "sent": round(started, 3), "ok": False,
                 "error": None, "prompt_tokens": None, "completion_tokens": 0}
    messages = [{"role": "user", "content": prompt(args.tokens, client, n)}]
    try:
        if args.stream:
            finish = None
            stream = sdk.chat.completions.create(model="default_model", messages=messages, max_tokens=args.max_tokens,
                                                 temperature=0.0, stream=True,
                                                 stream_options={"include_usage": True})
            for chunk in stream:
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                if chunk.usage is not None:
                    out["prompt_tokens"] = chunk.usage.prompt_tokens
                    out["completion_tokens"] = chunk.usage.completion_tokens
            out["ok"] = finish is not None
            out["finish"] = finish
        else:
            answer = sdk.chat.completions.create(model="default_model", messages=messages,
                                                 max_tokens=args.max_tokens, temperature=0.0)
            out["ok"] = bool(answer.choices) and answer.choices[0].finish_reason is not None
            out["finish"] = answer.choices[0].finish_reason if answer.choices else None
            if answer.usage is not None:
                out["prompt_tokens"] = answer.usage.prompt_tokens
                out["completion_tokens"] = answer.usage.completion_tokens
    except openai.OpenAIError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["seconds"] = round(time.time() - started, 2)
    with lock:
        print(json.dumps(out), flush=True)


def agent(args: argparse.Namespace, client: int, lock: threading.Lock) -> None:
    sdk = openai.OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0, timeout=args.timeout)
    for n in range(args.turns):
        turn(sdk, args, client, n, lock)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agent.py")
    ap.add_argument("url")
    ap.add_argument("--tokens", type=int, default=3600, help="prompt tokens a request (about)")
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--turns", type=int, default=1, help="requests each client sends, one after the other")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900.0, help="the SDK's timeout a request, seconds")
    args = ap.parse_args(argv)
    lock = threading.Lock()
    threads = [threading.Thread(target=agent, args=(args, c, lock)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
