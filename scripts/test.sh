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
wait "$test_pid"
wait "$old_pid"

export MLXWATCH_SERVER_PYTHONS="$VENVS/mlx-lm-$OLD_MLX_LM/bin/python,$VENVS/test/bin/python"
export MLXWATCH_REQUIRE_REAL_SERVER=1
export PATH="$VENVS/test/bin:$PATH"   # py-spy and mlxwatch as a user would have them
"$VENVS/test/bin/python" -c 'import importlib.metadata as m; print("mlxwatch", m.version("mlxwatch"), "| mlx-lm", m.version("mlx-lm"), "| py-spy", m.version("py-spy"))'
exec "$VENVS/test/bin/python" -m pytest "$@"
