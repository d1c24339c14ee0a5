"""Classify a hang from the evidence in a bundle, never from how it was caused.

The kinds, and the evidence that leads to each (first match wins, ambiguity is reported)::

    crashed      the process is gone
    port_taken   the process is gone and another program (not mlx-lm) holds its port: the
                 watchdog's lookup named it; never "crashed": the server may never have run
    healthy      the probe got tokens
    wedged       the probe failed and /health and /v1/models did not answer either
    dead_thread  no generation thread in the stacks, its traceback in the log, or /health 503
    busy         no token, but prompt processing advanced in the window (another prompt's
                 ``Prompt processing progress: X/Y`` X grew, or the probe's own keepalives moved)
    blocked      generation thread present and not stepping: the launch shim saw no step with
                 requests in flight, or its stack is parked in a wait (threading, queue, socket),
                 or it is stuck in one call while the process computes nothing
    collective_wait  a rank of an mlx.launch group waits in a collective (``_share_object``'s
                 ``all_sum``, a sharded layer) for a rank that is not in it: stopped, gone, no
                 generation thread, or its generation thread elsewhere; or rank 0 that left a
                 non-batched generation the others are still in (a distributed cancel).
                 ``culprit_rank`` names it.
                 Rank 0 alone looks like a livelock (it spins in the collective): every rank's
                 state and stacks decide, so this is checked before any single-process kind.
    livelock     generation thread present and stepping while no token was delivered: the shim
                 counted steps without tokens, or its stack moved between snapshots, or it sat in
                 one call while the process computed
    unknown      the evidence does not decide; the competing lines say why

Where the launch shim's heartbeat speaks, it decides. From outside, the stacks decide where they
can (moving = stepping, parked in a wait = blocked) and the process CPU only where they cannot
(one compute call in every snapshot). Load on the machine only *lowers* a spinning server's CPU
share and never raises a blocked one's, so the line between "computes" and "computes nothing" is
the idle mark; below the busy mark the confidence drops a step instead of the verdict turning
``unknown`` (measured: a livelock at 19% of a core under load). Each clue is stated once, in
``evidence`` when it supports the kind and in ``competing`` when it argues against it.

CPU alone never makes a server healthy or busy: a livelock burns CPU and delivers nothing.
Neither do admissions: mlx-lm logs ``POST /v1/chat/completions ... 200`` when it *admits* a
request, not when it answers it, so a livelocked server that keeps admitting a retrying client
looks busy by that count. Admissions are reported as an informational line only.

When the watchdog filed a verdict (``Evidence.verdict``) and the evidence says ``busy`` or
``healthy``, the classification says so: ``contradicts_verdict`` is set, a competing line names
the verdict and what the capture saw, and the confidence drops one step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlxwatch.serverlog.markers import LogMarkers
from mlxwatch.shim.stacks import ShimFindings
from mlxwatch.stacks import ThreadStack, generation_thread

IDLE_CPU = 5.0  # percent of one core: below this the process computes nothing
BUSY_CPU = 20.0  # at or above this "computing" needs no other support; between the two, a step less confidence
IDLE_FUNCTIONS = ("_next_request", "get_next_request")  # an idle server waits here for requests
# The innermost Python frame in one of these files: the thread waits on a lock, event, queue or
# socket (the lab's block fault: Condition.wait in threading.py), not on a computation.
WAIT_FILES = ("threading.py", "queue.py", "selectors.py", "socket.py")

KINDS = ("collective_wait", "dead_thread", "blocked", "livelock", "wedged", "crashed", "busy", "healthy", "unknown",
         "port_taken")


# Where a rank's generation thread waits for its peers: mlx-lm's per-pass exchange of the next
# request (ResponseGenerator._share_object, mx.distributed.all_sum) or a sharded layer's sum
# (mlx/nn/layers/distributed.py). The collective itself is native: the innermost Python frame is here.
COLLECTIVE_FUNCTIONS = ("_share_object", "all_sum", "all_gather", "sum_gradients")
COLLECTIVE_FILES = ("distributed.py",)


def in_collective(thread: ThreadStack) -> bool:
    """The thread's innermost Python frames are a collective's (the first three: a wrapper may sit on top)."""
    return any(f.name.rsplit(".", 1)[-1] in COLLECTIVE_FUNCTIONS or Path(f.filename).name in COLLECTIVE_FILES
               for f in thread.frames[:3])


MODEL_STEP_FILES = ("generate.py",)  # mlx-lm's model step; a sharded model sums across ranks inside it
SINGLE_GENERATION = "_serve_single"  # mlx-lm's path for a request it cannot batch (a seed, --kv-bits)


def _in_single(thread: ThreadStack) -> bool:
    return any(f.name.rsplit(".", 1)[-1] == SINGLE_GENERATION and "mlx_lm" in f.filename for f in thread.frames)


def _in_model(thread: ThreadStack) -> bool:
    """Inside the model's evaluation: the model step, or a non-batched generation's own
    evaluation of its tokens (measured: ``_serve_single`` innermost between two steps); not a
    lock, event, queue or socket wait."""
    frames = thread.frames
    if not frames or Path(frames[0].filename).name in WAIT_FILES:
        return False
    return _in_single(thread) or any(Path(f.filename).name in MODEL_STEP_FILES and "mlx_lm" in f.filename
                                     for f in frames[:3])


def waits_for_peers(present: list[ThreadStack]) -> bool:
    """A rank's generation thread (every snapshot that shows it) waits for the other ranks: in a
    collective by name, or idle inside the model's evaluation in every snapshot (measured: rank 0
    of a group whose rank 1 never ran the step sits in ``PromptProcessingBatch.prompt``, idle in
    a native wait; a model step of a lone process computes, it is never idle)."""
    if in_collective(present[-1]):
        return True
    return all(_in_model(g) for g in present) and not any(g.active for g in present)


def _place(thread: ThreadStack) -> str:
    return thread.frames[0].where if thread.frames else "?"


@dataclass
class RankEvidence:
    """One rank of a group as the capture saw it: its state and (but for the target) its stacks."""

    rank: int
    host: str
    pid: int | None
    state: str  # running | stopped | zombie | gone | unknown
    snapshots: list[list[ThreadStack]] = field(default_factory=list)
    target: bool = False  # the captured process (rank 0): its stacks are Evidence.snapshots

    @property
    def where(self) -> str:
        return f"rank {self.rank} ({self.host}" + (f", PID {self.pid})" if self.pid else ")")


@dataclass
class Evidence:
    """What the classifier reads; the collector fills it from the capture steps."""

    process_alive: bool = True
    process_statuses: list[str] = field(default_factory=list)
    snapshots: list[list[ThreadStack]] = field(default_factory=list)
    stacks_error: str | None = None
    native_findings: list[str] = field(default_factory=list)  # macOS sample: each thread's heaviest path
    generation_cpu: float | None = None  # the generation thread, percent of one core
    process_cpu: float | None = None  # the whole process: what decides idle vs computing
    probe_ran: bool = False
    probe_ok: bool = False
    probe_tokens: int = 0
    probe_failure: str | None = None
    probe_keepalive_advanced: bool = False
    health_status: int | None = None
    models_status: int | None = None
    endpoints_answered: bool = True
    log: LogMarkers | None = None
    log_progress_advanced: bool = False  # another prompt's X in "Prompt processing progress: X/Y" grew
    log_progress_now: tuple[int, int] | None = None  # its latest X/Y
    log_admissions: int = 0  # other requests admitted (POST ... 200) during the window: not progress
    delivered_to_clients: list[str] = field(default_factory=list)  # the kernel saw tokens sent to clients
    verdict: str | None = None  # the watchdog's reason for its verdict; None for a manual capture
    shim: ShimFindings | None = None  # the launch shim's heartbeat findings, if any
    ranks: list[RankEvidence] = field(default_factory=list)  # an mlx.launch group's ranks; empty: one server


@dataclass
class Classification:
    kind: str
    confidence: str  # high | medium | low
    evidence: list[str]
    competing: list[str] = field(default_factory=list)
    contradicts_verdict: bool = False  # the watchdog judged the server hung; this evidence disagrees
    culprit_rank: int | None = None  # collective_wait: the rank the others wait for
    cause: str | None = None  # crashed or dead_thread: why it died (capture.death.CAUSES)
    cause_summary: str | None = None  # ... in one line, as the OS recorded it

    def to_dict(self) -> dict:
        return asdict(self)


def classify(ev: Evidence) -> Classification:
    result = _classify(ev)
    if ev.log_admissions > 0 and result.kind not in ("crashed", "port_taken", "healthy"):
        result.evidence.append(
            f"log: {ev.log_admissions} other request(s) admitted during the window (mlx-lm logs "
            "'POST ... 200' on admission, not on answer: informational, not progress)")
    if ev.verdict and result.kind in CONTRADICTING_KINDS:
        result.contradicts_verdict = True
        result.competing.insert(0, f"the watchdog judged this server hung ({ev.verdict}); "
                                   f"the capture saw {result.kind}: {(result.evidence or ['?'])[0]}")
        result.confidence = _LOWER[result.confidence]
    return result


# A Metal command-buffer error (Insufficient Memory, GPU timeout) and mlx's version: mlx < 0.32
# throws it from Metal's completion queue and the process aborts (mlx #3224, #3390); mlx 0.32.0
# (PR #3523) records it on its events and raises it on the waiting thread, mlx-lm's generation thread.
METAL_ABORTS = ("on mlx < 0.32 a Metal command-buffer error aborts the whole process from Metal's completion "
                "queue; mlx >= 0.32.0 (PR #3523) raises it on the generation thread instead")
METAL_RAISES = ("mlx >= 0.32.0 (PR #3523) raises a Metal command-buffer error on the generation thread, "
                "which then dies; mlx < 0.32 aborted the whole process instead")

CONTRADICTING_KINDS = ("busy", "healthy")  # kinds that say "not hung": they contradict a verdict
_LOWER = {"high": "medium", "medium": "low", "low": "low"}
_CONFIDENCE = ("high", "medium", "low")  # indexed by how many steps the clues against took off
MAX_NATIVE_LINES = 6  # sample findings listed as evidence when there are no Python stacks


def _classify(ev: Evidence) -> Classification:
    lines: list[str] = []
    competing: list[str] = []

    if not ev.process_alive:
        lines.append("the server process is gone")
        held = (ev.verdict or "").partition("port ")[2] if "taken by PID" in (ev.verdict or "") else ""
        if held:  # the watchdog found a stranger on the port: gone is our server, not that one
            lines.append(f"port {held} (not the server: never captured or signalled)")
            return Classification("port_taken", "high", lines)  # a crash is not known: it may never have run
        if ev.log and ev.log.insufficient_memory:
            lines.append(f"log: {ev.log.insufficient_memory[-1]} ({METAL_ABORTS})")
        return Classification("crashed", "high", lines)

    if ev.probe_ran and ev.probe_ok:
        lines.append(f"the generation probe got {ev.probe_tokens} token(s)")
        return Classification("healthy", "high", lines)

    waiting = _collective_wait(ev)
    if waiting is not None:
        return waiting

    if "stopped" in ev.process_statuses:
        lines.append("process status is 'stopped' (SIGSTOP or a debugger): it runs nothing")
    if ev.probe_ran and not ev.endpoints_answered:
        lines.append("the probe failed and /health and /v1/models did not answer either: HTTP itself is stuck")
        lines += ev.shim.stale if ev.shim is not None else []
        return Classification("wedged", "high", lines)

    gens = [generation_thread(s) for s in ev.snapshots]
    dead = _dead_thread_signals(ev, gens)
    if dead:
        present = [g for g in gens if g is not None]
        if present:
            competing.append(f"yet a generation thread appears in {len(present)} of {len(gens)} snapshot(s)")
        confidence = "high" if len(dead) >= 2 or (gens and not present and len(gens) >= 2) else "medium"
        if ev.log and ev.log.insufficient_memory:  # said, not counted: the traceback line is the evidence
            dead.append(f"log: {ev.log.insufficient_memory[-1]} ({METAL_RAISES})")
        return Classification("dead_thread", confidence if not competing else "medium", dead, competing)

    if ev.delivered_to_clients:  # whatever the stacks say: a server that delivers works
        lines += ev.delivered_to_clients
        lines.append("tokens reached other clients during the capture: the server works (slowly for the "
                     "probe), it is not hung")
        return Classification("busy", "high", lines)

    progress = _progress_signals(ev)
    if progress:
        lines += progress
        lines.append("no token yet, but work is visibly advancing: not a hang (yet)")
        exact = ev.shim is not None and bool(ev.shim.busy)  # counted inside the server, not inferred
        return Classification("busy", "high" if exact else "medium", lines)

    present = [g for g in gens if g is not None]
    # Process CPU, not the generation thread's own: MLX evaluates on its own worker threads, so
    # a livelocked Python thread mostly waits in mx.eval while the process computes.
    cpu = CpuClue(ev.process_cpu, ev.generation_cpu)
    lines.append("the probe got no token" if ev.probe_ran else "no probe was run (no URL): delivery unknown")

    stack = StackClue.of(present)
    decided = _from_shim(ev, stack, cpu, lines, competing)
    if decided is not None:
        return decided
    if stack is None:
        lines.append(cpu.line())
        competing.append(f"no stacks: {ev.stacks_error or 'py-spy gave none'}")
        # Where py-spy fails (often, on a Mac), sample's native call graph is what a person reads:
        # it names the C/MLX/Metal frames each thread is in; it cannot name the Python frame.
        lines.extend(f"sample: {finding}" for finding in ev.native_findings[:MAX_NATIVE_LINES])
        if not ev.probe_ran or cpu.band is None:  # an idle server, or nothing measured, would look the same
            return Classification("unknown", "low", lines, competing)
        return Classification("blocked" if cpu.band == "idle" else "livelock", "low", lines, competing)

    if not ev.probe_ran and _idle(present[-1]):
        lines += [stack.line(), cpu.line(), "the generation thread is waiting for new requests: an idle server"]
        return Classification("healthy", "low", lines, ["no generation probe confirmed delivery"])
    return _from_outside(ev, stack, cpu, lines, competing)


def _collective_wait(ev: Evidence) -> Classification | None:
    """A rank waits in a collective for a rank that is not in it (see the module docstring).
    None: not a group, no rank waits in a collective, or every rank is in it (nothing to blame)."""
    if len(ev.ranks) < 2:
        return None
    stacks = {r.rank: (ev.snapshots if r.target else r.snapshots) for r in ev.ranks}
    gens = {n: [g for g in map(generation_thread, snaps) if g is not None] for n, snaps in stacks.items()}
    # A stopped rank's stack may show it inside the collective too: it waits for no one, it runs nothing.
    waiters = [r for r in ev.ranks if r.state == "running" and gens[r.rank] and waits_for_peers(gens[r.rank])]
    if not waiters:
        return None
    culprits: list[tuple[RankEvidence, str, str]] = []  # rank, why, confidence
    for r in ev.ranks:
        if r in waiters:
            continue
        if r.state in ("stopped", "gone", "zombie"):
            why = {"stopped": "is stopped (SIGSTOP or a debugger): it runs nothing",
                   "gone": "is gone: its process exited", "zombie": "has exited (a zombie)"}[r.state]
            culprits.append((r, f"{r.where} {why}", "high"))
        elif not stacks[r.rank]:
            continue  # no stacks of it: nothing shows where it is
        elif not gens[r.rank]:
            culprits.append((r, f"{r.where}: no generation thread in any of {len(stacks[r.rank])} stack "
                                "snapshot(s): it died", "high" if len(stacks[r.rank]) >= 2 else "medium"))
        elif not waits_for_peers(gens[r.rank]):
            where = gens[r.rank][-1].frames[0].where if gens[r.rank][-1].frames else "?"
            culprits.append((r, f"{r.where}: its generation thread is elsewhere, not in the collective; "
                                f"innermost: {where}", "high" if len(gens[r.rank]) >= 2 else "medium"))
    first = waiters[0]
    places = {r.rank: _place(gens[r.rank][-1]) for r in waiters}
    if not culprits and len(waiters) == len(ev.ranks) and len({p.split(" (")[0] for p in places.values()}) > 1:
        # Every rank waits, in different collectives: neither completes. Rank 0 takes the requests
        # and the others follow its steps: a rank elsewhere than rank 0 went astray, most likely,
        # unless rank 0 left a non-batched generation the others are still in (a distributed cancel).
        odd = next((r for r in waiters if r is not first and places[r.rank] != places[first.rank]), None)
        left = _left_single(first, waiters, gens)
        stepping = _steps_alone(waiters, gens)
        if left is not None:
            culprits.append(left)
            waiters = [r for r in waiters if r is not first]
        elif stepping is not None:
            culprits.append(stepping)
            waiters = [r for r in waiters if r is not stepping[0]]
        elif odd is not None:
            culprits.append((odd, f"{odd.where} waits in another collective than {first.where} "
                                  f"({places[odd.rank]} against {places[first.rank]}): it skipped or "
                                  "repeated a step, so neither completes", "medium"))
            waiters = [r for r in waiters if r is not odd]
    if not culprits:
        return None
    culprit, _, confidence = culprits[0]
    waiting = ", ".join(f"rank {r.rank}" for r in waiters)
    where = _place(gens[waiters[0].rank][-1])
    lines = [f"{waiting} wait{'s' if len(waiters) == 1 else ''} in a collective for rank {culprit.rank}; "
             f"innermost: {where}", *(why for _, why, _ in culprits)]
    if ev.probe_ran and not ev.probe_ok:
        lines.append("the probe got no token: the group delivers nothing while its ranks are out of step")
    competing = [f"{len(culprits)} ranks are not in the collective: rank {culprit.rank} is named first"] \
        if len(culprits) > 1 else []
    return Classification("collective_wait", confidence, lines, competing, culprit_rank=culprit.rank)


SHARE_FUNCTION = "_share_object"  # mlx-lm's per-pass exchange of the next request, before each step


def _in_share(thread: ThreadStack) -> bool:
    return any(f.name.rsplit(".", 1)[-1] == SHARE_FUNCTION for f in thread.frames[:3])


def _steps_alone(waiters: list[RankEvidence],
                 gens: dict[int, list[ThreadStack]]) -> tuple[RankEvidence, str, str] | None:
    """A rank waits in the per-pass exchange (``_share_object``) while a peer waits inside the
    model step: both passed the exchange before that step together, so the rank in the
    exchange went round its loop without entering the step's collective its peer waits in
    (measured on 0.31.3 and 0.32.2: a livelock on rank 0 alone, rank 0 in ``_share_object``
    and rank 1 in ``PromptProcessingBatch.prompt`` in every snapshot; before this rule the
    bundle blamed rank 1 as a rank that "skipped or repeated a step"). High confidence only
    when the stacks agree: every such rank in one place in at least two snapshots."""
    sharing = [r for r in waiters if _in_share(gens[r.rank][-1])]
    stepping = [r for r in waiters if r not in sharing and _in_model(gens[r.rank][-1])]
    if not sharing or not stepping:
        return None
    culprit = sharing[0]
    agree = all(len(gens[r.rank]) >= 2 and len({g.signature() for g in gens[r.rank]}) == 1
                for r in (*sharing, *stepping))
    others = ", ".join(f"rank {r.rank}" for r in stepping)
    return (culprit, f"{culprit.where} waits in the next pass's exchange ({_place(gens[culprit.rank][-1])}) "
                     f"while {others} {'waits' if len(stepping) == 1 else 'wait'} inside the model step "
                     f"({_place(gens[stepping[0].rank][-1])}): it went round its loop without entering the "
                     "collective of the step", "high" if agree else "medium")


def _left_single(first: RankEvidence, waiters: list[RankEvidence],
                 gens: dict[int, list[ThreadStack]]) -> tuple[RankEvidence, str, str] | None:
    """Rank 0 (``first``) waits for the next request while another rank is still inside a
    non-batched generation: rank 0 left it. mlx-lm does that when the client of such a request
    disconnects in distributed mode (``_serve_single`` raises NotImplementedError on rank 0
    alone; measured on 0.31.3 and 0.32.2): the others go on with the generation's collectives.
    Rank 0 notices the disconnect only at its next token, so an early snapshot may still show
    it in the generation (measured): its latest snapshot decides."""
    mine = gens[first.rank]
    if first.rank != 0 or _in_single(mine[-1]):
        return None
    inside = [r for r in waiters if r is not first and all(_in_single(g) for g in gens[r.rank])]
    if not inside:
        return None
    steady = len(mine) >= 2 and not _in_single(mine[-2]) and all(len(gens[r.rank]) >= 2 for r in inside)
    names = ", ".join(f"rank {r.rank}" for r in inside)
    return (first, f"{first.where} left a non-batched generation ({SINGLE_GENERATION}) that {names} "
                   f"{'is' if len(inside) == 1 else 'are'} still in, and waits for the next request: mlx-lm "
                   "ends such a generation on rank 0 alone when its client disconnects (distributed mode "
                   "raises NotImplementedError there), so the ranks wait in different collectives",
            "high" if steady else "medium")


@dataclass(frozen=True)
class StackClue:
    """The generation thread across the snapshots that show it: did it move, and where is it."""

    snapshots: int
    motion: str  # moving | identical | single
    innermost: str
    waiting: bool  # innermost frame in a lock/event/queue/socket wait

    @classmethod
    def of(cls, present: list[ThreadStack]) -> StackClue | None:
        if not present:
            return None
        motion = ("single" if len(present) == 1
                  else "identical" if len({g.signature() for g in present}) == 1 else "moving")
        frames = present[-1].frames
        waiting = bool(frames) and Path(frames[0].filename).name in WAIT_FILES
        return cls(len(present), motion, frames[0].where if frames else "?", waiting)

    def line(self) -> str:
        if self.motion == "single":
            return (f"generation thread in only one stack snapshot (whether it moves is unknown); "
                    f"innermost: {self.innermost}")
        seen = "identical" if self.motion == "identical" else "changing"
        return f"generation thread stack {seen} across {self.snapshots} snapshot(s); innermost: {self.innermost}"


@dataclass(frozen=True)
class CpuClue:
    process: float | None
    thread: float | None

    @property
    def band(self) -> str | None:
        if self.process is None:
            return None
        return "idle" if self.process < IDLE_CPU else "busy" if self.process >= BUSY_CPU else "middle"

    def line(self) -> str:
        if self.process is None:
            return "CPU use could not be measured"
        thread = f" (generation thread itself: {self.thread:.0f}%)" if self.thread is not None else ""
        return f"process CPU over the window: {self.process:.0f}% of one core{thread}"


def _from_outside(ev: Evidence, stack: StackClue, cpu: CpuClue, lines: list[str],
                  competing: list[str]) -> Classification:
    """Livelock or blocked from stacks and CPU, each clue stated once: a moving stack is a thread
    that steps (livelock), one parked in a wait is blocked, whatever the CPU; only a thread sat in
    one compute call needs the CPU to tell "computing" (livelock) from "stuck in it" (blocked)."""
    lines.append(stack.line())
    if stack.motion == "moving":
        kind = "livelock"
    elif stack.waiting:
        kind = "blocked"
    else:
        kind = "blocked" if cpu.band in ("idle", None) else "livelock"
    steps = 0 if ev.probe_ran else 2  # without a probe, delivery is unknown: low at best
    if stack.motion == "single":  # missing evidence, said in the stack line: a step less confidence
        steps += 1
    band = cpu.band
    if band is None:
        competing.append("CPU use could not be measured")
        steps += 1 if stack.motion == "moving" or stack.waiting else 2
    elif (kind, band) in (("livelock", "busy"), ("blocked", "idle")):
        lines.append(cpu.line())
    elif band == "middle":  # weak: for a livelock it supports, for a block it argues against
        steps += 1
        if kind == "livelock":
            lines.append(f"{cpu.line()}: above idle ({IDLE_CPU:g}%), so it computes; below busy "
                         f"({BUSY_CPU:g}%), as a loaded machine leaves a spinning server")
        else:
            competing.append(f"{cpu.line()}: above idle ({IDLE_CPU:g}%) while the generation thread waits "
                             "(another thread computes?)")
    elif kind == "livelock":  # idle CPU, yet the stack moved
        steps += 2
        competing.append(f"{cpu.line()}: idle, although the stack moved between snapshots")
    else:  # blocked in a wait while the process computes
        steps += 1
        competing.append(f"{cpu.line()}: busy, while the generation thread waits (another thread computes?)")
    return Classification(kind, _CONFIDENCE[min(steps, 2)], lines, competing)


def _dead_thread_signals(ev: Evidence, gens: list[ThreadStack | None]) -> list[str]:
    found = []
    if gens and all(g is None for g in gens):
        found.append(f"no generation thread (_generate) in any of {len(gens)} stack snapshot(s)")
    if ev.log and ev.log.generation_thread_exception:
        died = [line for line in ev.log.generation_thread_died if "generation thread died:" in line]
        for line in dict.fromkeys([(died or ev.log.generation_thread_died or ev.log.thread_exceptions)[-1],
                                   *(ev.log.last_traceback[-1:])]):
            found.append(f"log: {line.strip()}")
    if ev.health_status == 503:
        found.append("/health answered 503 (mlx-lm >= 0.32 says so when its generation thread died)")
    if ev.probe_failure == "thread_died":
        found.append("the server answered the probe with 'generation thread died'")
    if ev.shim is not None:
        found += ev.shim.dead
    return found


def _progress_signals(ev: Evidence) -> list[str]:
    found = []
    if ev.probe_keepalive_advanced:
        found.append("the probe's keepalive progress advanced (prompt processing)")
    if ev.log_progress_advanced:
        now = f" (now {ev.log_progress_now[0]}/{ev.log_progress_now[1]})" if ev.log_progress_now else ""
        found.append(f"log: 'Prompt processing progress' of another prompt advanced during the window{now}")
    if ev.shim is not None:
        found += ev.shim.busy
    return found


def _idle(thread: ThreadStack) -> bool:
    return any(f.name.rsplit(".", 1)[-1] in IDLE_FUNCTIONS for f in thread.frames[:8])


def _from_shim(ev: Evidence, stack: StackClue | None, cpu: CpuClue, lines: list[str],
               competing: list[str]) -> Classification | None:
    """The launch shim's heartbeat decides livelock or blocked from inside the batch loop: steps
    taken with no token emitted is a livelock, no step with requests in flight is a block, and a
    heartbeat that stopped is a native call holding the GIL (or a stopped process). Stacks and
    CPU corroborate (high confidence) or compete (medium), each stated once. None: the shim says
    nothing here."""
    shim = ev.shim
    if shim is None or not (shim.livelock or shim.blocked or shim.stale):
        return None
    stack_line = [stack.line()] if stack is not None else []
    if shim.livelock:
        against = []
        if cpu.band == "idle":
            against.append(f"{cpu.line()}: idle")
        lines += stack_line + ([] if against else [cpu.line()]) + shim.livelock
        return Classification("livelock", "medium" if against else "high", lines, competing + against)
    if shim.blocked:
        against = []
        if cpu.band == "busy":
            against.append(f"{cpu.line()}: busy (one long native computation?)")
        if stack is not None and stack.motion == "moving":
            against.append(stack.line())
            stack_line = []
        lines += stack_line + ([] if cpu.band == "busy" else [cpu.line()]) + shim.blocked
        return Classification("blocked", "medium" if against else "high", lines, competing + against)
    lines += stack_line + [cpu.line()] + shim.stale
    if "stopped" in ev.process_statuses:
        return Classification("wedged", "high", lines, competing)
    return Classification("blocked", "medium", lines, competing)
