"""A remote rank over real ssh: ``mlx.launch --hosts 127.0.0.1,127.0.0.2`` with rank 1 started
through a real sshd (Debian's openssh-server, ``tests/lab/sshd.py``) listening on 127.0.0.2.

Both hosts are this machine, so the test can check what mlxwatch reports over ssh against the
processes themselves; mlxwatch and mlx.launch only ever reach rank 1 through ``ssh 127.0.0.2``.
One group per mlx-lm version (about a core idle; the shared ``lab_group`` is stopped meanwhile),
its three tests in order: found, captured with rank 1 stopped, restarted (which ends it).
"""

from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest

from lab.group import LabGroup
from lab.sshd import LabSshd, sshd_missing
from mlxwatch.capture import CaptureRequest, capture_bundle
from mlxwatch.config import InstanceConfig, RestartConfig
from mlxwatch.host.group import RUNNING, STOPPED, alive_ranks
from mlxwatch.restart.methods import OK, RestartContext, restart

REMOTE = "127.0.0.2"


@pytest.fixture(scope="module")
def remote_group(server_python, tmp_path_factory, without_lab_groups):
    missing = sshd_missing()
    if missing:
        if os.environ.get("MLXWATCH_REQUIRE_SSHD") == "1":
            pytest.fail(f"MLXWATCH_REQUIRE_SSHD=1 but {missing}")
        pytest.skip(f"no loopback sshd: {missing}")
    root = tmp_path_factory.mktemp("remote")
    with pytest.MonkeyPatch.context() as mp:
        sshd = LabSshd.start(root / "sshd")
        # mlx.launch (its child) and mlxwatch (this process) both run `ssh` from PATH
        mp.setenv("PATH", f"{sshd.bin_dir}{os.pathsep}{os.environ['PATH']}")
        group = None
        try:
            group = LabGroup.start(server_python, root / "group", hosts=("127.0.0.1", REMOTE))
            yield sshd, group
        finally:
            if group is not None:
                group.stop()
            sshd.stop()


def _is_rank_under_sshd(pid: int, rank: int, sshd: LabSshd) -> bool:
    """``pid`` is rank ``rank`` and descends from our sshd, not from the launcher."""
    proc = psutil.Process(pid)
    return proc.environ().get("MLX_RANK") == str(rank) and sshd.proc.pid in [p.pid for p in proc.parents()]


def test_remote_rank_found_over_ssh(remote_group):
    """Discovery from rank 0: rank 1 is on host 127.0.0.2, found by the listing that ran there
    over ssh, with the PID and start of the very process sshd started."""
    sshd, group = remote_group
    found = group.group()
    assert found is not None and not found.errors, found
    assert found.hosts == ("127.0.0.1", REMOTE) and found.remote_hosts == (REMOTE,)
    rank0, rank1 = found.ranks
    assert (rank0.host, rank0.state, rank1.host, rank1.state) == ("127.0.0.1", RUNNING, REMOTE, RUNNING)
    assert rank1.identity is None and rank1.start  # remote: proven by PID and start on its host
    assert _is_rank_under_sshd(rank1.pid, 1, sshd)
    assert found.same_group(group.group())
    assert "Accepted publickey" in sshd.log_path.read_text()


def test_capture_takes_the_remote_ranks_stacks_over_ssh(remote_group, tmp_path):
    """Rank 1 on 127.0.0.2 SIGSTOPped: the bundle's group says so, rank 1's stacks come from
    py-spy run over ssh, and the classification names rank 1 as the rank rank 0 waits for."""
    _, group = remote_group
    found = group.group()
    rank1 = found.rank(1)
    os.kill(rank1.pid, signal.SIGSTOP)
    try:
        request = CaptureRequest(pid=found.rank(0).pid, out_dir=tmp_path, url=group.url, log=group.log_path,
                                 label="remote", snapshots=3, spacing=1.0, ceiling=45.0,
                                 probe_first_token_timeout=3.0, probe_timeout=5.0, group=found)
        bundle = asyncio.run(capture_bundle(request))
    finally:
        os.kill(rank1.pid, signal.SIGCONT)
    ranks = {r["rank"]: r for r in bundle.manifest["group"]["ranks"]}
    assert (ranks[1]["host"], ranks[1]["pid"], ranks[1]["state"]) == (REMOTE, rank1.pid, STOPPED), ranks
    assert list((bundle.path / "ranks" / "rank-1" / "stacks").glob("pyspy-*.json")), bundle.manifest
    c = bundle.manifest["classification"]
    assert (c["kind"], c["culprit_rank"]) == ("collective_wait", 1), c


def test_signal_restart_leaves_no_rank_on_either_host(remote_group):
    """Rank 1 on 127.0.0.2 SIGSTOPped, then the group restart (``signal``): every rank on both
    hosts and the launcher are gone, proven over ssh and checked here against the processes."""
    sshd, group = remote_group
    old = group.group()
    rank1 = old.rank(1)
    rank1_proc = psutil.Process(rank1.pid)
    os.kill(rank1.pid, signal.SIGSTOP)
    inst = InstanceConfig("remote", group.url, group.log_path, restart=RestartConfig("signal", grace=5.0))
    outcome = asyncio.run(restart(RestartContext(inst, old.rank(0).identity, None, group=old)))
    assert outcome.result == OK and "all 2 ranks and the launcher gone" in outcome.detail, outcome
    assert not old.launcher.alive() and not old.rank(0).identity.alive()
    assert not rank1_proc.is_running() or rank1_proc.status() == psutil.STATUS_ZOMBIE
    assert alive_ranks(old) == []
    listing = sshd.run("ps -eo pid=,stat=", timeout=30)  # asked on 127.0.0.2 itself
    alive = {int(pid) for pid, stat in (line.split() for line in listing.stdout.splitlines()) if stat[0] != "Z"}
    assert listing.returncode == 0 and rank1.pid not in alive, listing  # a zombie awaits sshd's reaping
