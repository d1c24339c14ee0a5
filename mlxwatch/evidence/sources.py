"""Every evidence source of one instance, built from one registry (``build``).

A source is one module with a ``build(seeing)`` that returns it, or None where it has nothing to
see here (no kernel sight, not a Mac); adding one is a module and a line in ``REGISTRY``, never
a branch in the watcher. Three sources do more than answer looks, and are held by name: the
failed probes' streams (the watcher hands them over and holds them open), the log (a launchd
job's log may be followed later) and the group (the restart ends a group whole; the watcher
builds it, since it follows the live group through the watcher's own lookup).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from mlxwatch.evidence import Seeing, Source
from mlxwatch.evidence import door, gpu, kernel, log, probes, shim
from mlxwatch.evidence.group import GroupSource
from mlxwatch.evidence.log import LogSource
from mlxwatch.evidence.probes import ProbeStreams

REGISTRY: tuple[ModuleType, ...] = (shim, door, kernel, gpu)  # asked as one with the three below


@dataclass(frozen=True)
class Sources:
    streams: ProbeStreams
    log: LogSource
    group: GroupSource
    others: tuple[Source, ...]

    @property
    def all(self) -> list[Source]:
        return [self.streams, self.log, self.group, *self.others]


def build(seeing: Seeing, group: GroupSource) -> Sources:
    """The instance's sources. ``group``: built by the watcher, which it answers (it follows
    the live group through the watcher's lookup and tells it when rank 0 changed)."""
    found = (module.build(seeing) for module in REGISTRY)
    return Sources(probes.build(seeing), log.build(seeing), group, tuple(s for s in found if s is not None))
