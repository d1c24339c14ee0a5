"""The generation probe: liveness as a user feels it, by tokens actually delivered.

A streaming ``POST /v1/chat/completions`` with a tiny fixed prompt. Healthy only if the first
delivery arrives within ``first_token_timeout`` and the stream finishes within ``timeout``
(both counted from the moment the request is sent). Whatever the server does (accepts and says
nothing, sends headers then silence, trickles keepalives forever, sends garbage or a 10 MB body)
the probe returns by its deadline with a result that says what happened; it never raises for a
server's behaviour and its memory stays bounded::

    async with httpx.AsyncClient() as client:
        result = await probe_generation(client, "http://127.0.0.1:8080")
        print(result.ok, result.failure, result.ttft)
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from mlxwatch.probes.sse import LineTooLong, SSEParser

# One fixed prompt, always: the server's prompt cache then holds a single small entry for the
# probe, which never pushes a user's long cached prompt out.
PROBE_PROMPT = "mlxwatch liveness probe. Reply with OK."

THREAD_DIED_TEXT = "generation thread died"  # mlx-lm >= 0.32's error once its generation thread is gone
MAX_BODY_BYTES = 256 * 1024  # a 4-token stream is ~2 KB; anything near this is broken
MAX_TRANSCRIPT_EVENTS = 200
MAX_EVENT_TEXT = 500


class Failure:
    """Why a probe failed. Plain strings, stable: they land in JSON, journals and exit messages."""

    CONNECT_REFUSED = "connect_refused"
    CONNECT_FAILED = "connect_failed"
    NO_FIRST_TOKEN = "no_first_token"
    STALLED = "stalled"
    HTTP_ERROR = "http_error"
    THREAD_DIED = "thread_died"
    DISCONNECTED = "disconnected"
    MALFORMED = "malformed"
    TOO_LARGE = "too_large"
    SERVER_ERROR = "server_error"


DESCRIPTIONS = {
    Failure.CONNECT_REFUSED: "connection refused (nothing listening)",
    Failure.CONNECT_FAILED: "could not connect",
    Failure.NO_FIRST_TOKEN: "no token delivered within the first-token timeout",
    Failure.STALLED: "stream stalled mid-generation",
    Failure.HTTP_ERROR: "HTTP error",
    Failure.THREAD_DIED: "server reports its generation thread died",
    Failure.DISCONNECTED: "connection closed before the stream finished",
    Failure.MALFORMED: "malformed stream",
    Failure.TOO_LARGE: "response too large",
    Failure.SERVER_ERROR: "server sent an error in the stream",
}


@dataclass
class Keepalive:
    """A ``: keepalive X/Y`` comment: the server is processing the prompt."""

    at: float  # seconds since the request was sent
    processed: int
    total: int


@dataclass
class GenerationProbeResult:
    """Everything one generation probe saw. ``failure`` is None exactly when ``ok``."""

    url: str
    started_at: float  # wall clock, for journals and bundles
    ok: bool = False
    failure: str | None = None
    detail: str = ""
    status: int | None = None
    connect: float | None = None  # request sent -> response headers
    ttft: float | None = None  # request sent -> first delivered token
    total: float | None = None  # request sent -> end (or give-up)
    gaps: list[float] = field(default_factory=list)  # between deliveries
    tokens: int = 0  # content chunks delivered
    completion_tokens: int | None = None  # the server's own count, when it sends usage
    finish_reason: str | None = None
    keepalives: list[Keepalive] = field(default_factory=list)
    transcript: list[dict[str, Any]] = field(default_factory=list)
    body_bytes: int = 0

    @property
    def reason(self) -> str:
        """One human line: ``ok`` or what failed."""
        if self.ok:
            return "ok"
        text = DESCRIPTIONS.get(self.failure or "", self.failure or "failed")
        return f"{text}: {self.detail}" if self.detail else text

    @property
    def max_gap(self) -> float | None:
        return max(self.gaps) if self.gaps else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "started_at": self.started_at,
            "ok": self.ok,
            "failure": self.failure,
            "reason": self.reason,
            "status": self.status,
            "connect": self.connect,
            "ttft": self.ttft,
            "total": self.total,
            "gaps": self.gaps,
            "max_gap": self.max_gap,
            "tokens": self.tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "keepalives": [vars(k) for k in self.keepalives],
            "body_bytes": self.body_bytes,
            "transcript": self.transcript,
        }


class _Done(Exception):
    """Internal: the probe has its verdict; leave the stream."""


class _Run:
    """The mutable state of one probe run; kept apart so the coroutine reads top to bottom."""

    def __init__(self, url: str, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.t0 = loop.time()
        self.result = GenerationProbeResult(url=url, started_at=time.time())
        self.last_delivery: float | None = None
        self.done = False

    def now(self) -> float:
        return self.loop.time() - self.t0

    def note(self, kind: str, text: str = "") -> None:
        transcript = self.result.transcript
        if len(transcript) < MAX_TRANSCRIPT_EVENTS:
            transcript.append({"t": round(self.now(), 4), "kind": kind, "text": text[:MAX_EVENT_TEXT]})

    def fail(self, failure: str, detail: str = "") -> _Done:
        self.result.ok = False
        self.result.failure = failure
        self.result.detail = detail
        self.note("fail", f"{failure}: {detail}")
        return _Done()

    def deliver(self, deadline: asyncio.Timeout, total_deadline: float) -> None:
        t = self.now()
        if self.result.ttft is None:
            self.result.ttft = t
            deadline.reschedule(total_deadline)  # first token in: now the whole-stream limit applies
        elif self.last_delivery is not None:
            self.result.gaps.append(round(t - self.last_delivery, 4))
        self.last_delivery = t


async def probe_generation(
    client: httpx.AsyncClient,
    url: str,
    *,
    first_token_timeout: float = 60.0,
    timeout: float = 120.0,
    max_tokens: int = 4,
    prompt: str = PROBE_PROMPT,
) -> GenerationProbeResult:
    """Send one streaming generation request and judge it by delivery. Never raises for the server."""
    loop = asyncio.get_running_loop()
    run = _Run(url, loop)
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    total_deadline = run.t0 + timeout
    try:
        async with asyncio.timeout_at(run.t0 + min(first_token_timeout, timeout)) as deadline:
            await _stream(client, url, body, run, deadline, total_deadline)
    except _Done:
        pass
    except TimeoutError:
        if run.result.ttft is None:
            where = "no response headers" if run.result.status is None else "headers received"
            extra = f", {len(run.result.keepalives)} keepalives" if run.result.keepalives else ""
            run.fail(Failure.NO_FIRST_TOKEN, f"{first_token_timeout:g}s passed ({where}{extra})")
        else:
            run.fail(
                Failure.STALLED,
                f"{run.result.tokens} tokens, then nothing; stream unfinished after {timeout:g}s",
            )
    except httpx.ConnectError as exc:
        if _was_refused(exc):
            run.fail(Failure.CONNECT_REFUSED, "nothing is listening at this address")
        else:
            run.fail(Failure.CONNECT_FAILED, str(exc) or type(exc).__name__)
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        run.fail(Failure.DISCONNECTED, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    except httpx.HTTPError as exc:
        run.fail(Failure.CONNECT_FAILED, f"{type(exc).__name__}: {exc}")
    run.result.total = round(run.now(), 4)
    return run.result


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    run: _Run,
    deadline: asyncio.Timeout,
    total_deadline: float,
) -> None:
    res = run.result
    run.note("request", f"POST {url}/v1/chat/completions max_tokens={body['max_tokens']}")
    # httpx's own timeouts are off: the asyncio deadline above is the single source of truth.
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, timeout=httpx.Timeout(None)
    ) as response:
        res.status = response.status_code
        res.connect = round(run.now(), 4)
        run.note("headers", f"HTTP {response.status_code} {response.headers.get('content-type', '')}")
        if response.status_code != 200:
            text = await _read_bounded(response, run)
            if THREAD_DIED_TEXT in text:
                raise run.fail(Failure.THREAD_DIED, f"HTTP {response.status_code}: {text[:200]}")
            raise run.fail(Failure.HTTP_ERROR, f"HTTP {response.status_code}: {text[:200]}")
        parser = SSEParser()
        async for chunk in response.aiter_raw():
            res.body_bytes += len(chunk)
            if res.body_bytes > MAX_BODY_BYTES:
                raise run.fail(Failure.TOO_LARGE, f"more than {MAX_BODY_BYTES} bytes")
            try:
                events = parser.feed(chunk)
            except LineTooLong as exc:
                raise run.fail(Failure.MALFORMED, str(exc)) from None
            for event in events:
                _handle_event(event.kind, event.text, run, deadline, total_deadline)
                if run.done:
                    break
            if run.done:
                break
        if not run.done:
            for event in parser.close():
                _handle_event(event.kind, event.text, run, deadline, total_deadline)
    if not run.done:
        if res.ttft is None:
            raise run.fail(Failure.DISCONNECTED, "stream ended before any token")
        raise run.fail(Failure.DISCONNECTED, f"stream ended after {res.tokens} tokens without [DONE]")
    res.ok = True
    res.failure = None


def _handle_event(kind: str, text: str, run: _Run, deadline: asyncio.Timeout, total_deadline: float) -> None:
    res = run.result
    if kind == "comment":
        run.note("comment", text)
        progress = _keepalive_progress(text)
        if progress:
            res.keepalives.append(Keepalive(round(run.now(), 4), *progress))
        return
    if kind != "data":
        run.note("other", text)
        _handle_plain_line(text, run)
        return
    if text.strip() == "[DONE]":
        run.note("done")
        if res.ttft is None:
            raise run.fail(Failure.DISCONNECTED, "[DONE] before any token")
        run.done = True
        return
    try:
        payload = json.loads(text)
    except ValueError:
        run.note("data", text)
        raise run.fail(Failure.MALFORMED, f"data is not JSON: {text[:80]!r}") from None
    if not isinstance(payload, dict):
        raise run.fail(Failure.MALFORMED, f"data is not a JSON object: {text[:80]!r}")
    if "error" in payload:
        raise _server_error(run, payload["error"])
    usage = payload.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        res.completion_tokens = usage["completion_tokens"]
    choices = payload.get("choices")
    if not isinstance(choices, list):
        raise run.fail(Failure.MALFORMED, "chunk without a choices list")
    for choice in choices:
        if not isinstance(choice, dict):
            raise run.fail(Failure.MALFORMED, "choice is not an object")
        delta = choice.get("delta") or {}
        content = delta.get("content") or delta.get("reasoning") or delta.get("tool_calls")
        if content:
            res.tokens += 1
            run.note("token", str(content))
            run.deliver(deadline, total_deadline)
        if choice.get("finish_reason"):
            res.finish_reason = str(choice["finish_reason"])
            run.note("finish", res.finish_reason)
            if res.ttft is None:  # the model chose to stop at once: still a delivery
                run.deliver(deadline, total_deadline)


def _handle_plain_line(text: str, run: _Run) -> None:
    """A line that is not SSE: a JSON error sent without ``data:`` framing, or garbage."""
    try:
        payload = json.loads(text)
    except ValueError:
        raise run.fail(Failure.MALFORMED, f"not an SSE line: {text[:80]!r}") from None
    if isinstance(payload, dict) and "error" in payload:
        raise _server_error(run, payload["error"])
    raise run.fail(Failure.MALFORMED, f"not an SSE line: {text[:80]!r}")


def _server_error(run: _Run, error: object) -> _Done:
    """An error object the server sent instead of tokens; mlx-lm >= 0.32 says its thread died."""
    message = json.dumps(error)[:200]
    run.note("error", message)
    return run.fail(Failure.THREAD_DIED if THREAD_DIED_TEXT in message else Failure.SERVER_ERROR, message)


def _was_refused(exc: BaseException) -> bool:
    """httpx words a refusal as "All connection attempts failed"; the cause says what it was."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        if isinstance(seen, OSError) and seen.errno in (61, 111):  # ECONNREFUSED on macOS, Linux
            return True
        for inner in getattr(seen, "exceptions", ()):  # anyio/trio group several attempts
            if _was_refused(inner):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def _keepalive_progress(text: str) -> tuple[int, int] | None:
    # mlx_lm.server streams ": keepalive 1024/25660" while it processes the prompt.
    parts = text.split()
    if len(parts) == 2 and parts[0] == "keepalive":
        done, _, total = parts[1].partition("/")
        if done.isdigit() and total.isdigit():
            return int(done), int(total)
    return None


async def _read_bounded(response: httpx.Response, run: _Run, limit: int = 16 * 1024) -> str:
    data = bytearray()
    async for chunk in response.aiter_raw():
        data += chunk[: limit - len(data)]
        if len(data) >= limit:
            break
    text = data.decode("utf-8", errors="replace")
    run.note("body", text)
    return text
