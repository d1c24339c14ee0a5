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

# Prometheus' own tools check the fleet docs and the metrics: promtool (docs/alerts.yml and its
# unit tests), amtool (the Alertmanager example) and node_exporter (reads the metrics textfile).
# Debian's prometheus, prometheus-alertmanager and prometheus-node-exporter packages ship them;
# only the binaries are taken from the packages (installing them would also start the services),
# into $VENVS/tools/bin. Without apt (macOS) those tests run their fallback checks and say so.
install_prometheus_tools() {
    command -v promtool >/dev/null && command -v amtool >/dev/null \
        && command -v prometheus-node-exporter >/dev/null && return 0
    [ -x "$VENVS/tools/bin/promtool" ] && [ -x "$VENVS/tools/bin/amtool" ] \
        && [ -x "$VENVS/tools/bin/prometheus-node-exporter" ] && return 0
    command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || return 1
    local tmp rc=0 pkgs="prometheus prometheus-alertmanager prometheus-node-exporter"
    tmp=$(mktemp -d)
    # shellcheck disable=SC2086
    (cd "$tmp" && { timeout 300 apt-get download -qq $pkgs || { timeout 300 apt-get update -qq \
        && timeout 300 apt-get download -qq $pkgs; }; }) </dev/null >/dev/null 2>&1 || rc=1
    if [ "$rc" = 0 ]; then
        mkdir -p "$VENVS/tools/bin"
        for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root" || rc=1; done
        for tool in promtool amtool prometheus-node-exporter; do
            cp "$tmp/root/usr/bin/$tool" "$VENVS/tools/bin/$tool" || rc=1
        done
    fi
    rm -rf "$tmp"
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
install_prometheus_tools &
tools_pid=$!
wait "$test_pid"
wait "$old_pid"
export PATH="$VENVS/tools/bin:$PATH"
if wait "$tools_pid"; then
    export MLXWATCH_REQUIRE_PROMETHEUS_TOOLS=1   # installed: the tests that use them must not skip
else
    echo "promtool/amtool/node_exporter unavailable (no apt or no Debian packages): fleet docs get the fallback checks"
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
    mlxwatch/shim/agent.py mlxwatch/shim/layout.py mlxwatch/shim/boot/sitecustomize.py
echo "== tests: pytest $*"
exec "$VENVS/test/bin/python" -m pytest "$@"
