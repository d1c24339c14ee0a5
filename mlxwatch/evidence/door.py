"""The front door's ledger as evidence (``instances[].front``): the door sees every token every
one of its clients receives (``mlxwatch.front``); its ``DeliveryView`` is a cheap snapshot, no I/O.

- tokens the door delivered to clients in the window: **delivered** (a busy or slow server is
  never restarted);
- requests in flight and no token delivered to anyone for ``front.stall_timeout``: a **stall**
  (one early probe per episode, the same quiet start); while it holds, a probe's first-token wait
  may end ``front.stall_timeout`` after sending (``cut_after``): waiting longer only delays the
  verdict. While tokens flow, the probe gets its full deadline, so a busy server's probe is not
  called late for waiting its turn;
- during an incident (the gate not open: the door failed every request at the verdict), the door
  is the witness: a probe that got nothing while the door delivered nothing ends at the earlier
  of ``front.stall_timeout`` and its own first-token deadline, and is not waited on for a late
  token (waiting would only hold every client at 503).

The door sees only its own clients, so it never ends a probe's wait on quiet alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from mlxwatch.evidence import Evidence, Seeing, Stall, Window
from mlxwatch.front.delivery import DeliveryView
from mlxwatch.front.door import FrontDoor, Gate


def quiet_start(view: DeliveryView) -> float | None:
    """Since when generation requests have been in flight with no token delivered to anyone
    (monotonic), or None with none in flight: the later of the last token and the oldest
    request's start."""
    # /v1/models is no token source; a request whose client is slow to read waits on its client
    waiting = [r.started_mono for r in view.in_flight if r.generation and r.id not in view.held_by_clients]
    if not waiting:
        return None
    oldest = min(waiting)
    return oldest if view.last_token_mono is None else max(oldest, view.last_token_mono)


def stall_of(view: DeliveryView, now: float, stall_timeout: float) -> Stall | None:
    """Requests in flight and no token delivered to anyone for ``stall_timeout``, or None."""
    quiet_since = quiet_start(view)
    if quiet_since is None or now - quiet_since < stall_timeout:
        return None
    in_flight = sum(r.generation for r in view.in_flight)
    reason = (f"front door: {in_flight} request(s) in flight and no token delivered to anyone "
              f"for {now - quiet_since:.0f}s (front.stall_timeout {stall_timeout:g}s)")
    return Stall(reason, ("door", quiet_since), source="door", since=quiet_since, cut_after=stall_timeout,
                 event="front_stall", journal={"reason": reason, "in_flight": len(view.in_flight)})


@dataclass
class DoorSource:
    door: Callable[[], FrontDoor | None]  # the instance's door, if it has one (a reload may swap it)
    stall_timeout: Callable[[], float]  # front.stall_timeout
    first_token_timeout: Callable[[], float] = lambda: float("inf")  # probe.first_token_timeout
    name: str = "door"
    tokens_seen: int | None = None  # the view's tokens_total at the last look
    seen_door: FrontDoor | None = None
    found: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=1000))  # (at, tokens)

    async def prime(self) -> None:
        return None

    async def look(self, window: Window) -> Evidence:
        door = self.door()
        if door is None:
            return Evidence()
        if door is not self.seen_door:  # a new door: a new baseline
            self.seen_door, self.tokens_seen = door, None
            self.found.clear()
        view, now = door.view(), window.end
        seen, self.tokens_seen = self.tokens_seen, view.tokens_total
        if seen is not None and view.tokens_total > seen:
            self.found.append((now, view.tokens_total - seen))
        tokens = sum(n for at, n in self.found if window.start < at <= now)
        delivered = (f"front door: {tokens} token(s) delivered to clients in the last {now - window.start:.0f}s",) \
            if tokens else ()
        stall = stall_of(view, now, self.stall_timeout())
        witness = door.gate != Gate.OPEN and not tokens
        return Evidence(delivered=delivered, stall=stall, last_flow=view.last_token_mono,
                        cut_after=min(self.stall_timeout(), self.first_token_timeout()) if witness else None)


def build(seeing: Seeing) -> DoorSource:
    """The front door's ledger, while the instance has a door (``instances[].front``)."""
    def door() -> FrontDoor | None:  # read at each look: a reload may add or drop the door
        return seeing.door() if seeing.inst().front is not None else None

    def stall_timeout() -> float:
        front = seeing.inst().front
        return front.stall_timeout if front is not None else 0.0

    return DoorSource(door=door, stall_timeout=stall_timeout,
                      first_token_timeout=lambda: seeing.inst().probe.first_token_timeout)
