# Binaries taken from Debian packages, most without installing them (installing would also start
# their services): `apt-get download` + `dpkg-deb -x`, copied into $VENVS/tools/bin. Sourced by
# scripts/test.sh and bench/run.sh, which set $VENVS first. Each function returns 0 when the
# tools are on PATH or already in $VENVS/tools/bin, 1 when they cannot be had (no apt: macOS).

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

# nginx, the plain reverse proxy a user would pick instead of the front door (its tests and
# bench/front_perf.py compare the two): the binary /usr/sbin/nginx from Debian's nginx package,
# run unprivileged with its own prefix and config in a temp directory (tests/lab/nginx.py), so
# nothing else of the package is needed.
install_nginx() {
    command -v nginx >/dev/null && return 0
    [ -x "$VENVS/tools/bin/nginx" ] && return 0
    command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || return 1
    local tmp rc=0
    tmp=$(mktemp -d)
    (cd "$tmp" && { timeout 300 apt-get download -qq nginx || { timeout 300 apt-get update -qq \
        && timeout 300 apt-get download -qq nginx; }; }) </dev/null >/dev/null 2>&1 || rc=1
    if [ "$rc" = 0 ]; then
        mkdir -p "$VENVS/tools/bin"
        for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root" || rc=1; done
        cp "$tmp/root/usr/sbin/nginx" "$VENVS/tools/bin/nginx" || rc=1
    fi
    rm -rf "$tmp"
    return "$rc"
}

# sshd, for the remote rank of the distributed tests (tests/lab/sshd.py): Debian's openssh-server
# (and openssh-client), installed with apt-get since sshd runs its sessions through helpers at
# paths compiled into it. Installing a package would start its service: a policy-rc.d that
# refuses every start is in place for the install (Debian's own mechanism; an existing one is
# kept), so the system's sshd never runs. The tests run their own sshd on 127.0.0.2 with keys
# they make. Needs root (CI runs as root); 1 when it cannot be had.
install_sshd() {
    [ -x /usr/sbin/sshd ] && command -v ssh >/dev/null && command -v ssh-keygen >/dev/null && return 0
    command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] || return 1
    local policy=/usr/sbin/policy-rc.d made=0 rc=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made=1
    fi
    local install="timeout 300 apt-get install -y -qq --no-install-recommends openssh-server openssh-client"
    { $install || { timeout 300 apt-get update -qq && $install; }; } </dev/null >/dev/null 2>&1 || rc=1
    [ "$made" = 1 ] && rm -f "$policy"
    [ -x /usr/sbin/sshd ] || rc=1
    return "$rc"
}
