"""The watchdog daemon: probe every instance, judge by delivery, capture, restart, journal.

Data flows one way: probes -> policy (verdict) -> capture -> restart -> journal/state.
"""

from mlxwatch.watchdog.daemon import Daemon
from mlxwatch.watchdog.journal import Incident, Journal

__all__ = ["Daemon", "Incident", "Journal"]
