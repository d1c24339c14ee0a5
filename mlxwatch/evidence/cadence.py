"""The server's own pace, learned: how long this server may stay silent before its silence means
something (``Cadence.judge``), from what it owes its clients right now.

A fixed quiet window restarts a big model reading a long prompt. mlx-lm reads a prompt in chunks
of ``--prefill-step-size`` tokens (2,048 by default) and writes nothing to anyone between two
chunks: about 25 s a chunk for a 70B dense model on a Max chip, up to a minute for the largest
models (docs/deciding.md#patience). The server shows its own speed, so the patience is learned
per server, and kept across daemon restarts (``Speed.to_dict``):

- **a chunk's time**: the log's ``Prompt processing progress: X/Y`` lines, two chunks of one
  prompt apart (the real thing), and the spacing of ``: keepalive`` writes on client streams;
- **the reading speed, as a hint**: the least time to first token per prompt token of the
  healthy probes lately. A probe's prompt is small, so on a real Mac its per-token time errs slow
  (the weights are read once a step whatever the step's size); it is doubled, and stands only
  until a chunk was seen;
- **a decode step**: the gaps between a healthy probe's tokens;
- **the command line**: ``--prefill-step-size`` and ``--max-tokens``.

Each is smoothed as TCP smooths round trips (Jacobson/Karels, RFC 6298): a mean and a mean
deviation, and the bound is the mean plus four deviations, never less than 1.5 means (reading
slows as the context grows). Before anything is learned the prior is a minute a chunk (the
largest models' pace), so a new daemon errs patient, never hasty.

What the server owes decides which pace applies (``judge``), never longer than ``grace_ceiling``:

- **a prompt being read** (announced ``X/Y`` with X < Y, or a request that got nothing yet and
  arrived after the last sign): the next sign (a chunk logged, a keepalive, a token) is due
  within one chunk's bound of the last one; prompts the last batch step read together (the
  log's ``together``) are read a chunk each in the next, so their next line is due after all
  those tokens (the log times a chunk by every prompt's tokens read meanwhile). Where no sign
  can show between chunks (no log followed, a non-streamed request), the whole prompt's
  reading is allowed from its arrival. Reading that runs late while the server computes (its
  process's CPU, or on a Mac the GPU: ``mlxwatch.evidence.gpu``) gets as long again, at most a
  chunk, no more: a livelock computes too;
- **a non-streamed answer** (a request that got nothing, no stream): sent whole at its end, so
  its silence is hidden work until its prompt's reading plus, while the server computes,
  ``--max-tokens`` decode steps (a few steps while it idles: a blocked server takes nothing up);
- **streams decoding, or nothing**: ``probe.quiet_window`` (or a few decode steps, if longer): an
  idle hang stays fast;
- **a prompt that finished reading** (``N/N`` logged) owes its stream a token within a few steps:
  when none reached any client since, the delivery is overdue, and prompt progress of other
  requests no longer holds the verdict (the report's July 17 capture: progress lines went on
  during the livelock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from mlxwatch.config import ProbeConfig

PRIOR_CHUNK = 60.0  # seconds a chunk (whatever its size), before anything is learned: the largest models' pace
DEFAULT_CHUNK_TOKENS = 2048  # mlx-lm's --prefill-step-size default (0.31.3 and 0.32.x)
DEFAULT_MAX_TOKENS = 512  # mlx-lm's --max-tokens default (0.31.3 and 0.32.x)
PROBE_READ_FACTOR = 2.0  # a probe's small prompt hints at the reading speed: doubled, to err slow
PROBE_READ_DRIFT = 1.02  # the least time a probe's token took rises this much a probe it is not met
MIN_BOUND_FACTOR = 1.5  # a bound is never under 1.5 means: reading slows as the context grows
K = 4.0  # deviations in a bound (RFC 6298's K)
STEPS_OWED = 3  # decode steps a stream (or a prompt just read) may wait for its next token
BYTES_PER_TOKEN = 3.0  # a request's bytes over this: a high guess of its prompt tokens (JSON, ~4 chars a token)
MIN_GAP = 0.5  # seconds: gaps shorter than this between two signs are one reading, not a sample
BUSY = 0.10  # of a core (the process) or of the GPU: the server computes
MIN_READ_TOKENS = 4  # a probe that read fewer prompt tokens (the rest cached) tells nothing of the speed


@dataclass
class Estimate:
    """A smoothed duration (Jacobson/Karels: gain 1/8 for the mean, 1/4 for the deviation)."""

    mean: float
    dev: float
    samples: int = 1

    @classmethod
    def first(cls, sample: float) -> "Estimate":
        return cls(sample, sample / 2)  # RFC 6298: RTTVAR = R/2 at the first measurement

    def add(self, sample: float) -> None:
        self.dev = 0.75 * self.dev + 0.25 * abs(self.mean - sample)
        self.mean = 0.875 * self.mean + 0.125 * sample
        self.samples += 1

    def bound(self) -> float:
        return max(self.mean + K * self.dev, MIN_BOUND_FACTOR * self.mean)

    def to_dict(self) -> dict[str, float]:
        return {"mean": round(self.mean, 4), "dev": round(self.dev, 4), "samples": self.samples}

    @classmethod
    def from_dict(cls, data: Any) -> "Estimate | None":
        if not isinstance(data, dict):
            return None
        try:
            mean, dev, n = float(data["mean"]), float(data["dev"]), int(data.get("samples", 1))
        except (KeyError, TypeError, ValueError):
            return None
        if not (0 <= mean < 1e6 and 0 <= dev < 1e6) or n < 1:  # NaN fails both comparisons
            return None
        return cls(mean, dev, n)


def learn(estimate: Estimate | None, sample: float) -> Estimate:
    if estimate is None:
        return Estimate.first(sample)
    estimate.add(sample)
    return estimate


@dataclass
class Speed:
    """What this server showed of its pace: learned, saved in the state file, restored."""

    chunk: Estimate | None = None  # seconds a full chunk takes (log, keepalives)
    probe_read: float | None = None  # seconds a prompt token took in healthy probes, the least lately (a hint)
    step: Estimate | None = None  # seconds a decode step takes (healthy probes' token gaps)
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # --prefill-step-size
    max_tokens: int = DEFAULT_MAX_TOKENS  # --max-tokens

    def chunk_time(self) -> tuple[float, str]:
        """A full chunk's bound in seconds, and what it rests on."""
        if self.chunk is not None:
            return self.chunk.bound(), "learned from its chunks"
        if (hint := self._probe_hint()) is not None:
            return min(MIN_BOUND_FACTOR * hint, max(hint, PRIOR_CHUNK)), "from its probes' first tokens"
        return PRIOR_CHUNK, "the prior (nothing learned yet)"

    def chunk_typical(self) -> float:
        """A chunk's usual time (the estimate's mean), for people; ``chunk_time`` is its bound."""
        if self.chunk is not None:
            return self.chunk.mean
        if (hint := self._probe_hint()) is not None:
            return hint / PROBE_READ_FACTOR  # the probes' own speed, not doubled
        return PRIOR_CHUNK

    def _probe_hint(self) -> float | None:
        """A chunk's time as the probes hint it (doubled: it errs slow), if they have. Its
        bound (``chunk_time``) is 1.5 hints up to the prior, the largest models' pace, and the
        hint itself past it. Both measured: a probe's fixed cost on a loaded host made the lab's
        probes hint 88 s a chunk of a 25 s server, and with 1.5 hints a hang mid-read was called
        132 s after it began; capped at the prior, a server reading 61 s chunks (30 ms a token)
        was called hung 46 s into its second chunk of 47 s, and its stream's answer was lost."""
        if self.probe_read is None:
            return None
        return self.probe_read * self.chunk_tokens * PROBE_READ_FACTOR

    def read_time(self, tokens: float) -> float:
        """The bound for reading ``tokens`` prompt tokens, at this pace."""
        return max(tokens, 1.0) / self.chunk_tokens * self.chunk_time()[0]

    def step_time(self) -> float | None:
        return self.step.bound() if self.step is not None else None

    def to_dict(self) -> dict[str, Any]:
        chunk, basis = self.chunk_time()
        return {"chunk": self.chunk.to_dict() if self.chunk else None,
                "probe_read": None if self.probe_read is None else round(self.probe_read, 6),
                "step": self.step.to_dict() if self.step else None,
                "chunk_tokens": self.chunk_tokens, "max_tokens": self.max_tokens,
                "chunk_bound": round(chunk, 1), "basis": basis}

    @classmethod
    def from_dict(cls, data: Any) -> "Speed":
        """A saved speed; anything unreadable is not learned (the prior stands)."""
        if not isinstance(data, dict):
            return cls()
        read = data.get("probe_read")
        read = float(read) if isinstance(read, (int, float)) and not isinstance(read, bool) and 0 < read < 1e3 else None
        return cls(chunk=Estimate.from_dict(data.get("chunk")), probe_read=read,
                   step=Estimate.from_dict(data.get("step")),
                   chunk_tokens=_positive_int(data.get("chunk_tokens"), DEFAULT_CHUNK_TOKENS),
                   max_tokens=_positive_int(data.get("max_tokens"), DEFAULT_MAX_TOKENS))

    def take_cmdline(self, cmdline: Sequence[str]) -> None:
        """``--prefill-step-size`` and ``--max-tokens`` from the server's command line."""
        self.chunk_tokens = _flag(cmdline, "--prefill-step-size") or DEFAULT_CHUNK_TOKENS
        self.max_tokens = _flag(cmdline, "--max-tokens") or DEFAULT_MAX_TOKENS


@dataclass(frozen=True)
class Owed:
    """A request the kernel sees with nothing delivered to it yet."""

    arrived: float  # monotonic
    request_bytes: int  # what it sent: a hint of its prompt's size (0: unknown)
    streamed: bool  # its head went out (a stream), or nothing did (a non-streamed answer, or queued)


@dataclass(frozen=True)
class Pace:
    """What the server owes now and how long its silence may last: quiet for ``floor`` seconds
    is always allowed, and longer while a sign is not yet ``due``."""

    floor: float  # seconds of quiet always allowed (probe.quiet_window, or a few decode steps)
    owes: str  # what the server is waiting to show, for people: "reading a 3,618-token prompt"
    basis: str  # what the wait rests on: "~25 s a chunk, learned from its chunks"
    due: float | None = None  # monotonic: the next sign is due by then (None: nothing owed beyond the floor)
    hidden: str | None = None  # a non-streamed answer may be in the making: no early end meanwhile
    overdue: str | None = None  # a delivery owed is overdue: progress elsewhere holds no verdict

    def allows(self, now: float, quiet_since: float) -> bool:
        """Is a silence that began at ``quiet_since`` still within this server's pace?"""
        return now - quiet_since < self.floor or (self.due is not None and now < self.due)

    def to_dict(self, now: float, wall: float) -> dict[str, Any]:
        """For the state file and status: ``due`` as a wall time (``now`` monotonic, ``wall`` its wall)."""
        return {"floor": round(self.floor, 1), "owes": self.owes, "basis": self.basis,
                "due": None if self.due is None else round(wall + self.due - now, 1),
                "hidden": self.hidden, "overdue": self.overdue}


@dataclass
class Cadence:
    """One instance's pace: learns from healthy probes and the sources' answers, judges each look."""

    speed: Speed = field(default_factory=Speed)
    quiet_window: float = ProbeConfig.quiet_window  # the least patience (``configure``: the instance's)
    grace_ceiling: float = ProbeConfig.grace_ceiling  # the most
    changed: bool = False  # the speed changed since the watcher last saved it
    owing_since: float | None = None  # monotonic: requests have been owed a first token since (one episode)
    owed_none_since: float | None = None  # ... and none was owed since then
    last_token: float | None = None

    def configure(self, quiet_window: float, grace_ceiling: float) -> None:
        self.quiet_window, self.grace_ceiling = quiet_window, grace_ceiling

    # --- learning

    def probe_done(self, ttft: float | None, gaps: Sequence[float], prompt_tokens: int | None,
                   prompt_bytes: int = 0, cached_tokens: int | None = None) -> None:
        """A healthy probe: its first token's time over the prompt tokens it read (the server's
        count less what its prompt cache held; without a count, a low guess from the prompt's
        bytes, which errs slow), its tokens' gaps. The probe's prompt never changes, so the
        server's cache holds all but a token of it after the first (measured: cached probes
        made a chunk of 25 s look like 5 s, and a verdict came in the middle of a read): a probe
        that read almost nothing is no sample."""
        if prompt_tokens and prompt_tokens > 0:
            tokens = float(prompt_tokens - (cached_tokens or 0))
        else:
            tokens = prompt_bytes / (2 * BYTES_PER_TOKEN)
        if ttft is not None and tokens >= MIN_READ_TOKENS:
            # The least time a token took lately: a probe queued behind other work, or one that
            # paid the server's fixed cost of a step, says nothing of a chunk's reading
            # (measured: their mean made the lab's tiny model read a chunk in ~51 s under load).
            # It drifts up 2 % a probe, so a server that became slower is learned too.
            sample = ttft / tokens
            last = self.speed.probe_read
            self.speed.probe_read = sample if last is None else min(sample, last * PROBE_READ_DRIFT)
            self.changed = True
        steps = [gap for gap in gaps if gap > 0]
        if steps:  # the shortest gap: a step alone (a longer one may hold another prompt's chunk)
            self.speed.step = learn(self.speed.step, min(steps))
            self.changed = True

    def chunk_seen(self, seconds: float) -> None:
        """A full chunk's time, seen between two signs of one prompt's reading."""
        if MIN_GAP <= seconds <= self.grace_ceiling:
            self.speed.chunk = learn(self.speed.chunk, seconds)
            self.changed = True

    def _learn_from(self, detail: dict[str, Any]) -> None:
        for per_token in (detail.get("log") or {}).get("token_seconds", ()):
            self.chunk_seen(per_token * self.speed.chunk_tokens)
        kernel = detail.get("kernel") or {}
        for gap in kernel.get("keepalive_gaps") or ():  # two keepalives on one stream, no token between: a chunk
            if isinstance(gap, (int, float)):
                self.chunk_seen(gap)
        token = kernel.get("last_token")
        if isinstance(token, (int, float)):
            self.last_token = token

    # --- judging

    def judge(self, now: float, last_flow: float | None, detail: dict[str, Any]) -> Pace:
        """The pace at monotonic ``now``, from the sources' details: the log's open prompts
        (``detail["log"]``) and the kernel's requests owed a first token (``detail["kernel"]
        ["owed"]``: ``Owed``'s fields). ``last_flow``: the last sign of any kind."""
        self._learn_from(detail)
        log, kernel = detail.get("log") or {}, detail.get("kernel") or {}
        owed = [o for o in map(_owed, kernel.get("owed") or ()) if o is not None]
        completed = _completions(log)
        anchor = self._owing(now, [o.arrived for o in owed], last_flow)
        chunk, learned = self.speed.chunk_time()
        basis = f"~{_secs(self.speed.chunk_typical())} a chunk, {learned}"
        floor = self.quiet_window
        step = self.speed.step_time()
        if step is not None:
            floor = min(max(floor, STEPS_OWED * step), self.grace_ceiling)
        logged = bool(log.get("followed"))
        last_sign = last_flow if last_flow is not None else float("-inf")
        dues: list[tuple[float, str, float]] = []  # (due, what is owed, the wait it was given)

        # Prompts the log announced and has not finished (X < Y): their next chunk is due.
        # mlx-lm reads a chunk of each of them in one batch step (``together``: those the latest
        # step read), and logs them all at its end: the next line is due after all their tokens.
        open_prompts = sorted((log.get("open") or {}).items())
        read_together = set(log.get("together") or ())
        together = [(y, xa) for y, xa in open_prompts if y in read_together]
        for group in ([together] if together else [[p] for p in open_prompts]):
            tokens = sum(min(self.speed.chunk_tokens, y - x) for y, (x, _) in group)
            y, (x, at) = max(group, key=lambda p: p[1][1])
            what = (f"reading a {y:,}-token prompt ({x:,} read)" if len(group) == 1
                    else f"reading {len(group)} prompts, a chunk of each a step")
            wait = self._wait(self.speed.read_time(tokens))
            dues.append((max(at, last_sign) + wait, what, wait))
        # Streams that got nothing yet. With the log followed, a stream whose prompt the log
        # shows (matched by size: its request's bytes against the prompt's tokens) is announced
        # there: being read (above), or read, and then it owes a token (``_overdue``). The
        # others' reading is owed from the start of the episode (``_owing``) or the last sign
        # since: requests that keep arriving at a hung server must not keep its pace ahead of
        # them (measured: an app streaming every 2 s kept a livelock from any verdict for 4
        # minutes). Nor may their number: a prompt that arrived after a sign was already due
        # adds no time to it (measured: an app's small prompts, a chunk's worth after a minute
        # at a fresh daemon's hinted pace, held a livelock's verdict 84 s).
        reading = [o for o in owed if o.streamed and not (logged and (
            _read_since(o, completed) is not None or any(_matches(o, y) for y, _ in open_prompts)))]
        if reading:
            start = anchor if anchor is not None else min(o.arrived for o in reading)
            origin = max(start, last_sign)
            in_order = sorted(reading, key=lambda o: o.arrived)
            total, taken, due, wait = 0.0, 0, origin, 0.0
            for o in in_order:
                if taken and o.arrived >= due:
                    break
                total += self._tokens(o)
                taken += 1
                wait = self._wait(self.speed.read_time(min(float(self.speed.chunk_tokens), total)))
                due = origin + wait
            what = (f"reading a prompt of ~{int(total):,} tokens" if taken == 1 and in_order[0].request_bytes
                    else f"reading {taken} new prompt(s)")
            dues.append((due, what, wait))
        # Requests that got nothing at all: non-streamed answers, sent whole at their end, or
        # requests the server has not taken up yet (a streamed one gets its head when it is).
        # Their prompts' reading is owed from the start of the episode; the answers' decode
        # steps (--max-tokens of them) only while the server computes: a blocked server idles
        # and takes nothing up, and its waiting requests must not hide that for minutes.
        hidden_reason = None
        hidden = [o for o in owed if not o.streamed]
        busy = _busy(detail)
        if hidden:
            each = step if step is not None else self.speed.read_time(1) * PROBE_READ_FACTOR
            steps = self.speed.max_tokens if busy else STEPS_OWED
            tokens = sum(self._tokens(o) for o in hidden)
            start = anchor if anchor is not None else min(o.arrived for o in hidden)
            end = start + self._wait(self.speed.read_time(tokens) + steps * each)
            if end > now:
                hidden_reason = (f"{len(hidden)} non-streamed answer(s) may be in the making "
                                 f"(up to {_secs(end - now)} more at this server's pace)")
                dues.append((end, f"{len(hidden)} non-streamed answer(s)", end - start))

        live = [(due, what) for due, what, _ in dues if due > now]
        read_wait = max((wait for due, _, wait in dues if due > now), default=0.0)  # what is read now takes
        if not live and dues and busy:
            # Reading that runs late on a server that computes (its process, or on a Mac its GPU):
            # as long again, at most a chunk, no more (a livelock computes too; measured: a whole
            # chunk for the few tokens of an app's small prompts held a livelock's verdict 54 s).
            due, what, wait = max(dues)
            late = due + min(wait, chunk)
            if late > now:
                live = [(late, f"{what}, running late while {busy}")]
                read_wait = min(wait, chunk)
        overdue = self._overdue(now, [o for o in owed if o.streamed], completed, floor, min(read_wait, chunk))
        if live:
            due, what = max(live)
            return Pace(floor, what, basis, due, hidden=hidden_reason, overdue=overdue)
        return Pace(floor, "a token on the open streams" if owed or kernel.get("streams") else "nothing",
                    "probe.quiet_window" if floor == self.quiet_window else "a few decode steps",
                    overdue=overdue)

    def _owing(self, now: float, arrivals: list[float], last_flow: float | None) -> float | None:
        """When the server began to owe the requests it owes now, as one episode: a client that
        gives up and asks again keeps the episode (measured: a client retrying every 2 s kept a
        livelock from any verdict, each retry a new request with its own allowance); a sign of
        work, or a quiet_window with nothing owed, ends it."""
        if not arrivals:
            if self.owed_none_since is None:
                self.owed_none_since = now
            if now - self.owed_none_since >= self.quiet_window:
                self.owing_since = None
            return None
        self.owed_none_since = None
        first = min(arrivals)
        if self.owing_since is None or (last_flow is not None and last_flow > self.owing_since):
            self.owing_since = first
        else:
            self.owing_since = min(self.owing_since, first)
        return self.owing_since

    def _wait(self, seconds: float) -> float:
        return min(seconds, self.grace_ceiling)

    def _tokens(self, o: Owed) -> float:
        return o.request_bytes / BYTES_PER_TOKEN if o.request_bytes else float(self.speed.chunk_tokens)

    def _overdue(self, now: float, streams: list[Owed], completed: list[tuple[float, int]], floor: float,
                 reading: float) -> str | None:
        """A stream's prompt finished reading (``N/N`` logged, matched to the stream by size)
        and no token reached any client since, for longer than a few steps (and, while other
        prompts are read, what their reading takes, at most a chunk: a step follows each chunk):
        the token it owes is overdue. A whole chunk for an app's few small prompts held the
        report's livelock with traffic 48 s (bench.sight_detection, a fresh daemon whose probes
        hinted 24 s a chunk of a tiny model). A prompt matched to no stream (the daemon's own
        probe, a non-streamed request) owes the kernel nothing it could see."""
        done = [at for o in streams if (at := _read_since(o, completed)) is not None]
        if not done:
            return None
        first = min(done)
        if self.last_token is not None and self.last_token >= first:
            return None
        allowed = floor + reading
        if now - first <= allowed:
            return None
        return (f"a streamed prompt finished reading {now - first:.0f}s ago and no token reached any client "
                f"since (allowed {_secs(allowed)})")

def _completions(log: dict[str, Any]) -> list[tuple[float, int]]:
    return [(float(at), int(y)) for at, y in (log.get("completed") or ())
            if isinstance(at, (int, float)) and isinstance(y, int) and y > 0]


def _matches(o: Owed, tokens: int) -> bool:
    """Could the request ``o`` hold a prompt of ``tokens`` tokens? A chat request's JSON holds
    about 4-5 bytes a token (words, the JSON around them; the template's tokens count in the
    prompt, not in the request): 1.5 to 20 is generous either way. Unknown size: no."""
    return o.request_bytes > 0 and 1.5 <= o.request_bytes / tokens <= 20


def _read_since(o: Owed, completed: list[tuple[float, int]]) -> float | None:
    """When the log said the prompt of ``o`` finished reading (after it arrived), if it did."""
    return next((at for at, y in completed if at >= o.arrived and _matches(o, y)), None)


def _owed(item: Any) -> Owed | None:
    """A request owed a first token, from a source's detail (anything else is skipped)."""
    if isinstance(item, Owed):
        return item
    if not isinstance(item, dict) or not isinstance(item.get("arrived"), (int, float)):
        return None
    size = item.get("request_bytes")
    return Owed(float(item["arrived"]), size if isinstance(size, int) and size > 0 else 0, bool(item.get("streamed")))


def _busy(detail: dict[str, Any]) -> str | None:
    """Does the server compute now (its process's CPU, or the GPU on a Mac)? What says so."""
    cpu = (detail.get("kernel") or {}).get("cpu")
    gpu = (detail.get("gpu") or {}).get("busy")
    if isinstance(gpu, (int, float)) and gpu >= BUSY:
        return f"the GPU is {gpu:.0%} busy"
    if isinstance(cpu, (int, float)) and cpu >= BUSY:
        return f"the process uses {cpu:.0%} of a core"
    return None


def _secs(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def _flag(cmdline: Sequence[str], name: str) -> int | None:
    """An integer flag's value (``--name N`` or ``--name=N``), if given and positive."""
    args = list(cmdline)
    for i, arg in enumerate(args):
        value = None
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        if value is not None:
            return _positive_int(value, None)
    return None


def _positive_int(value: Any, default: Any) -> Any:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return default
    return n if 0 < n < 10**9 else default
