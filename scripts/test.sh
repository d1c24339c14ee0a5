#!/usr/bin/env bash
# Install everything into fresh virtual environments and run the whole test suite.
#
#   .venvs/test            mlxwatch[test]: pytest, respx, and the newest mlx-lm 0.32.x
#   .venvs/mlx-lm-0.31.3   the version of the public hang report, for the real-server tests
#
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k probe -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENVS=${MLXWATCH_VENVS:-$PWD/.venvs}
OLD_MLX_LM=0.31.3
OLD_MLX=0.31.2
cpu_extra() { [ "$(uname -s)" = Linux ] && echo "mlx[cpu]==$1" || echo "mlx==$1"; }

# install_prometheus_tools (promtool, amtool, node_exporter) and install_nginx (the plain reverse
# proxy the front door's tests compare with), from Debian packages into $VENVS/tools/bin, and
# install_sshd (openssh-server, for the remote rank of the distributed tests; its service is
# never started): scripts/debian-tools.sh, shared with bench/run.sh. One after the other (one
# apt at a time); the exit status's bits say which could not be had: 1 the Prometheus tools,
# 2 nginx, 4 sshd.
# shellcheck source=scripts/debian-tools.sh
. scripts/debian-tools.sh
install_debian_tools() {
    local rc=0
    install_prometheus_tools || rc=1
    install_nginx || rc=$((rc | 2))
    install_sshd || rc=$((rc | 4))
    return "$rc"
}

rm -rf "$VENVS/test" "$VENVS/mlx-lm-$OLD_MLX_LM"
mkdir -p "$VENVS"
"$PYTHON" -m venv "$VENVS/test"
"$PYTHON" -m venv "$VENVS/mlx-lm-$OLD_MLX_LM"

# The two installs are independent: run them side by side.
"$VENVS/test/bin/pip" install --quiet --disable-pip-version-check -e '.[test]' &
test_pid=$!
"$VENVS/mlx-lm-$OLD_MLX_LM/bin/pip" install --quiet --disable-pip-version-check \
    "mlx-lm==$OLD_MLX_LM" "$(cpu_extra $OLD_MLX)" &
old_pid=$!
install_debian_tools &
tools_pid=$!
wait "$test_pid"
wait "$old_pid"
export PATH="$VENVS/tools/bin:$PATH"
tools_rc=0
wait "$tools_pid" || tools_rc=$?
# Installed: the tests that use them must not skip.
if [ $((tools_rc & 1)) = 0 ]; then
    export MLXWATCH_REQUIRE_PROMETHEUS_TOOLS=1
else
    echo "promtool/amtool/node_exporter unavailable (no apt or no Debian packages): fleet docs get the fallback checks"
fi
if [ $((tools_rc & 2)) = 0 ]; then
    export MLXWATCH_REQUIRE_NGINX=1
else
    echo "nginx unavailable (no apt or no Debian package): the front door's nginx comparison is skipped"
fi
if [ $((tools_rc & 4)) = 0 ]; then
    export MLXWATCH_REQUIRE_SSHD=1
else
    echo "sshd unavailable (no apt, not root, or no Debian package): the remote-rank tests are skipped"
fi

export MLXWATCH_SERVER_PYTHONS="$VENVS/mlx-lm-$OLD_MLX_LM/bin/python,$VENVS/test/bin/python"
export MLXWATCH_REQUIRE_REAL_SERVER=1
export PATH="$VENVS/test/bin:$PATH"   # py-spy and mlxwatch as a user would have them
"$VENVS/test/bin/python" -c 'import importlib.metadata as m; print("mlxwatch", m.version("mlxwatch"), "| mlx-lm", m.version("mlx-lm"), "| py-spy", m.version("py-spy"))'

# Lint and types first (pyproject.toml: [tool.ruff], [tool.mypy]; both from the test extra):
# a failure ends the run before the tests, non-zero, naming the step that failed.
check() {
    local name=$1 rc=0
    shift
    echo "== $name: $*"
    "$@" || rc=$?
    if [ "$rc" != 0 ]; then
        echo "scripts/test.sh: $name failed (exit $rc); no tests were run" >&2
        exit "$rc"
    fi
}
check lint "$VENVS/test/bin/ruff" check mlxwatch tests bench
check types "$VENVS/test/bin/python" -m mypy
check "types (the in-server shim on Python 3.10)" "$VENVS/test/bin/python" -m mypy --python-version 3.10 \
    mlxwatch/shim/agent.py mlxwatch/shim/dumps.py mlxwatch/shim/layout.py mlxwatch/shim/boot/sitecustomize.py \
    mlxwatch/shim/recorder.py mlxwatch/shim/spool.py
# Two passes: the fast tier on six workers (its tests mostly wait on timeouts: CONTRIBUTING.md),
# then the real-server tests in one process (they share one lab server per mlx-lm version). A
# pass that selects nothing (pytest's exit 5, e.g. `-k` naming tests of the other tier only)
# fails the run only when the other pass ran nothing either.
pass_rc() {
    local name=$1 rc=0
    shift
    echo "== tests, $name: pytest $*"
    "$VENVS/test/bin/python" -m pytest "$@" || rc=$?
    return "$rc"
}
fast_rc=0
real_rc=0
pass_rc "fast tier" -m "not real_server" -n 6 "$@" || fast_rc=$?
pass_rc "real servers" -m real_server --durations=30 "$@" || real_rc=$?  # the slowest named: the budget
if [ "$fast_rc" = 5 ] && [ "$real_rc" = 5 ]; then
    echo "scripts/test.sh: no test was selected" >&2
    exit 5
fi
for rc in "$fast_rc" "$real_rc"; do
    if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then
        echo "scripts/test.sh: tests failed (fast tier exit $fast_rc, real servers exit $real_rc)" >&2
        exit "$rc"
    fi
done
echo "scripts/test.sh: both tiers passed"
