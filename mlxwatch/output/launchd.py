"""``mlxwatch launchd install`` and ``uninstall``: what was done, and the commands that follow;
``mlxwatch launch``'s warnings::

    render_installed(launchd.install(config, label), label, console)
"""

from __future__ import annotations

from rich.console import Console

from mlxwatch.daemon.agent import Installed, Uninstalled


def render_installed(done: Installed, label: str, console: Console) -> None:
    target = f"{done.domain}/{label}"
    replaced = " (the loaded one was replaced)" if done.replaced_loaded else ""
    console.print(f"installed {label} in {done.domain}: {done.plist}{replaced}", markup=False)
    console.print(f"  runs      {' '.join(done.argv)}", markup=False)
    console.print(f"  log       {done.log}", markup=False)
    console.print(f"  reload    launchctl kill SIGHUP {target}", markup=False)
    console.print(f"  restart   launchctl kickstart -k {target}", markup=False)
    console.print(f"  remove    mlxwatch launchd uninstall --label {label}", markup=False)


def render_uninstalled(gone: Uninstalled, label: str, console: Console) -> None:
    if not (gone.booted_out or gone.removed):
        console.print(f"nothing to uninstall: {label} is not loaded and {gone.plist} does not exist", markup=False)
        return
    done = [w for w, did in (("unloaded", gone.booted_out), (f"removed {gone.plist}", gone.removed)) if did]
    console.print(f"{label}: {', '.join(done)}; the state dir and the bundles are kept", markup=False)


def render_launch_warning(err: Console, warning: str) -> None:
    """``mlxwatch launch``: something about the server command worth knowing, before the exec."""
    err.print(f"mlxwatch launch: {warning}", markup=False)
