"""The daemon's open-files limit, raised at start to what the system allows.

launchd starts agents with a soft limit of 256 open files (systemd: 1024); the daemon's probes,
journal, log follower and each front door's connections (two per request in flight) share it,
so a burst of client connections could leave the probes without a socket, and they would blame
the server. The soft limit is raised to the hard one (capped: macOS refuses more than
``OPEN_MAX``-sized values for an unlimited hard limit)::

    before, after = raise_open_files_limit()
"""

from __future__ import annotations

import resource

WANTED = 10240  # enough for the front door's connection cap with room to spare; macOS's OPEN_MAX


def raise_open_files_limit(wanted: int = WANTED) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE towards ``wanted`` (never above the hard limit, never down);
    (soft before, soft after). A system that refuses leaves the limit as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft
