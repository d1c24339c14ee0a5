"""Export a bundle as ``.tar.gz``, optionally redacted for attaching to a public issue.

Redaction is by allowlist where content can hide: a log line is kept only if it has a known
server shape (progress, prompt-cache stats, HTTP access lines, traceback frames and exception
lines, startup); any other line becomes ``[redacted N chars]``. Probe transcripts keep event
kinds and timings but not texts. The watchdog's verdict keeps its known failure phrase only
(its details can quote the server). Environment values are dropped. Home-directory paths become
``~``. The manifest is rewritten to list the redacted files' new hashes and ``"redacted": true``.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import time
from pathlib import Path
from typing import Any

from mlxwatch.capture.bundle import MANIFEST, load_manifest
from mlxwatch.probes.generation import DESCRIPTIONS

_KEEP_LOG_LINE = [
    re.compile(r"Prompt processing progress: \d+/\d+\s*$"),
    re.compile(r"Prompt Cache: \d+ sequences"),
    re.compile(r"- (assistant|user|system): \d+ sequences"),
    re.compile(r'^\d{1,3}(\.\d{1,3}){3} - - \[[^\]]+\] "(GET|POST|OPTIONS|HEAD) [^ "]+ HTTP/1\.[01]" \d{3} '),
    re.compile(r"Starting httpd at "),
    re.compile(r"^Traceback \(most recent call last\):$"),
    re.compile(r'^\s+File "[^"]+", line \d+, in \S+$'),
    re.compile(r"^\s+\^+$"),
    re.compile(r"^Exception in thread .+:$"),
    re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)(: .*)?$"),
    re.compile(r"generation thread died"),
    re.compile(r"UserWarning: mlx_lm.server is not recommended"),
]
_HOME = re.compile(r"(/Users|/home)/[^/\s\"']+")
_TRANSCRIPT_TEXT_KINDS = {"token", "data", "body", "error", "other", "fail"}
REDACTED_FILES_NOTE = "redacted by mlxwatch bundle export --redact"


def redact_home(text: str) -> str:
    home = str(Path.home())
    if home not in ("/", ""):
        text = text.replace(home, "~")
    return _HOME.sub("~", text)


def redact_log_line(line: str) -> str:
    if any(p.search(line) for p in _KEEP_LOG_LINE):
        return redact_home(line)
    return f"[redacted {len(line)} chars]" if line.strip() else line


def redact_log(text: str) -> str:
    return "\n".join(redact_log_line(line) for line in text.split("\n"))


def _redact_transcript(report: Any) -> Any:
    """Probe reports (one dict or a list of them): keep kinds/timings, drop texts."""
    if isinstance(report, list):
        return [_redact_transcript(r) for r in report]
    if not isinstance(report, dict):
        return report
    out = {}
    for key, value in report.items():
        if key == "transcript" and isinstance(value, list):
            out[key] = [
                {**ev, "text": f"[redacted {len(ev.get('text', ''))} chars]"}
                if ev.get("kind") in _TRANSCRIPT_TEXT_KINDS and ev.get("text") else ev
                for ev in value
            ]
        elif key in ("body", "detail", "reason") and isinstance(value, str):
            out[key] = _redact_free_text(value)
        else:
            out[key] = _redact_transcript(value)
    return out


def _redact_free_text(text: str) -> str:
    # Failure details quote server bodies; keep the verdict words, drop quoted content.
    return re.sub(r"(: ).*$", r"\1[redacted]", text) if ": " in text else text


def redact_verdict(text: str) -> str:
    """The watchdog's verdict (``2 failed probes: HTTP error: HTTP 500: <server body>``) up to
    the end of the first known failure phrase; what follows can quote the server."""
    found = [(text.find(d) + len(d)) for d in DESCRIPTIONS.values() if d in text]
    if not found:
        return f"[redacted {len(text)} chars]"
    end = min(found)
    return text[:end] + (" [details redacted]" if text[end:].strip() else "")


def _replace_strings(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, list):
        return [_replace_strings(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _replace_strings(v, old, new) for k, v in value.items()}
    return value


def _redact_process(info: dict) -> dict:
    info = dict(info)
    if isinstance(info.get("environment"), dict):
        info["environment"] = {k: "[removed]" for k in info["environment"]}
    return json.loads(redact_home(json.dumps(info)))


def _redact_markers(markers: dict) -> dict:
    out = {}
    for key, value in markers.items():
        if isinstance(value, str):
            out[key] = redact_log_line(value)
        elif isinstance(value, list):
            out[key] = [redact_log_line(v) if isinstance(v, str) else v for v in value]
        else:
            out[key] = value
    return out


def redact_file(relname: str, data: bytes, verdict: str | None = None) -> bytes:
    """The redacted form of one bundle file (``verdict``: the manifest's, to be cut where it is quoted)."""
    text = data.decode("utf-8", errors="replace")
    if verdict:
        text = text.replace(verdict, redact_verdict(verdict))
    name = Path(relname).name
    if name == "log-tail.txt":
        return redact_log(text).encode()
    if name in ("probe.json", "probes-before.json"):
        return json.dumps(_redact_transcript(json.loads(text)), indent=2, sort_keys=True).encode()
    if name == "process.json":
        return json.dumps(_redact_process(json.loads(text)), indent=2, sort_keys=True).encode()
    if name == "log-markers.json":
        return json.dumps(_redact_markers(json.loads(text)), indent=2, sort_keys=True).encode()
    if name == "summary.md":
        return "\n".join(redact_log_line(l) if l.startswith("- last") or l.startswith("- thread") else redact_home(l)
                         for l in text.split("\n")).encode()
    if relname.startswith("stacks/") and name.endswith(".json"):
        threads = json.loads(text)
        for thread in threads:
            thread.pop("locals", None)
            for frame in thread.get("frames", []):
                frame.pop("locals", None)
        return redact_home(json.dumps(threads, indent=2)).encode()
    return redact_home(text).encode()


def export_bundle(bundle: Path, out: Path | None = None, redact: bool = False) -> Path:
    """Write ``<bundle>[-redacted].tar.gz`` (or ``out``); never overwrites an existing file."""
    manifest = load_manifest(bundle)
    out = out or bundle.parent / f"{bundle.name}{'-redacted' if redact else ''}.tar.gz"
    if out.exists():
        raise FileExistsError(f"{out} exists; not overwriting")
    files: dict[str, dict] = {}
    members: list[tuple[str, bytes]] = []
    for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
        relname = path.relative_to(bundle).as_posix()
        if relname == MANIFEST:
            continue
        data = path.read_bytes()
        if redact:
            data = redact_file(relname, data, manifest.get("verdict"))
        files[relname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        members.append((relname, data))
    if redact:
        if manifest.get("verdict"):
            manifest = _replace_strings(manifest, manifest["verdict"], redact_verdict(manifest["verdict"]))
        manifest = json.loads(redact_home(json.dumps({**manifest, "files": files, "redacted": True,
                                                       "redaction": REDACTED_FILES_NOTE})))
        manifest["target"]["cmdline"] = [redact_home(a) for a in manifest["target"].get("cmdline") or []]
    members.append((MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode()))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for relname, data in members:
            info = tarfile.TarInfo(f"{bundle.name}/{relname}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
            tar.addfile(info, io.BytesIO(data))
    from mlxwatch.storage import write_new

    write_new(out, buffer.getvalue())
    return out
