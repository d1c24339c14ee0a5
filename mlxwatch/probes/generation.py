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

The request is sent and read by a reader task of its own, so that the stream can outlive the
verdict: mlx-lm notices a closed stream only when it next writes to it, so a probe that gives up
and closes does not take its work back; the server still generates the abandoned reply, ahead of
the next probe, and then logs a BrokenPipeError. With ``linger`` the probe instead keeps reading
(and discarding) what the server still sends after a deadline verdict, for a bounded time.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from mlxwatch.config import ProbeConfig
from mlxwatch.probes.sse import LineTooLong, SSEParser
from mlxwatch.probes.replies import NOT_MLX, body_summary, is_html

# One fixed prompt, always: the server's prompt cache then holds a single small entry for the
# probe, which never pushes a user's long cached prompt out.
PROBE_PROMPT = "mlxwatch liveness probe. Reply with OK."

THREAD_DIED_TEXT = "generation thread died"  # mlx-lm >= 0.32's error once its generation thread is gone
MAX_BODY_BYTES = 256 * 1024  # a 4-token stream is ~2 KB; anything near this is broken
LINGER_MAX_BYTES = MAX_BODY_BYTES  # a late reply is the same reply, only late: same bound
# Each streamed token is one SSE chunk of JSON (~300 bytes, more with a long model path): a
# probe that asks for more tokens may receive proportionally more before it is "too large".
BYTES_PER_TOKEN = 4096


def body_limit(max_tokens: int) -> int:
    """The most a healthy reply to ``max_tokens`` tokens may weigh (also the lingering bound)."""
    return max(MAX_BODY_BYTES, max_tokens * BYTES_PER_TOKEN)
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
    """Everything one generation probe saw. ``failure`` is None exactly when ``ok``.

    The verdict fields are final when the probe returns. Only a lingering probe (see
    ``probe_generation``'s ``linger``) changes the result afterwards, and only its ``late_*``
    fields and the transcript, from the ``lingering`` task.
    """

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
    prompt_tokens: int | None = None  # ... and of the prompt it read (the cadence's reading speed)
    cached_tokens: int | None = None  # ... of which the server's prompt cache held (not read again)
    finish_reason: str | None = None
    keepalives: list[Keepalive] = field(default_factory=list)
    transcript: list[dict[str, Any]] = field(default_factory=list)
    body_bytes: int = 0
    late_tokens: int = 0  # deliveries read after the verdict, while lingering
    late_bytes: int = 0  # bytes read (and discarded) after the verdict, while lingering
    late_finished: bool | None = None  # did the server end the stream while we lingered? None: no linger yet/at all
    lingering: asyncio.Task[None] | None = field(default=None, compare=False, repr=False)
    _read_on: Callable[[float], None] | None = field(default=None, compare=False, repr=False)

    def read_on(self, until: float) -> None:
        """Keep reading a lingering stream at least until ``until`` (event-loop time): never
        shortens it. A no-op for a probe that is not lingering."""
        if self._read_on is not None and self.lingering is not None and not self.lingering.done():
            self._read_on(until)

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
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "keepalives": [vars(k) for k in self.keepalives],
            "body_bytes": self.body_bytes,
            "late_tokens": self.late_tokens,
            "late_bytes": self.late_bytes,
            "late_finished": self.late_finished,
            "transcript": self.transcript,
        }


# Lingering tasks outlive the call that made them; the event loop keeps only weak references.
_LINGERING: set[asyncio.Task[None]] = set()


async def probe_generation(
    client: httpx.AsyncClient,
    url: str,
    *,
    first_token_timeout: float = ProbeConfig.first_token_timeout,
    timeout: float = ProbeConfig.timeout,
    max_tokens: int = ProbeConfig.max_tokens,
    prompt: str = PROBE_PROMPT,
    linger: float = 0.0,
    read_until: float | None = None,
    cut: asyncio.Future[str] | None = None,
    on_token: Callable[[], None] | None = None,
) -> GenerationProbeResult:
    """Send one streaming generation request and judge it by delivery. Never raises for the server.

    The result comes back the moment there is a verdict. A deadline verdict (``no_first_token``,
    ``stalled``) leaves the server still holding the stream. With ``linger`` 0 the stream is
    closed before returning. With ``linger > 0`` a background task keeps reading it, counting and
    discarding (``late_tokens``, ``late_bytes``, at most ``LINGER_MAX_BYTES``), until the server
    ends it (``late_finished`` True) or ``linger`` seconds pass (False); so a struggling server
    finishes the probe's reply cleanly instead of serving an orphan and hitting a broken pipe.
    That task is ``result.lingering``: it never raises, and cancelling it closes the stream.
    ``read_until`` (seconds after sending; the daemon passes its ``timeout``) replaces ``linger``:
    the stream is read until then, so a token within it is a delivery; past it, nothing is
    (``result.read_on`` moves that bound later, never earlier).
    ``cut``: a future the caller may resolve with a reason (nothing flows anywhere, the probe's
    own stream included): the probe then fails at once, as at its deadline (its stream read on
    the same way): ``no_first_token`` before its first token, ``stalled`` after it. ``on_token``
    is called at each token delivered, so that the caller can tell the probe's own stream's
    silence (it sees only other clients').
    """
    loop = asyncio.get_running_loop()
    run = _Run(url, loop, first_token_timeout=first_token_timeout, timeout=timeout, linger=linger,
               max_body=body_limit(max_tokens), read_until=read_until, on_token=on_token)
    run.result._read_on = run.read_on
    if cut is not None:
        cut.add_done_callback(lambda f: run.cut_short(f.result()) if not f.cancelled() else None)
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reader = asyncio.create_task(_read(client, url, body, run), name=f"mlxwatch probe reader {url}")
    try:
        await run.ready.wait()  # the reader's verdict, or a deadline's
        if run.lingering:
            run.result.lingering = reader
            _LINGERING.add(reader)
            reader.add_done_callback(_LINGERING.discard)
        else:
            await reader  # the stream is closed (at once, after a deadline) before the probe returns
    except BaseException:  # our caller cancelled us: the stream goes too
        run.disarm()
        reader.cancel()
        raise
    if run.result.total is None:
        run.result.total = round(run.now(), 4)
    return run.result


class _Done(Exception):
    """Internal: the probe has its verdict; leave the stream."""


class _Run:
    """The state one probe run shares between the caller, its deadline timer and its reader task.

    The verdict is given once: by the reader (a token stream that ends, an error, garbage) or by
    the deadline timer, whichever comes first; nothing overwrites it. After a deadline verdict
    the reader only counts late arrivals (``gave_up``) until it is cut off.
    """

    def __init__(
        self, url: str, loop: asyncio.AbstractEventLoop, *, first_token_timeout: float, timeout: float, linger: float,
        max_body: int = MAX_BODY_BYTES, read_until: float | None = None, on_token: Callable[[], None] | None = None,
    ) -> None:
        self.loop = loop
        self.on_token = on_token
        self.max_body = max_body
        self.t0 = loop.time()
        self.result = GenerationProbeResult(url=url, started_at=time.time())
        self.first_token_timeout = first_token_timeout
        self.timeout = timeout
        self.linger = linger
        self.read_until = read_until  # seconds after sending: the lingering bound instead of ``linger``
        self.last_delivery: float | None = None
        self.done = False  # [DONE] seen
        self.judged = False  # the verdict is in
        self.gave_up = False  # ... and it was a deadline's: the stream is still open
        self.lingering = False  # ... and it is being read on
        self.ready = asyncio.Event()  # the caller may return
        self.cutoff: asyncio.Timeout | None = None  # the reader's, while it reads
        self.cutoff_at: float | None = None  # loop time at which the reader stops reading
        # The deadline timer, armed from the moment the request goes out: first-token limit now,
        # moved to the whole-stream limit at the first delivery (``deliver``).
        self.timer: asyncio.TimerHandle | None = loop.call_at(
            self.t0 + min(first_token_timeout, timeout), self._deadline_passed
        )

    def now(self) -> float:
        return self.loop.time() - self.t0

    def note(self, kind: str, text: str = "", *, force: bool = False) -> None:
        transcript = self.result.transcript
        if force or len(transcript) < MAX_TRANSCRIPT_EVENTS:
            transcript.append({"t": round(self.now(), 4), "kind": kind, "text": text[:MAX_EVENT_TEXT]})

    def fail(self, failure: str, detail: str = "") -> _Done:
        if not self.judged:
            self.judged = True
            self.disarm()
            self.result.ok = False
            self.result.failure = failure
            self.result.detail = detail
            self.note("fail", f"{failure}: {detail}")
        return _Done()

    def succeed(self) -> None:
        if not self.judged:
            self.judged = True
            self.disarm()
            self.result.ok = True
            self.result.failure = None

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def deliver(self) -> None:
        t = self.now()
        if self.result.ttft is None:
            self.result.ttft = t
            self.disarm()  # first token in: now the whole-stream limit applies
            self.timer = self.loop.call_at(self.t0 + self.timeout, self._deadline_passed)
        elif self.last_delivery is not None:
            self.result.gaps.append(round(t - self.last_delivery, 4))
        self.last_delivery = t
        if self.on_token is not None:
            self.on_token()

    def cut_short(self, reason: str) -> None:
        """The caller's evidence says no token is coming (nothing flows anywhere): fail now as
        at the deadline that applies (first token, or the whole stream after a token: the
        report's livelock delivers a prompt's first token, then nothing, and waiting out the
        whole stream's 90 s put its verdict 60 s after the onset). Too late once the verdict is in."""
        if self.judged:
            return
        self.disarm()
        self._deadline_passed(reason)

    def read_on(self, until: float) -> None:
        """Read the lingering stream at least until loop time ``until``."""
        if self.lingering and self.cutoff_at is not None and until > self.cutoff_at:
            self.cut_off(after=until - self.loop.time())

    def _deadline_passed(self, early: str | None = None) -> None:
        """The timer: a deadline passed before the reader had a verdict. Give it now."""
        self.timer = None
        res = self.result
        if res.ttft is None:
            where = "no response headers" if res.status is None else "headers received"
            extra = f", {len(res.keepalives)} keepalives" if res.keepalives else ""
            waited = (f"the wait ended early, after {self.now():.1f}s of {self.first_token_timeout:g}s: {early}"
                      if early else f"{self.first_token_timeout:g}s passed")
            self.fail(Failure.NO_FIRST_TOKEN, f"{waited} ({where}{extra})")
        elif early:
            self.fail(Failure.STALLED, f"{res.tokens} tokens, then nothing; the wait ended early, "
                                       f"after {self.now():.1f}s of {self.timeout:g}s: {early}")
        else:
            self.fail(Failure.STALLED, f"{res.tokens} tokens, then nothing; stream unfinished after {self.timeout:g}s")
        res.total = round(self.now(), 4)
        self.gave_up = True
        after = self.linger if self.read_until is None else max(0.0, self.t0 + self.read_until - self.loop.time())
        self.lingering = after > 0
        self.cut_off(after=after)
        self.ready.set()

    def cut_off(self, after: float) -> None:
        """Have the reader stop reading ``after`` seconds from now (0: at once)."""
        self.cutoff_at = self.loop.time() + after
        if self.cutoff is not None:
            self.cutoff.reschedule(self.cutoff_at)

    def end_linger(self, finished: bool, why: str) -> None:
        """Record how lingering ended, once (the transcript may be full: this line always goes in)."""
        res = self.result
        if self.lingering and res.late_finished is None:
            res.late_finished = finished
            self.note("linger_end", f"{why}; {res.late_tokens} late tokens, {res.late_bytes} late bytes", force=True)


async def _read(client: httpx.AsyncClient, url: str, body: dict[str, Any], run: _Run) -> None:
    """The reader task: send the request and read the reply, to judge it, then (lingering) to drain it.

    Never raises but for cancellation: whatever goes wrong is the verdict (while judging) or how
    lingering ended (after). The cutoff is how the probe ends the reading when it gave up.
    """
    try:
        async with asyncio.timeout_at(run.cutoff_at) as cutoff:  # None: until the probe gives up
            run.cutoff = cutoff
            try:
                await _stream(client, url, body, run)
            finally:
                run.cutoff = None
    except _Done:
        pass
    except asyncio.CancelledError:
        run.end_linger(False, "cancelled")
        raise
    except Exception as exc:  # the last-resort guard: never raise for a server's behaviour
        if not run.gave_up:
            _judge_exception(run, exc)
        elif isinstance(exc, TimeoutError):  # httpx's own timeouts are off: this is the cutoff
            run.end_linger(False, f"{run.linger:g}s of lingering passed" if run.read_until is None
                           else f"{run.read_until:g}s since it was sent passed")
        else:
            run.end_linger(False, _describe(exc))
    finally:
        run.end_linger(False, "stopped")
        run.ready.set()


def _judge_exception(run: _Run, exc: Exception) -> None:
    """What an exception while sending or reading says about the server.

    Anything that is not httpx's is a reply the parser could not cope with: malformed, named by
    its type, rather than a crash of whatever runs the probe (the daemon's watcher task).
    """
    if isinstance(exc, httpx.ConnectError):
        if _was_refused(exc):
            run.fail(Failure.CONNECT_REFUSED, "nothing is listening at this address")
        else:
            run.fail(Failure.CONNECT_FAILED, str(exc) or type(exc).__name__)
    elif isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        run.fail(Failure.DISCONNECTED, _describe(exc))
    elif isinstance(exc, httpx.HTTPError):
        run.fail(Failure.CONNECT_FAILED, f"{type(exc).__name__}: {exc}")
    else:
        run.fail(Failure.MALFORMED, f"the probe could not read the reply ({_describe(exc)})")


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], run: _Run) -> None:
    res = run.result
    run.note("request", f"POST {url}/v1/chat/completions max_tokens={body['max_tokens']}")
    # httpx's own timeouts are off: the deadline timer and the cutoff are the single source of truth.
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, timeout=httpx.Timeout(None)
    ) as response:
        run.note("headers", f"HTTP {response.status_code} {response.headers.get('content-type', '')}")
        if not run.gave_up:
            res.status = response.status_code
            res.connect = round(run.now(), 4)
            if response.status_code != 200:
                text = await _read_bounded(response, run)
                said = body_summary(text, response.headers.get("content-type", ""))
                if THREAD_DIED_TEXT in text:
                    raise run.fail(Failure.THREAD_DIED, f"HTTP {response.status_code}: {said}")
                if is_html(text, response.headers.get("content-type", "")):  # never mlx-lm's answer
                    raise run.fail(Failure.HTTP_ERROR, f"HTTP {response.status_code} with {said}: {NOT_MLX}")
                raise run.fail(Failure.HTTP_ERROR, f"HTTP {response.status_code}: {said}")
        parser = SSEParser()
        async for chunk in response.aiter_raw():
            if run.gave_up:
                if _read_late(chunk, parser, run):
                    continue
                return
            _judge_chunk(chunk, parser, run)
            if run.done:
                run.succeed()
                return
        # The server ended the stream.
        if run.gave_up:
            run.end_linger(True, "the server ended the stream")
            return
        for event in parser.close():
            _handle_event(event.kind, event.text, run)
            if run.done:
                run.succeed()
                return
        if res.ttft is None:
            raise run.fail(Failure.DISCONNECTED, "stream ended before any token")
        raise run.fail(Failure.DISCONNECTED, f"stream ended after {res.tokens} tokens without [DONE]")


def _judge_chunk(chunk: bytes, parser: SSEParser, run: _Run) -> None:
    res = run.result
    res.body_bytes += len(chunk)
    if res.body_bytes > run.max_body:
        raise run.fail(Failure.TOO_LARGE, f"more than {run.max_body} bytes")
    try:
        events = parser.feed(chunk)
    except LineTooLong as exc:
        raise run.fail(Failure.MALFORMED, str(exc)) from None
    for event in events:
        _handle_event(event.kind, event.text, run)
        if run.done:
            return


def _read_late(chunk: bytes, parser: SSEParser, run: _Run) -> bool:
    """A chunk after a deadline verdict: count it, keep nothing. False: stop reading now."""
    res = run.result
    if not run.lingering:
        return False  # linger 0: the cutoff is on its way; read nothing more
    res.late_bytes += len(chunk)
    if res.late_bytes > run.max_body:
        run.end_linger(False, f"stopped reading after {run.max_body} late bytes")
        return False
    try:
        events = parser.feed(chunk)
    except LineTooLong:
        return True  # the parser dropped the line; nothing late depends on it
    for event in events:
        if event.kind != "data":
            continue
        if event.text.strip() == "[DONE]":
            run.note("late_done")
            continue
        try:
            parsed = _parse_chunk(event.text)
        except Malformed:
            continue
        if parsed.error is not None:
            run.note("late_error", parsed.error)
        for delivered, _ in parsed.choices:
            if delivered:
                res.late_tokens += 1
                run.note("late_token", delivered)
    return True


def _handle_event(kind: str, text: str, run: _Run) -> None:
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
        chunk = _parse_chunk(text)
    except Malformed as exc:
        run.note("data", text)
        raise run.fail(Failure.MALFORMED, str(exc)) from None
    if chunk.error is not None:
        raise _server_error(run, chunk.error)
    if chunk.completion_tokens is not None:
        res.completion_tokens = chunk.completion_tokens
    if chunk.prompt_tokens is not None:
        res.prompt_tokens, res.cached_tokens = chunk.prompt_tokens, chunk.cached_tokens
    for delivered, finish_reason in chunk.choices:
        if delivered:
            res.tokens += 1
            run.note("token", delivered)
            run.deliver()
        if finish_reason:
            res.finish_reason = finish_reason
            run.note("finish", finish_reason)
            if res.ttft is None:  # the model chose to stop at once: still a delivery
                run.deliver()


class Malformed(Exception):
    """A reply chunk of a shape no OpenAI-compatible server sends; the message says what was wrong."""


@dataclass
class _Chunk:
    """What one ``data:`` payload carries, once its shape has been checked."""

    error: str | None = None  # the server's error, as JSON text
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    choices: list[tuple[str, str | None]] = field(default_factory=list)  # (delivered text or "", finish_reason)


def _parse_chunk(text: str) -> _Chunk:
    """Check one chat-completion chunk field by field; raise ``Malformed`` at the first odd shape.

    A field may be missing or null (servers differ in what they leave out), but a field that is
    there must have its type: a server that sends ``"delta": "hi"`` is broken, and saying so
    beats guessing what it meant.
    """
    payload = _load_json(text)
    if not isinstance(payload, dict):
        raise Malformed(f"data is not a JSON object: {text[:80]!r}")
    chunk = _Chunk()
    error = payload.get("error")
    if error is not None:
        if not isinstance(error, str | dict):
            raise Malformed(f"error is {_kind(error)}, not a message or an object: {_brief(error)}")
        chunk.error = _brief(error, 200)
        return chunk
    usage = payload.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            raise Malformed(f"usage is {_kind(usage)}, not an object: {_brief(usage)}")
        count = usage.get("completion_tokens")
        if count is not None and (not isinstance(count, int) or isinstance(count, bool)):
            raise Malformed(f"usage.completion_tokens is {_kind(count)}, not an integer: {_brief(count)}")
        chunk.completion_tokens = count
        prompt = usage.get("prompt_tokens")  # only a hint for the pace: a wrong type is ignored, not a failure
        chunk.prompt_tokens = prompt if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt > 0 else None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        chunk.cached_tokens = cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None
    choices = payload.get("choices")
    if choices is None:
        raise Malformed(f"chunk without a choices list: {text[:80]!r}")
    if not isinstance(choices, list):
        raise Malformed(f"choices is {_kind(choices)}, not a list: {_brief(choices)}")
    for choice in choices:
        if not isinstance(choice, dict):
            raise Malformed(f"choice is {_kind(choice)}, not an object: {_brief(choice)}")
        delta = choice.get("delta")
        if delta is None:
            delta = {}
        if not isinstance(delta, dict):
            raise Malformed(f"delta is {_kind(delta)}, not an object: {_brief(delta)}")
        finish_reason = choice.get("finish_reason")
        if finish_reason is not None and not isinstance(finish_reason, str):
            raise Malformed(f"finish_reason is {_kind(finish_reason)}, not a string: {_brief(finish_reason)}")
        chunk.choices.append((_delivered(delta), finish_reason or None))
    return chunk


# What a delta may deliver, in the order we look: the answer, the model's reasoning, tool calls.
_DELTA_FIELDS = (("content", (str, list), "a string or a list"), ("reasoning", (str,), "a string"),
                 ("tool_calls", (list,), "a list"))


def _delivered(delta: dict[str, Any]) -> str:
    """The text a delta delivers, for the transcript; "" when it delivers nothing."""
    delivered = ""
    for name, types, wanted in _DELTA_FIELDS:
        value = delta.get(name)
        if value is None:
            continue
        if not isinstance(value, types):
            raise Malformed(f"delta.{name} is {_kind(value)}, not {wanted}: {_brief(value)}")
        if value and not delivered:
            delivered = value if isinstance(value, str) else _brief(value, MAX_EVENT_TEXT)
    return delivered


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:  # "[[[[..." 50,000 deep fits in one line
        raise Malformed(f"data is not JSON (nested too deeply): {text[:80]!r}") from None
    except ValueError:
        raise Malformed(f"data is not JSON: {text[:80]!r}") from None


def _kind(value: object) -> str:
    """A JSON value's type, as a detail line says it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _brief(value: object, limit: int = 80) -> str:
    """A JSON value as short text for a detail line; never raises, however odd the value."""
    try:
        return json.dumps(value)[:limit]
    except (ValueError, TypeError, RecursionError):
        return f"<{_kind(value)}>"


def _handle_plain_line(text: str, run: _Run) -> None:
    """A line that is not SSE: a JSON error sent without ``data:`` framing, or garbage."""
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError):
        raise run.fail(Failure.MALFORMED, f"not an SSE line: {text[:80]!r}") from None
    if isinstance(payload, dict) and payload.get("error") is not None:
        try:
            chunk = _parse_chunk(text)
        except Malformed as exc:
            raise run.fail(Failure.MALFORMED, f"not an SSE line: {exc}") from None
        if chunk.error is not None:
            raise _server_error(run, chunk.error)
    raise run.fail(Failure.MALFORMED, f"not an SSE line: {text[:80]!r}")


def _server_error(run: _Run, message: str) -> _Done:
    """An error the server sent instead of tokens; mlx-lm >= 0.32 says its thread died."""
    run.note("error", message)
    return run.fail(Failure.THREAD_DIED if THREAD_DIED_TEXT in message else Failure.SERVER_ERROR, message)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


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


# mlx_lm.server streams ": keepalive 1024/25660" while it processes the prompt. ASCII digits
# only, and not too many: int() refuses "²" and 5,000-digit numbers, both of which isdigit() allows.
_PROGRESS = re.compile(r"(\d{1,18})/(\d{1,18})", re.ASCII)


def _keepalive_progress(text: str) -> tuple[int, int] | None:
    parts = text.split()
    if len(parts) == 2 and parts[0] == "keepalive":
        match = _PROGRESS.fullmatch(parts[1])
        if match:
            return int(match[1]), int(match[2])
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
