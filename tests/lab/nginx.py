"""nginx as a plain reverse proxy: what a user would put in front of a server instead of the
front door. Debian's binary (``scripts/debian-tools.sh`` puts it in ``.venvs/tools/bin``; a
system nginx on PATH also does), run unprivileged in the foreground with its own prefix::

    with Nginx.start(nginx, "http://127.0.0.1:8080", workdir) as proxy:
        proxy.url                        # send requests here

Used by the front door's tests (the same request through nginx and through the door) and by
``bench/front_perf.py`` (their costs side by side).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from lab.ports import free_port

# One worker: the door is one process on one event loop (like with like). Buffering off, HTTP/1.1
# with upstream keepalive: a streaming proxy as nginx's documentation configures one.
NGINX_CONF = """\
worker_processes 1;
error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream backend {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def find_nginx(venvs: Path | None = None) -> str | None:
    """nginx on PATH, else the one ``scripts/debian-tools.sh`` put in ``<venvs>/tools/bin``."""
    venvs = venvs or Path(os.environ.get("MLXWATCH_VENVS") or Path(__file__).resolve().parents[2] / ".venvs")
    found = shutil.which("nginx")
    if found:
        return found
    local = venvs / "tools" / "bin" / "nginx"
    return str(local) if os.access(local, os.X_OK) else None


class Nginx:
    """One nginx (master + one worker) we started; stopped by its PID only."""

    def __init__(self, popen: subprocess.Popen, port: int, workdir: Path) -> None:
        self.popen, self.port, self.workdir = popen, port, workdir

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, nginx: str, upstream: str, workdir: Path, timeout: float = 30.0) -> "Nginx":
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        conf = workdir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=workdir, port=port, upstream_port=upstream.rsplit(":", 1)[1]))
        log = open(workdir / "nginx.out", "ab")
        try:
            popen = subprocess.Popen([nginx, "-p", f"{workdir}/", "-c", str(conf), "-e", str(workdir / "error.log"),
                                      "-g", "daemon off;"], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        proxy = cls(popen, port, workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and popen.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return proxy
            time.sleep(0.05)
        proxy.stop()
        raise RuntimeError(f"nginx did not listen on {port}: {(workdir / 'nginx.out').read_text()[-800:]}"
                           f"{(workdir / 'error.log').read_text()[-800:] if (workdir / 'error.log').exists() else ''}")

    def stop(self) -> None:
        """SIGQUIT (graceful: the master ends its worker), then SIGKILL to the process group."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGQUIT)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)

    def __enter__(self) -> "Nginx":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
