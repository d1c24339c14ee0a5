#!/usr/bin/env bash
# Run every benchmark (issue 7) and write bench/RESULTS.md and bench/RESULTS.json.
#
# Uses the venvs that scripts/test.sh makes, and makes them (the same way) if they are missing:
#   .venvs/test            mlxwatch with the newest mlx-lm 0.32.x and py-spy
#   .venvs/mlx-lm-0.31.3   the version of the public hang report, server only
#
# Extra arguments go to `python -m bench.run` (e.g. `bash bench/run.sh --quick`); with `front_perf`
# (or `front_hop`) first, the rest go to `python -m bench.front_perf` (the front door vs nginx vs
# direct; `bench.front_hop`: one hop alone), which needs nginx: taken from Debian's package into $VENVS/tools/bin (scripts/debian-tools.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENVS=${MLXWATCH_VENVS:-$PWD/.venvs}
OLD_MLX_LM=0.31.3
OLD_MLX=0.31.2
cpu_extra() { [ "$(uname -s)" = Linux ] && echo "mlx[cpu]==$1" || echo "mlx==$1"; }

# The 'bench' extra: the test extra plus aiohttp (the front bench's stand-in and client), uvicorn
# (bench/front_alternative.py: the HTTP libraries weighed for the front door) and uvloop (what
# that event loop would buy, bench/front_hop.py). A venv made by scripts/test.sh lacks only those.
if [ ! -x "$VENVS/test/bin/python" ] || [ ! -x "$VENVS/test/bin/py-spy" ]; then
    "$PYTHON" -m venv "$VENVS/test"
    "$VENVS/test/bin/pip" install --quiet --disable-pip-version-check -e '.[bench]'
elif ! "$VENVS/test/bin/python" -c 'import uvicorn, aiohttp, uvloop' 2>/dev/null; then
    "$VENVS/test/bin/pip" install --quiet --disable-pip-version-check -e '.[bench]'
fi
if [ ! -x "$VENVS/mlx-lm-$OLD_MLX_LM/bin/mlx_lm.server" ]; then
    "$PYTHON" -m venv "$VENVS/mlx-lm-$OLD_MLX_LM"
    "$VENVS/mlx-lm-$OLD_MLX_LM/bin/pip" install --quiet --disable-pip-version-check \
        "mlx-lm==$OLD_MLX_LM" "$(cpu_extra $OLD_MLX)"
fi
# shellcheck source=scripts/debian-tools.sh
. scripts/debian-tools.sh
install_nginx || echo "nginx unavailable (no apt or no Debian package): bench.front_perf measures direct and the door only"
export PATH="$PATH:$VENVS/tools/bin"
export MLXWATCH_VENVS="$VENVS"
if [ "${1:-}" = front_perf ] || [ "${1:-}" = front_hop ]; then
    bench=$1
    shift
    exec "$VENVS/test/bin/python" -m "bench.$bench" "$@"
fi
exec "$VENVS/test/bin/python" -m bench.run "$@"
