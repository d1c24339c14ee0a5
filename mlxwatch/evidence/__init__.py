"""One question, asked of every source that can see a server work: between two instants, what
was delivered, what advanced, and how do you know?

The policy (``mlxwatch.verdict.policy``) judges a server by the answers alone; the watcher asks
every source the same way and knows none of their details. A source is one module:

==========  ===================================================  =================================
source      sees                                                 needs
==========  ===================================================  =================================
probes      late tokens on the failed probes' own streams        nothing
log         prompt processing progress (``X/Y`` per prompt)       the server's log
kernel      bytes the server sent on every client connection     sock_diag (Linux), nettop (macOS)
shim        tokens, steps and prompt work counted inside         ``mlxwatch launch``
door        every token through the front door                   ``instances[].front``
==========  ===================================================  =================================

What each answer means to the policy:

- **delivered**: tokens reached a client: the server works. A failed probe with a delivery is
  ``slow``, never a verdict;
- **progress**: work advanced with nothing delivered (a long prompt being read, keepalives):
  holds the verdict up to ``probe.grace_ceiling``, so a livelock that only writes keepalives is
  still called, late;
- **stall**: requests are owed a token and none came for a source's own timeout: suspect at
  once, and the probe that confirms it is decisive (the stall was the first failure);
- **last_flow** / **sees_all**: when the source last saw anything flow, and whether it sees
  every client (the kernel and the shim do; the door sees only its own clients). Only with a
  source that sees every client may the watcher end a probe's wait early because nothing flows
  anywhere (``probe.quiet_window``);
- **hidden_work**: requests in flight that show nothing yet while the server works (a
  non-streaming generation): the early end is withheld;
- **pace**: how long this server's silence may last now, from its own learned speed and what
  it owes (``mlxwatch.evidence.cadence``): a prompt being read may be silent a chunk's time, an
  idle server only ``probe.quiet_window``. ``Sight`` asks the cadence after the sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence

from mlxwatch.config import InstanceConfig
from mlxwatch.evidence.cadence import Pace
from mlxwatch.front.door import FrontDoor
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.host.sockets import KernelCounters
from mlxwatch.probes import CheckReport


@dataclass(frozen=True)
class Stall:
    reason: str  # one line: why the instance is suspect now
    key: Hashable  # the episode: one early probe per episode
    source: str = ""
    since: float | None = None  # monotonic: the quiet's start, if known (a later flow anywhere voids it)
    cut_after: float | None = None  # while it holds, a probe's first-token wait may end this long after sending
    event: str = ""  # the journal event that records it (``mlxwatch.journal.incidents.Event``'s value)
    journal: dict[str, Any] = field(default_factory=dict, compare=False)  # that record's fields


@dataclass(frozen=True)
class Window:
    """What a source is asked about: ``start`` to ``end`` (monotonic), and the failed probe
    judged at ``end`` (None: a look between probes, for a stall)."""

    start: float
    end: float
    probe: CheckReport | None = None
    suspect: bool = False  # a probe waits, or the instance is suspect: sources read at their quick rate


@dataclass(frozen=True)
class Evidence:
    """One source's answer (or all sources' answers combined, ``combine``)."""

    delivered: tuple[str, ...] = ()
    progress: tuple[str, ...] = ()
    stall: Stall | None = None
    notes: tuple[str, ...] = ()  # conditions worth one log line each (said once)
    seen: tuple[str, ...] = ()  # what the source saw, for the log and journal (no weight)
    last_flow: float | None = None  # monotonic: the last time anything flowed (bytes, tokens, progress)
    sees_all: bool = False  # ... and the source sees every client's delivery
    hidden_work: str | None = None  # requests in flight show nothing yet while the server works
    cut_after: float | None = None  # a probe's first-token wait may end this long after sending
    detail: dict[str, Any] = field(default_factory=dict, compare=False)  # per source, for bundles and status
    pace: Pace | None = None  # the server's own pace (the cadence's judgement; None: quiet_window alone)

    def quiet_for(self, now: float, since: float) -> float | None:
        """How long nothing has flowed anywhere, counted from ``since`` at the earliest; None
        when no source sees every client, or work may be hidden."""
        if not self.sees_all or self.hidden_work:
            return None
        last = since if self.last_flow is None else max(self.last_flow, since)
        return max(0.0, now - last)

    def silent_past_pace(self, now: float, since: float, quiet_window: float) -> float | None:
        """How long nothing has flowed anywhere (from ``since`` at the earliest), when that is
        past this server's pace (``pace``; without one, ``quiet_window``); else None."""
        quiet = self.quiet_for(now, since)
        if quiet is None:
            return None
        if self.pace is not None:
            return None if self.pace.allows(now, now - quiet) else quiet
        return quiet if quiet >= quiet_window else None


def combine(answers: Sequence[Evidence]) -> Evidence:
    """All sources' answers as one: every line kept, the first stall, the latest flow."""
    flows = [a.last_flow for a in answers if a.last_flow is not None]
    cuts = [c for a in answers for c in (a.cut_after, a.stall.cut_after if a.stall else None) if c is not None]
    detail: dict[str, Any] = {}
    for a in answers:
        detail.update(a.detail)
    return Evidence(
        delivered=tuple(x for a in answers for x in a.delivered),
        progress=tuple(x for a in answers for x in a.progress),
        stall=next((a.stall for a in answers if a.stall is not None), None),
        notes=tuple(x for a in answers for x in a.notes),
        seen=tuple(x for a in answers for x in a.seen),
        last_flow=max(flows) if flows else None,
        sees_all=any(a.sees_all for a in answers),
        hidden_work=next((a.hidden_work for a in answers if a.hidden_work), None),
        cut_after=min(cuts) if cuts else None,
        detail=detail,
    )


@dataclass(frozen=True)
class Seeing:
    """What one instance's sources may look at, each read when used (a reload changes the
    instance's settings, a restart its server, the daemon swaps its front door): every source
    module's ``build`` takes this alone (``mlxwatch.evidence.sources``)."""

    inst: Callable[[], InstanceConfig]
    identity: Callable[[], ProcessIdentity | None]  # the proven server, if any
    door: Callable[[], FrontDoor | None]  # the instance's front door, if it has one
    kernel: KernelCounters | None  # kernel sight, one for the daemon (None: off)
    clock: Callable[[], float]  # monotonic

    def server_pid(self) -> int | None:
        ident = self.identity()
        return ident.pid if ident is not None else None


class Source(Protocol):
    """An evidence source: one module, one way of seeing a server work."""

    name: str

    async def look(self, window: Window) -> Evidence:
        """What this source saw in ``window``; never raises for the server's or the host's
        state (what it cannot see is a note)."""
        ...

    async def prime(self) -> None:
        """A judgement starts (the instance was healthy until now): what the source has not
        read yet is history, not evidence."""
        ...
