"""Which process ``mlxwatch capture`` captures, and with which instance's settings.

A PID given by hand is proven as the daemon proves its server before anything reads it: the
mlx-lm server listening at the URL (or, without one, an mlx-lm server at all). The config
instance whose server it is lends its name, log and probe settings; ``--force`` captures a
process that is not the server, with none of them::

    target = choose_target(config.instances, pid=4242, instance=None, url=None, force=False)
    target.pid, target.url, target.instance, target.problem
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlxwatch.config import InstanceConfig
from mlxwatch.errors import ProcessGoneError, UsageError
from mlxwatch.host.discover import listening_url
from mlxwatch.host.process import ProcessIdentity, ServerLookup, instance_at, lookup_instance, not_the_server

Lookup = Callable[[InstanceConfig], ServerLookup]


@dataclass(frozen=True)
class CaptureTarget:
    """The process to capture and what is known about it (the flags say how it was learnt)."""

    pid: int
    instance: InstanceConfig | None  # whose log and probe settings apply
    url: str | None  # where to probe (None: no probe)
    log: Path | None  # the log the server lookup found (a launchd job's), if any
    matched: str | None = None  # the instance found at the PID's address (not given by name)
    problem: str | None = None  # why the PID is not the server (captured anyway: --force)
    listens_at: bool = False  # ``url`` is the address the PID was found listening on

    @property
    def label(self) -> str | None:
        """The bundle's name prefix: the instance's name, when the PID is its proven server."""
        return self.instance.name if self.instance is not None and not self.problem else None


def choose_target(instances: tuple[InstanceConfig, ...] | list[InstanceConfig], pid: int | None,
                  instance: InstanceConfig | None, url: str | None, force: bool,
                  lookup: Lookup = lookup_instance) -> CaptureTarget:
    """The target for ``capture [PID] [--instance NAME] [--url URL] [--force]``.

    Raises UsageError (neither PID nor instance; a PID that is not the server, without
    ``force``) or ProcessGoneError (no such PID; no server proven for the instance)."""
    if pid is None:
        if instance is None:
            raise UsageError("capture: give the server's PID, or --instance NAME to capture the server of a "
                             "config instance")
        found = lookup(instance)
        if found.identity is None:
            raise ProcessGoneError(f"capture: no mlx-lm server proven for {instance.name} at {instance.url}: "
                                   f"{found.detail} (give its PID to capture another process, with --force)")
        return CaptureTarget(found.identity.pid, instance, url, found.log)
    ident = ProcessIdentity.of(pid)  # a PID that does not exist: one line, exit 1
    inst, found_log, matched = instance, None, None
    if inst is None:  # the config's instance at this PID's address (or --url): its name, log, probe
        inst, found_log = instance_at(instances, ident.pid, url, lookup)
        if inst is not None:
            matched, url = inst.name, url or inst.url
    problem = not_the_server(ident.pid, ident.cmdline, url, inst, lookup)
    if problem and not force:
        raise UsageError(f"capture: {problem}; check the PID{' and the URL' if url else ''}, "
                         "or add --force to capture it anyway")
    if problem and instance is None:  # the instance at that URL is not this process: none of its settings
        inst, found_log = None, None
    listens_at = False
    if url is None and not problem:
        url = listening_url(ident.pid, ident.cmdline)
        listens_at = url is not None
    return CaptureTarget(ident.pid, inst, url, found_log, matched, problem, listens_at)
