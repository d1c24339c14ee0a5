"""The real daemon run in a test until the journal shows what the test waits for::

    journal = await run_daemon_until(config, lambda j: "recovered" in events(j), timeout=300,
                                     after_healthy=lambda: lab.set_fault("spin"))

``after_healthy`` (the fault, the clients) runs once the instance is ``ready``: by default once a
probe succeeded; a group test also waits for the group to be found. The daemon is stopped, and
awaited, whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable

from mlxwatch.config import Config
from mlxwatch.daemon.supervisor import Daemon
from mlxwatch.evidence.cadence import Estimate, Speed
from mlxwatch.journal.incidents import Journal


def probed_ok(instance: dict[str, Any]) -> bool:
    """The instance's state says its last probe succeeded."""
    return bool((instance.get("last_probe") or {}).get("ok"))


async def run_daemon_until(config: Config, done: Callable[[Journal], bool], timeout: float,
                           after_healthy: Callable[[], None] | None = None, overrides: dict | None = None,
                           ready: Callable[[dict[str, Any]], bool] = probed_ok) -> Journal:
    """Run the real daemon on ``config`` until ``done(journal)``, failing the test after
    ``timeout`` s or if the daemon ends first; ``after_healthy()`` once the first instance is
    ``ready`` (its entry in the daemon's state)."""
    stop = asyncio.Event()
    daemon = Daemon(config, config.state_dir, shared_overrides=overrides)
    task = asyncio.create_task(daemon.run(stop))
    journal = Journal(config.state_dir)
    name = config.instances[0].name
    try:
        deadline = time.monotonic() + timeout
        if after_healthy is not None:
            while not hasattr(daemon, "state") or not ready(daemon.state.instance(name)):
                assert time.monotonic() < deadline and not task.done(), f"never ready; {task}"
                await asyncio.sleep(0.1)
            after_healthy()
        while not done(journal):
            assert not task.done(), task
            assert time.monotonic() < deadline, f"timed out; journal: {[r['event'] for r in journal.records()]}"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await task
    return journal


def remember_pace(state: Path, chunk: float, name: str = "x", url: str = "http://127.0.0.1:9") -> None:
    """A state file in which an earlier daemon run learned ``chunk`` seconds a chunk of the
    instance ``name`` at ``url`` (a daemon that knows nothing errs patient: a minute a chunk)."""
    saved = {"url": url, "cadence": Speed(chunk=Estimate(chunk, chunk / 20, 8)).to_dict()}
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"instances": {name: saved}}))
