"""Look again before acting: the last word before a restart or a signal.

A capture takes seconds, a backoff longer; meanwhile the user, launchd or a script may have
restarted the server already (measured: a ``command`` hook like ``launchctl kickstart -k`` ran
7.7 s after someone else's restart, with the old, dead PID as ``{pid}``, and killed the new
healthy server). So right before each restart the watcher probes once more and proves the
server's identity again, and this module decides::

    decision = decide(verdict_server, answered=report.healthy, now_server=found)
    if decision.recovered:      # it delivered: close the incident, "recovered before restart: ..."
        ...
    elif decision.replaced:     # another server process, not answering: wait for its first delivery
        ...                     # while it may still be loading (startup_left), else act on it
    else:                       # act on decision.act_on: alive and the same process, or None
        ...

Recovery is delivery: a new PID is no proof. Measured on main: a group relaunched while the old
one's orphans held the port had a rank 0 that never listened; it was called "recovered (someone
else restarted it)" after ``startup_timeout``, and then, every ~44 s, a verdict, a bundle and
"recovered before restart" naming the same dead-on-arrival PID, with no restart for ever. A
replacement is waited for while it may still be loading (``startup_left``); one that has had its
``startup_timeout`` and does not answer is a failure this daemon acts on, within the flap guard.

``act_on`` is never a dead process or another one than the verdict was about: a restart hook
gets an empty ``{pid}`` when there is none (documented in docs/deciding.md).

A server that was alive at the verdict and is gone now, with no other one there yet, may be
in the middle of someone else's restart (measured: the hook ran 0.33 s after the old server
exited, with an empty ``{pid}``, while the new one was starting; a ``kickstart -k`` hook would
restart it again). The watcher then looks for a new server for ``settle_time`` before acting.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxwatch.host.process import ProcessIdentity, ServerLookup, is_mlx_server


@dataclass(frozen=True)
class LookAgain:
    """What the last look found: close the incident (``recovered`` says why), or act on ``act_on``."""

    recovered: str | None = None  # "recovered before restart: ..." (None: go on with the restart)
    answered: bool = False  # the probe just made was healthy (``recovered`` is set only then)
    act_on: ProcessIdentity | None = None  # the verdict's server, alive now; None: no process to name
    replaced: ProcessIdentity | None = None  # another server process took its place and does not answer


SETTLE_CAP = 60.0  # the longest wait for someone else's restart to show its new server


def settle_time(suspect_interval: float) -> float:
    """How long to watch for a new server when the verdict's one is gone and none took its place:
    two suspect intervals (a restart by launchd or a script binds within seconds), capped."""
    return min(2 * suspect_interval, SETTLE_CAP)


def gone_unreplaced(verdict_server: ProcessIdentity | None, *, alive: bool,
                    now_server: ProcessIdentity | None) -> bool:
    """The server the verdict was about is gone and no server is there yet: wait before acting."""
    return verdict_server is not None and not alive and now_server is None


def same_process(a: ProcessIdentity | None, b: ProcessIdentity | None) -> bool:
    return a is not None and a.same_process(b)


def decide(verdict_server: ProcessIdentity | None, *, answered: bool, alive: bool,
           now_server: ProcessIdentity | None) -> LookAgain:
    """The decision, from what the look found.

    ``verdict_server``: the process the verdict (or the last failed restart) was about, or None;
    ``answered``: the probe just made was healthy; ``alive``: ``verdict_server`` is still that
    very process (PID and create time); ``now_server``: the instance's server found now (proven,
    or an mlx-lm server for this port still loading), or None."""
    newcomer = now_server if now_server is not None and not same_process(now_server, verdict_server) else None
    if answered:
        who = f"new server PID {newcomer.pid}" if newcomer is not None else (
            f"same server PID {verdict_server.pid}" if verdict_server is not None and alive else "server unproven")
        return LookAgain(recovered=f"recovered before restart: the instance answers again ({who})", answered=True)
    if newcomer is not None:
        return LookAgain(replaced=newcomer)
    return LookAgain(act_on=verdict_server if alive else None)


def startup_left(server: ProcessIdentity, *, wall_now: float, startup_timeout: float) -> float:
    """Seconds ``server`` may still be loading: ``startup_timeout`` from its start (a start later
    than now counts as now). 0: it has had its allowance; not answering is a failure."""
    age = max(0.0, wall_now - server.create_time)
    return max(0.0, startup_timeout - age)


def not_the_server(newcomer: ProcessIdentity, found: ServerLookup) -> bool:
    """A replacement that had its ``startup_timeout`` and still does not listen, while another
    process serves the URL (``found``, looked up again now), and is no mlx-lm server: a PID
    file's wrapper or wrong PID, never to be signalled or named to a hook (measured: the daemon
    sent SIGTERM to a ``sleep`` a pid_file named). With nothing on the port it may be a server
    stuck loading (a relaunched group's rank 0 that could not bind was one): acted on."""
    return bool(found.stranger) and not (newcomer.same_process(found.identity) or is_mlx_server(newcomer.cmdline))


def delivered_after_replacement(newcomer: ProcessIdentity) -> str:
    """The reason a replaced server's incident closes: its first delivery, never its PID alone."""
    return f"recovered before restart: new server PID {newcomer.pid} (someone else restarted it) delivered"
