"""An app in a process of its own, streaming chat completions to a server as users' apps do, so
that the daemon under test sees its connections as someone else's (its kernel sight leaves the
daemon's own connections out). Prints one JSON line per finished request; runs until killed or
``--count`` requests are done::

    python -m lab.app URL --words 900 --max-tokens 24 --parallel 2 --count 2
    python -m lab.app URL --every 2 --timeout 60          # a request every 2 s, each in a thread
    python -m lab.app URL --openai --parallel 3 --count 6  # the openai SDK, not streaming
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import httpx


def one(url: str, args: argparse.Namespace, i: int, lock: threading.Lock) -> None:
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * max(1, args.words // 9))
    body = {"messages": [{"role": "user", "content": f"{i} {words}"}], "max_tokens": args.max_tokens,
            "temperature": 0.0, "stream": True}
    if args.seed is not None:
        body["seed"] = args.seed
    if args.text_token is not None:  # every token this one: text the server writes as it comes
        body["logit_bias"] = {str(args.text_token): 100.0}
    started, tokens, finish, error = time.monotonic(), 0, None, None
    if args.openai:  # the official SDK, not streaming: the answer comes whole at its end
        import openai

        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=args.timeout,
                                   http_client=httpx.Client(trust_env=False))
            extra = {k: body[k] for k in ("seed", "logit_bias") if k in body}
            got = client.chat.completions.create(model="default_model", messages=body["messages"],
                                                 max_tokens=args.max_tokens, temperature=0.0, **extra)
            tokens, finish = got.usage.completion_tokens if got.usage else 0, got.choices[0].finish_reason
        except openai.OpenAIError as exc:
            error = f"{type(exc).__name__}: {exc}"
        with lock:
            print(json.dumps({"i": i, "tokens": tokens, "finish": finish, "error": error,
                              "seconds": round(time.monotonic() - started, 2)}), flush=True)
        return
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, trust_env=False,
                          timeout=httpx.Timeout(args.timeout)) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        tokens += 1
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    with lock:
        print(json.dumps({"i": i, "tokens": tokens, "finish": finish, "error": error,
                          "seconds": round(time.monotonic() - started, 2)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--words", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--count", type=int, default=0, help="requests in all (0: until killed)")
    ap.add_argument("--every", type=float, default=0.0, help="start a request this often (0: as --parallel allows)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--text-token", type=int, default=None,
                    help="a token id to bias every token to: the tiny model's random tokens are mostly not text, "
                         "and the server writes nothing for a token without text")
    ap.add_argument("--openai", action="store_true",
                    help="ask through the official openai SDK without streaming (the answer comes whole)")
    args = ap.parse_args()
    lock, threads, i = threading.Lock(), [], 0
    while args.count == 0 or i < args.count:
        threads = [t for t in threads if t.is_alive()]
        if args.every <= 0 and len(threads) >= args.parallel:
            time.sleep(0.05)
            continue
        t = threading.Thread(target=one, args=(args.url, args, i, lock), daemon=True)
        t.start()
        threads.append(t)
        i += 1
        if args.every > 0:
            time.sleep(args.every)
    for t in threads:
        t.join()
    sys.exit(0)


if __name__ == "__main__":
    main()
