"""Recorded requests in a bundle: the private part ``requests/`` (issue 35).

A hang set off by a sequence of requests comes back only when that sequence is sent again,
byte for byte. At a verdict the door's recorder (``front.record``) hands over the requests of
its window that had arrived by then, in arrival order: those in flight and those before them.
A server started with ``mlxwatch launch --record`` records them itself (``shim.recorder``, read
back from its spool by ``from_shim``) in the same form; when both record, the door's are taken
(they are what the clients sent and got, the door's outcomes among them). The bundle keeps

- ``requests/body-NNNNNN.bin``: each body exactly as the client sent it (never redacted: a
  replay must send the same bytes; files 0600 as every bundle file);
- ``requests/requests.json``: per request, when it came (``t``: seconds after the first),
  its connection, method, target, headers (credentials were never recorded), the body's file,
  size and SHA-256, and what came back (status, first and last token, tokens, finish reason,
  outcome, client gone);
- in the manifest (``requests``): the requests the server was working on when delivery
  stopped and the few just before them, described without their words (prompt size,
  ``max_tokens``, ``stream``, sampling parameters): the summary names them.

``bundle export`` leaves the bodies out unless asked (``--with-request-bodies``);
``mlxwatch replay`` reads them back with ``load_requests``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from dataclasses import replace as _replace
from pathlib import Path
from typing import Any, Sequence

from mlxwatch import storage
from mlxwatch.errors import BundleError
from mlxwatch.front.recorder import RecordedRequest
from mlxwatch.shim import heartbeat, spool

DIRECTORY = "requests"
INDEX = f"{DIRECTORY}/requests.json"
BODY_PREFIX = f"{DIRECTORY}/body-"
JUST_BEFORE = 3  # requests named in the summary before those in flight
MAX_INDEX_BYTES = 64 * 1024**2
MAX_BODY_BYTES = 1024**3
# What a request asks of the sampler, named in the summary (OpenAI's and mlx-lm's own fields).
SOURCES = {"door": "the front door", "shim": "the launch shim"}  # who recorded, as the summary names it
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "logit_bias", "stop", "n", "logprobs", "top_logprobs")


def body_file(seq: int) -> str:
    return f"{BODY_PREFIX}{seq:06d}.bin"


def is_body_file(relname: str) -> bool:
    return relname.startswith(BODY_PREFIX) and relname.endswith(".bin")


def describe_body(body: bytes) -> dict[str, Any]:
    """What a request asks, without its words: prompt size, max_tokens, stream, sampling."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return {"json": False, "body_bytes": len(body)}
    if not isinstance(data, dict):
        return {"json": False, "body_bytes": len(body)}
    out: dict[str, Any] = {"body_bytes": len(body), "stream": data.get("stream") is True,
                           "max_tokens": data.get("max_completion_tokens", data.get("max_tokens"))}
    messages = data.get("messages")
    if isinstance(messages, list):
        out["messages"] = len(messages)
        out["prompt_chars"] = sum(len(m["content"]) for m in messages
                                  if isinstance(m, dict) and isinstance(m.get("content"), str))
    elif isinstance(data.get("prompt"), str):
        out["prompt_chars"] = len(data["prompt"])
    sampling = {k: data[k] for k in SAMPLING if k in data}
    if sampling:
        out["sampling"] = sampling
    return out


def index_entries(recorded: Sequence[RecordedRequest]) -> list[dict[str, Any]]:
    """``requests/requests.json``: one entry per request, arrival order, times relative to the first."""
    if not recorded:
        return []
    t0 = recorded[0].arrived_mono

    def rel(mono: float | None, base: float) -> float | None:
        return None if mono is None else round(mono - base, 4)

    return [{
        "seq": r.seq, "id": r.id, "t": round(r.arrived_mono - t0, 4), "arrived_at": r.arrived_wall,
        "connection": r.connection, "method": r.method, "target": r.target,
        "headers": [list(h) for h in r.headers], "dropped_headers": list(r.dropped_headers),
        "stream": r.stream, "max_tokens": r.max_tokens,
        "body_file": body_file(r.seq), "body_bytes": len(r.body), "body_sha256": hashlib.sha256(r.body).hexdigest(),
        "in_flight": r.in_flight, "status": r.status, "outcome": r.outcome, "client_gone": r.client_gone,
        "tokens": r.tokens, "finish_reason": r.finish_reason,
        "first_token_after_s": rel(r.first_token_mono, r.arrived_mono),
        "last_token_after_s": rel(r.last_token_mono, r.arrived_mono),
        "ended_after_s": rel(r.ended_mono, r.arrived_mono),
    } for r in recorded]


def delivery_stopped(recorded: Sequence[RecordedRequest]) -> float | None:
    """When delivery stopped, by the door's rule (``evidence.door.quiet_start``): the later of
    the last token to anyone and the oldest request still waiting; None with none waiting."""
    waiting = [r.arrived_mono for r in recorded if r.in_flight]
    if not waiting:
        return None
    tokens = [r.last_token_mono for r in recorded if r.last_token_mono is not None]
    return max(min(waiting), max(tokens)) if tokens else min(waiting)


def manifest_entry(recorded: Sequence[RecordedRequest], at_verdict: float, source: str = "door") -> dict[str, Any]:
    """The manifest's ``requests``: how many, the requests the server was working on when
    delivery stopped (in flight at the verdict, arrived by then), those that came after it (in
    flight, waiting) and the ones just before, described without their words."""
    stopped = delivery_stopped(recorded)
    in_flight = [r for r in recorded if r.in_flight]
    working = [r for r in in_flight if stopped is None or r.arrived_mono <= stopped]
    after = [r for r in in_flight if r not in working]
    first = in_flight[0].seq if in_flight else None
    before = [r for r in recorded if not r.in_flight and (first is None or r.seq < first)][-JUST_BEFORE:]

    def named(r: RecordedRequest) -> dict[str, Any]:
        return {"seq": r.seq, "id": r.id, "age_s": round(at_verdict - r.arrived_mono, 3), "path": r.target.split("?")[0],
                "tokens": r.tokens, "outcome": r.outcome, **describe_body(r.body)}

    return {"recorded": len(recorded), "source": source, "index": INDEX, "bodies": len(recorded),
            "bytes": sum(len(r.body) for r in recorded),
            "stopped_s_before_verdict": None if stopped is None else round(at_verdict - stopped, 3),
            "in_flight": [named(r) for r in working], "arrived_after": [named(r) for r in after],
            "just_before": [named(r) for r in before]}


def summary_lines(entry: dict[str, Any] | None) -> list[str]:
    """The summary's section on the recorded requests (from the manifest's ``requests``)."""
    if not entry:
        return []
    by = SOURCES.get(str(entry.get("source") or "door"), SOURCES["door"])
    out = ["", f"## Requests (recorded by {by})", "",
           f"{entry.get('recorded', 0)} request(s) in `{entry.get('index', INDEX)}`, bodies exact and private "
           "(`bundle export` leaves them out; `mlxwatch replay` sends them again)."]

    def line(r: dict[str, Any]) -> str:
        prompt = f"{r['prompt_chars']} chars" if "prompt_chars" in r else f"{r.get('body_bytes', '?')} bytes"
        if "messages" in r:
            prompt += f" in {r['messages']} message(s)"
        sampling = ", ".join(f"{k}={v}" for k, v in (r.get("sampling") or {}).items()) or "server defaults"
        return (f"- #{r['seq']} `{r['path']}` {r['age_s']:g}s before the verdict: prompt {prompt}, "
                f"max_tokens {r.get('max_tokens')}, stream {str(r.get('stream')).lower()}, sampling {sampling}; "
                f"{r.get('tokens', 0)} token(s) delivered" + (f", {r['outcome']}" if r.get("outcome") else ""))

    working = entry.get("in_flight") or []
    stopped = entry.get("stopped_s_before_verdict")
    when = f" ({stopped:g}s before the verdict)" if isinstance(stopped, (int, float)) else ""
    out += ["", f"The server was working on these when delivery stopped{when}:" if working else
            "No recorded request was in flight at the verdict."]
    out += [line(r) for r in working]
    if entry.get("arrived_after"):
        out += ["", "Arrived after delivery had stopped (waiting at the verdict):"]
        out += [line(r) for r in entry["arrived_after"]]
    if entry.get("just_before"):
        out += ["", "Just before them:"] + [line(r) for r in entry["just_before"]]
    return out


@dataclass(frozen=True)
class StoredRequest:
    """A recorded request read back from a bundle, for a replay."""

    seq: int
    t: float  # seconds after the first request
    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    in_flight: bool  # in flight at the verdict
    meta: dict[str, Any]


def load_requests(bundle: Path) -> list[StoredRequest]:
    """The bundle's recorded requests, arrival order, each body checked against its hash and
    each request checked to be one a replay can send to the server it is told, and only there
    (bundles travel: one attached to an issue may have been made by anyone). BundleError (one
    line) when the bundle has none or they are damaged."""
    index = bundle / INDEX
    try:
        if (bundle / DIRECTORY).is_symlink():
            raise BundleError(f"{bundle / DIRECTORY}: is a link (a bundle's requests are its own files)")
        entries = json.loads(_read_own(index, MAX_INDEX_BYTES))
    except FileNotFoundError:
        raise BundleError(f"{bundle}: holds no recorded requests ({INDEX} is missing: was front.record on?)") from None
    except (OSError, ValueError) as exc:
        raise BundleError(f"{index}: unreadable ({_why(exc)})") from None
    if not isinstance(entries, list):
        raise BundleError(f"{index}: not a list of requests")
    out: list[StoredRequest] = []
    seen: set[int] = set()
    for n, e in enumerate(entries):
        try:
            name = str(e["body_file"])
            if not is_body_file(name) or "/" in name[len(BODY_PREFIX):]:
                raise ValueError(f"body_file {name!r} is not a body of this bundle")
            body = _read_own(bundle / name, MAX_BODY_BYTES)
            if hashlib.sha256(body).hexdigest() != e["body_sha256"]:
                raise ValueError(f"{name} does not match its SHA-256 (changed since the capture)")
            seq = e["seq"]
            if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
                raise ValueError(f"seq {seq!r} is not a request number")
            if seq in seen:
                raise ValueError(f"seq {seq} repeats an earlier request's")
            seen.add(seq)
            out.append(StoredRequest(seq, _offset(e["t"]), _method(e["method"]), _target(e["target"]),
                                     _headers(e["headers"]), body, bool(e.get("in_flight")), e))
        except FileNotFoundError as exc:
            raise BundleError(f"{index}: request {n + 1}: its body is missing ({exc.filename})") from None
        except (KeyError, TypeError, ValueError, OSError) as exc:
            raise BundleError(f"{index}: request {n + 1}: {_why(exc)}") from None
    if not out:
        raise BundleError(f"{index}: no requests recorded")
    return out


def _read_own(path: Path, limit: int) -> bytes:
    """A file of the bundle's own: a regular file, not through a link, at most ``limit`` bytes
    (a FIFO would block the read for ever, ``/dev/zero`` never end it)."""
    try:
        fd, st = storage.open_regular_fd(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path.name} is a link (a bundle's requests are its own files)") from None
        raise
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > limit or len(data := fh.read(limit + 1)) > limit:
            raise ValueError(f"{path.name} is larger than {limit} bytes")
    return data


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if isinstance(exc, KeyError):
        return f"no {exc}"
    return str(exc)


MAX_OFFSET = 366 * 86400.0  # seconds after the first request: the recorder keeps at most 365 days
# RFC 9110's token (a method, a header's name); a target in origin form: printable ASCII, and
# the bytes above 0x7f a lenient parser lets through (the door keeps them decoded as Latin-1).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_ORIGIN_FORM = re.compile(r"/[!-~\x80-\xff]*")


def _offset(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_OFFSET:
        raise ValueError(f"t {value!r} is not seconds after the first request (0 to {MAX_OFFSET:g})")
    return float(value)


def _method(value: Any) -> str:
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise ValueError(f"method {value!r:.80} is not an HTTP method")
    return value


def _target(value: Any) -> str:
    """A path and query, as the door received them: anything else (``@host/...``, a full URL)
    would send the request past the replay's door, to another host."""
    if not isinstance(value, str) or not _ORIGIN_FORM.fullmatch(value):
        raise ValueError(f"target {value!r:.80} is not a path such as /v1/chat/completions")
    return value


def _headers(value: Any) -> tuple[tuple[str, str], ...]:
    out = []
    for pair in value:
        k, v = pair
        if not isinstance(k, str) or not _TOKEN.fullmatch(k):
            raise ValueError(f"header name {k!r:.80} is not an HTTP header name")
        if not isinstance(v, str) or any(c in v for c in "\r\n\0") or max(map(ord, v), default=0) > 0xFF:
            raise ValueError(f"header {k} has a value an HTTP request cannot carry ({v!r:.80})")
        out.append((k, v))
    return tuple(out)


def from_shim(pid: int, create_time: float | None, until: float) -> tuple[tuple[RecordedRequest, ...] | None, str]:
    """The requests the launch shim in ``pid`` recorded (``mlxwatch launch --record``), arrived
    by ``until`` (monotonic: the capture's start, so its own probe is not among them), within
    the recorder's bounds now. (None, why) when that process records none; else the requests
    and what could not be read ("" when all could). Blocking: reads the spool's files."""
    hb, _ = heartbeat.find(pid, create_time)
    if hb is None:  # why not is the heartbeat step's to say
        return None, "no launch shim in this process"
    rec = hb.record
    if rec is None:
        return None, "the launch shim does not record requests (mlxwatch launch --record)"
    try:
        max_age, max_bytes = float(rec["max_age"]), int(rec["max_bytes"])
    except (KeyError, TypeError, ValueError):
        return None, f"the heartbeat's record section is unreadable: {rec!r:.200}"
    records, problems = spool.read(hb.directory, pid, now_mono=time.monotonic(), max_age=max_age,
                                   max_bytes=max_bytes, until=until)
    live = {str(e.get("id")): e for e in rec.get("in_flight") or [] if isinstance(e, dict)}
    out = []
    for record in records:
        try:
            out.append(_from_spool(record, live.get(str(record["id"]))))
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(f"request {record.get('id')!r}: {type(exc).__name__}: {exc}")
    if rec.get("state") == "failed":
        problems.append(f"the shim's recorder stopped: {rec.get('detail')}")
    return tuple(out), "; ".join(problems)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _from_spool(r: dict[str, Any], live: dict[str, Any] | None) -> RecordedRequest:
    """One spool record as the door's recorder would have held it."""
    body = r["body"]
    described = describe_body(body)
    max_tokens = described.get("max_tokens")
    req = RecordedRequest(
        int(r["seq"]), str(r["id"]), float(r["wall"]), float(r["mono"]), str(r["conn"]), str(r["method"]),
        str(r["target"]), described.get("stream") is True, max_tokens if isinstance(max_tokens, int) else None,
        tuple((str(k), str(v)) for k, v in r["headers"]), tuple(str(k) for k in r.get("dropped") or ()), body)
    end = r.get("end") if isinstance(r.get("end"), dict) else None
    if end is not None:
        status = end.get("status")
        return _replace(req, status=status if isinstance(status, int) else None, first_token_mono=_num(end.get("first")),
                        last_token_mono=_num(end.get("last")), tokens=int(end.get("tokens") or 0),
                        finish_reason=end.get("finish") if isinstance(end.get("finish"), str) else None,
                        outcome=str(end.get("outcome") or "ok"), client_gone=end.get("gone") is True,
                        ended_mono=_num(end.get("ended")))
    if live is not None:  # in flight: what it had had by the last heartbeat
        status = live.get("status")
        return _replace(req, status=status if isinstance(status, int) else None, first_token_mono=_num(live.get("first")),
                        last_token_mono=_num(live.get("last")), tokens=int(live.get("tokens") or 0))
    return req


def write_requests(writer: Any, recorded: Sequence[RecordedRequest]) -> None:
    """Write the bodies as they were received (blocking): ``writer`` is the bundle's
    ``BundleWriter``, whose files are 0600. The index goes through the bundle's redaction with
    every other file (the caller's); the bodies do not: a replay needs the exact bytes."""
    for r in recorded:
        writer.write(body_file(r.seq), r.body)
