"""``mlxwatch replay BUNDLE``: read the bundle's recorded requests, choose where they go, replay
them (``session``), and capture a bundle of the replay's own when the hang comes back::

    plan = plan_replay(bundle, to=None, launch=True, allow_bundle_url=False)   # ReplayError, BundleError
    report = await run_replay(plan, ReplayOptions(), out_dir)
    report.outcome.hung, report.bundle, report.kind

Exit codes (as ``git bisect run`` reads them): 0 the hang came back, 1 it did not, 2 the replay
could not run.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from mlxwatch.capture import CaptureRequest, capture_bundle, capture_probe_timeouts
from mlxwatch.capture.bundle import load_manifest
from mlxwatch.capture.requests import StoredRequest, describe_body, load_requests
from mlxwatch.config import CaptureConfig, ProbeConfig, url_port
from mlxwatch.errors import ReplayError
from mlxwatch.host.process import lookup_server
from mlxwatch.replay.server import LaunchedServer, launch
from mlxwatch.replay.options import ReplayOptions
from mlxwatch.replay.session import Answer, ReplayOutcome, replay

REPRODUCED, NOT_REPRODUCED, COULD_NOT_RUN = 0, 1, 2


@dataclass(frozen=True)
class Plan:
    """What to replay and where: a URL, or a server to launch from the recorded command line."""

    bundle: Path
    requests: tuple[StoredRequest, ...]
    to: str | None  # a server the user points at
    cmdline: tuple[str, ...]  # the recorded server command line (for launch)
    cwd: str | None
    source_url: str | None  # the URL the bundle came from


@dataclass(frozen=True)
class ReplayReport:
    outcome: ReplayOutcome
    url: str
    launched: bool
    bundle: Path | None = None  # the replay's own bundle, when the hang came back
    kind: str | None = None  # its classification (the hang's shape)
    confidence: str | None = None
    capture_error: str | None = None


def same_server(a: str, b: str) -> bool:
    """Do two URLs name one server: the same port, and the same host or two loopback ones?"""
    try:
        pa, pb = urlsplit(a), urlsplit(b)
        if url_port(a) != url_port(b):
            return False
    except ValueError:
        return False
    ha, hb = (pa.hostname or "").lower(), (pb.hostname or "").lower()
    return ha == hb or (_loopback(ha) and _loopback(hb))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plan_replay(bundle: Path, *, to: str | None, launch: bool, allow_bundle_url: bool,
                subset: Callable[[list[StoredRequest]], list[StoredRequest]] | None = None) -> Plan:
    """Read the bundle and check the destination; BundleError or ReplayError (one line)."""
    manifest = load_manifest(bundle)
    if manifest.get("request_bodies") is False:  # an export's manifest says so
        raise ReplayError(f"{bundle}: exported without the requests' bodies (`bundle export` leaves them out unless "
                          "--with-request-bodies): replay the bundle itself, or an export made with that flag")
    requests = load_requests(bundle)
    target = manifest.get("target")
    target = target if isinstance(target, dict) else {}
    source_url = target.get("url")
    source_url = source_url if isinstance(source_url, str) else None
    cmdline = target.get("cmdline")
    cmdline = cmdline if isinstance(cmdline, list) else []
    if launch and cmdline and not all(isinstance(a, str) and a and "\0" not in a for a in cmdline):
        raise ReplayError(f"{bundle}: the recorded server command line (manifest target.cmdline) is not one: "
                          f"{cmdline!r:.200}; give --to URL instead of --launch")
    if to is not None and not allow_bundle_url:
        if source_url and same_server(to, source_url):
            raise ReplayError(f"--to {to} is the server this bundle came from ({source_url}): a replay may hang it "
                              "again; pass --allow-bundle-url if that is what you want")
        door = next((h for h in _hosts(requests) if same_server(to, f"http://{h}")), None)
        if door is not None:
            raise ReplayError(f"--to {to} is where this bundle's clients reached the server (their Host: {door}, "
                              "its front door): a replay may hang that server again; pass --allow-bundle-url if "
                              "that is what you want")
    if launch and not cmdline:
        raise ReplayError(f"{bundle}: the bundle records no server command line (manifest target.cmdline); "
                          "give --to URL instead of --launch")
    return Plan(bundle, tuple(subset(requests) if subset else requests), to, tuple(str(a) for a in cmdline),
                _cwd(bundle), source_url)


def _hosts(requests: list[StoredRequest]) -> set[str]:
    """Where the recorded clients sent their requests (their ``Host``): the server's front door
    (the manifest names only the server's own URL), or the server itself."""
    return {v.strip() for r in requests for k, v in r.headers if k.lower() == "host" and v.strip()}


def _cwd(bundle: Path) -> str | None:
    try:
        info = json.loads((bundle / "process.json").read_text())
    except (OSError, ValueError):
        return None
    cwd = info.get("cwd") if isinstance(info, dict) else None
    return cwd if isinstance(cwd, str) else None


async def start_server(plan: Plan, startup_timeout: float) -> LaunchedServer:
    """The recorded server, started and ready; cancelled (Ctrl-C), it is stopped before this
    returns (the wait runs in a thread: told to give up, or it would wait out the start and
    leave the server running)."""
    cancel = threading.Event()
    waiting = asyncio.ensure_future(asyncio.to_thread(launch, list(plan.cmdline), cwd=plan.cwd,
                                                      startup_timeout=startup_timeout, cancel=cancel))
    try:
        return await asyncio.shield(waiting)
    except asyncio.CancelledError:
        cancel.set()
        try:
            server = await waiting  # LaunchCancelled: stopped; or ready just before: stop it here
        except BaseException:  # cancelled either way: what matters is the server's end
            raise asyncio.CancelledError() from None
        await asyncio.to_thread(server.stop)
        raise


async def run_replay(plan: Plan, opts: ReplayOptions, out_dir: Path, *, startup_timeout: float,
                     capture: bool = True, on_round: Callable[[int], None] | None = None,
                     requests: tuple[StoredRequest, ...] | None = None, served: bool = True) -> ReplayReport:
    """Replay ``plan`` (or ``requests`` of it) once, on its URL or a server launched for it
    (stopped after), and capture a bundle when the hang came back. ``served``: a server that
    answered every request with an error (and no hang) tested nothing: ReplayError, not "not
    reproduced" (``--shrink``'s trials pass False: a shrunk body may be refused, and is a no)."""
    server = None if plan.to is not None else await start_server(plan, startup_timeout)
    url = plan.to if plan.to is not None else server.url  # type: ignore[union-attr]
    try:
        outcome = await replay(requests if requests is not None else plan.requests, url, opts, on_round=on_round)
        if outcome.unreachable:
            raise ReplayError(outcome.unreachable)
        if served and not outcome.hung and outcome.answers and all(_refused(a) for a in outcome.answers):
            codes = Counter(str(a.status or a.error or "no answer")[:80] for a in outcome.answers)
            raise ReplayError(f"the server at {url} served none of the {len(outcome.answers)} request(s) ("
                              + ", ".join(f"{c} x{n}" for c, n in codes.most_common(3))
                              + "): the replay tested nothing; is it the recorded model and API (or did its generation "
                              "thread die at once: mlx-lm 0.32 answers 404 then)?")
        if not outcome.hung or not capture:
            return ReplayReport(outcome, url, server is not None)
        pid = server.pid if server is not None else await asyncio.to_thread(_pid_at, url)
        try:
            bundle = await capture_bundle(CaptureRequest(
                pid=pid, out_dir=out_dir, label="replay", url=url, verdict=f"replay of {plan.bundle.name}: "
                f"{outcome.reason}", recorded=outcome.recorded, recorded_at=outcome.recorded_at,
                log=server.log_path if server is not None else None, snapshots=CaptureConfig.snapshots,
                **capture_probe_timeouts(ProbeConfig(first_token_timeout=opts.stall_timeout))))
        except Exception as exc:  # the hang came back either way: said, exit 0
            return ReplayReport(outcome, url, server is not None, capture_error=f"{type(exc).__name__}: {exc}")
        if bundle.lingering is not None:
            bundle.lingering.cancel()
        c = bundle.classification
        return ReplayReport(outcome, url, server is not None, bundle.path, c.kind, c.confidence)
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)


def _refused(answer: Answer) -> bool:
    """An error for an answer: a status of 400 or more, or none (the connection failed)."""
    return answer.status is None or answer.status >= 400


def _pid_at(url: str) -> int | None:
    found = lookup_server(url).identity
    return found.pid if found is not None else None


def exit_code(report: ReplayReport) -> int:
    return REPRODUCED if report.outcome.hung else NOT_REPRODUCED


def describe(req: StoredRequest) -> dict[str, Any]:
    """A request for people: when, where, and what it asks (without its words)."""
    return {"seq": req.seq, "t": req.t, "method": req.method, "target": req.target, **describe_body(req.body)}
