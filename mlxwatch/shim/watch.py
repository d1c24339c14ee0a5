"""The daemon's reading of the launch shim's heartbeat: signals for the existing policy.

A server started with ``mlxwatch launch`` counts deliveries from inside (``mlxwatch.shim``);
the watcher reads that heartbeat by the proven server's PID (no config needed) and turns it
into what ``policy.Detection`` already understands:

- **stall** (suspect at once, probe now; the probe that confirms it is decisive): requests in
  flight and neither a token nor prompt progress for ``probe.stall_timeout``; or no heartbeat
  for ``stall_timeout`` (a native call holds the GIL, or the process is stopped); or the
  generation thread died. A livelock is then found within ``stall_timeout`` plus one probe,
  without waiting out first-token timeouts ``failures`` times. One stall episode triggers one
  early probe (a stall that a good probe contradicts is not chased every poll);
- **delivered** (the server works: ``slow``, never a verdict): tokens delivered to other
  clients since the previous reading (the probe's own tokens subtracted);
- **busy** (holds the verdict like prompt progress does, up to ``grace_ceiling``): a long
  prompt being processed (more than ``PROMPT_ALLOWANCE`` prompt tokens);
- **evidence** (logged, journaled with the stall): steps taken with no token (livelock), no
  step with requests in flight (blocked), a stale heartbeat, a dead thread.

``instances[].shim``: ``auto`` uses the heartbeat when the server has one; ``required`` also
says, once per server process, when it has none; ``off`` never reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxwatch.config import InstanceConfig, ProbeConfig
from mlxwatch.shim.heartbeat import Change, Heartbeat

POLL = 2.0  # seconds between heartbeat reads while the watcher waits for its next probe
RECHECK_ABSENT = 600.0  # a server found without a heartbeat is looked at again this often, not per probe
PROMPT_ALLOWANCE = 512  # prompt tokens per reading a probe's own prompt could not account for


@dataclass
class Judgement:
    stall: str | None = None  # why to suspect now (None: no reason)
    stall_key: Any = None  # identifies the stall episode (one early probe per episode)
    delivered: list[str] = field(default_factory=list)  # tokens to other clients: proof the server works
    busy: list[str] = field(default_factory=list)  # work without delivery: grace
    evidence: list[str] = field(default_factory=list)


@dataclass
class ShimWatch:
    mode: str = InstanceConfig.shim  # auto | required | off
    stall_timeout: float = ProbeConfig.stall_timeout
    pid: int | None = None  # the process the readings belong to
    last: Heartbeat | None = None
    present: bool = False  # the last reading found a heartbeat for this process
    triggered: set = field(default_factory=set)  # stall episodes that already had their early probe
    absent_until: float = 0.0  # this process had no heartbeat: do not look again before then

    def reset_for(self, pid: int | None) -> None:
        if pid != self.pid:
            self.pid, self.last, self.present, self.triggered, self.absent_until = pid, None, False, set(), 0.0

    def should_read(self, now: float) -> bool:
        """A process has or lacks the shim from its start: one that lacked it is not read again
        before ``RECHECK_ABSENT`` (a healthy probe cycle costs no file read for it)."""
        return now >= self.absent_until

    def absent(self, now: float) -> None:
        self.absent_until = now + RECHECK_ABSENT

    def judge(self, hb: Heartbeat | None, probe_tokens: int = 0) -> Judgement:
        """What this reading means; remembers it for the next one."""
        j = Judgement()
        self.present = hb is not None
        if hb is None:
            return j
        last, self.last = self.last, hb
        if hb.thread_died:
            exc = hb.thread_exception
            what = f"{exc.get('type')}: {exc.get('message')}" if exc else "no exception recorded"
            j.stall, j.stall_key = f"shim: the generation thread died ({what})", ("died", hb.pid)
            j.evidence.append(j.stall)
            return j
        if hb.stale:
            line = f"shim: no heartbeat for {hb.age:.0f}s (a native call holds the GIL, or the process is stopped)"
            j.evidence.append(line)
            if hb.age >= self.stall_timeout:
                j.stall, j.stall_key = line, ("stale", hb.published_at)
            return j
        if not hb.seam_ok:
            return j  # heartbeat unavailable (seam missing or changed): stacks only
        change = Change.between(last, hb) if last is not None and last.pid == hb.pid else None
        if change is not None:
            others = change.tokens - max(0, probe_tokens)
            if others > 0:
                j.delivered.append(f"shim: {others} token(s) delivered to other clients in the last {change.seconds:.0f}s")
            if change.prompt_tokens > PROMPT_ALLOWANCE:
                j.busy.append(f"shim: {change.prompt_tokens} prompt token(s) processed in the last {change.seconds:.0f}s")
            if hb.in_flight and not j.busy and not j.delivered:
                if change.steps > 0 and change.tokens == 0:
                    j.evidence.append(f"shim: {change.steps} batch step(s) in {change.seconds:.0f}s and no token "
                                      f"({hb.in_flight} request(s) in flight): livelock")
                elif change.steps == 0 and hb.in_step_for is not None:
                    j.evidence.append(f"shim: inside one BatchGenerator.next call for {hb.in_step_for:.0f}s "
                                      f"({hb.in_flight} request(s) in flight): blocked")
        if hb.in_flight and hb.stalled_for >= self.stall_timeout:
            j.stall = (f"shim: {hb.in_flight} request(s) in flight and no token for {hb.stalled_for:.0f}s "
                       f"(stall_timeout {self.stall_timeout:g}s)")
            j.stall_key = ("quiet", hb.loop.get("quiet_since"))
        return j

    def first_time(self, j: Judgement) -> bool:
        """True once per stall episode: whether this stall should wake the watcher."""
        if j.stall is None or j.stall_key in self.triggered:
            return False
        self.triggered.add(j.stall_key)
        if len(self.triggered) > 100:
            self.triggered = {j.stall_key}
        return True
