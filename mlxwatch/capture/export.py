"""Export a bundle as ``.tar.gz``: redacted by default, for attaching to a public issue.

Two layers. What the export keeps of each file is by allowlist where content can hide: a log
line is kept only if it has a known server shape (progress, prompt-cache stats, HTTP access
lines, traceback frames and exception lines, startup); any other line becomes
``[redacted N chars]``. Probe transcripts keep event kinds and timings but not texts. The
watchdog's verdict keeps its known failure phrase only (its details can quote the server). The
summary and the manifest's classification quote marker lines: those quotes are cut by the same
line rule as the log files. Then
every file and the manifest go through ``redact``'s PUBLIC pass (the one capture uses at its
own level): secrets in command lines, URLs, headers, exception messages and stacks, every
environment value, home-directory paths. The manifest lists the files' new hashes and says
``"redacted": true``; ``redact=False`` (``--no-redact``) exports the bundle as it is, and its
manifest says ``"redacted": false``.

The front door's recorded request bodies (``requests/body-*.bin``, ``capture.requests``
module) are users' words, exact: an export leaves them out, redacted or not, unless
``request_bodies`` (``--with-request-bodies``) asks for them; then they go in as recorded
(a replay needs the exact bytes) and the manifest says ``"request_bodies": true``.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mlxwatch.capture.bundle import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SUMMARY,
    load_manifest,
    read_bounded,
)
from mlxwatch.capture.redact import PUBLIC, redact_bytes, redact_json
from mlxwatch.capture.requests import INDEX, is_body_file
from mlxwatch.errors import BundleError
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
    re.compile(r"^\[redacted \d+ chars\]$"),  # already cut: the rule is idempotent
]
MARKERS = "log-markers.json"
_TRANSCRIPT_TEXT_KINDS = {"token", "data", "body", "error", "other", "fail"}
REDACTED_FILES_NOTE = ("redacted by mlxwatch bundle export (the default; --no-redact exports the raw bundle): "
                       "log lines of unknown shape, probe texts, verdict details, environment values, secrets "
                       "(flags, URL credentials, headers, tokens) and home paths removed")
RAW_FILES_NOTE = "not redacted (mlxwatch bundle export --no-redact): private, as captured"


def redact_log_line(line: str) -> str:
    """A log line of a known server shape as it is (the secret pass follows), any other one as
    its length."""
    if any(p.search(line) for p in _KEEP_LOG_LINE):
        return line
    return f"[redacted {len(line)} chars]" if line.strip() else line


def redact_log(text: str) -> str:
    return "\n".join(redact_log_line(line) for line in text.split("\n"))


def _redact_transcript(report: Any) -> Any:
    """Probe reports (one dict or a list of them): keep kinds/timings, drop texts."""
    if isinstance(report, list):
        return [_redact_transcript(r) for r in report]
    if not isinstance(report, dict):
        return report
    out: dict[str, Any] = {}
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


def _redact_markers(markers: dict) -> dict:
    out: dict[str, Any] = {}
    for key, value in markers.items():
        if isinstance(value, str):
            out[key] = redact_log_line(value)
        elif isinstance(value, list):
            out[key] = [redact_log_line(v) if isinstance(v, str) else v for v in value]
        else:
            out[key] = value
    return out


_SUMMARY_MARKER = re.compile(r"^(- [a-z ]+: `)(.*)(`)$")


def _redact_summary(text: str) -> str:
    """``summary.md`` by the log files' rule: the log lines its "Log markers" section quotes
    (``- insufficient memory: `<line>` ``) and its last traceback become what ``log-tail.txt``
    keeps of them."""
    out, in_markers, in_traceback = [], False, False
    for line in text.split("\n"):
        if line.startswith("## "):
            in_markers, in_traceback = line == "## Log markers", False
        elif in_markers and line == "```":
            in_traceback = not in_traceback
        elif in_traceback:
            line = redact_log_line(line)
        elif in_markers and (m := _SUMMARY_MARKER.match(line)):
            line = m.group(1) + redact_log_line(m.group(2)) + m.group(3)
        out.append(line)
    return "\n".join(out)


def quoted_log_lines(markers_json: bytes | None) -> dict[str, str] | None:
    """The bundle's marker lines (``log-markers.json``, raw) that the export's line rule changes,
    each with its redacted form: the summary's and the classification's quotes of them are cut
    the same way (``log: <line>`` in the evidence). None when the bundle has no readable
    markers: then every ``log: …`` quote is cut whole (``_cut_log_quote``)."""
    try:
        markers = json.loads(markers_json) if markers_json else None
    except ValueError:
        return None
    if not isinstance(markers, dict):
        return None
    lines: list[str] = []
    for value in markers.values():
        if isinstance(value, str):
            lines.append(value)
        elif isinstance(value, list):
            lines += [v for v in value if isinstance(v, str)]
    found = {}
    for line in lines:
        for form in (line, line.strip()):
            if form.strip() and redact_log_line(form) != form:
                found[form] = redact_log_line(form)
    return found


def _cut_log_quote(text: str) -> str:
    """``log: <a log line> (why it matters)`` with no markers to tell its line: all of it after
    ``log: `` goes by the line rule."""
    return "log: " + redact_log_line(text[5:]) if text.startswith("log: ") else text


def _replace_all(text: str, quoted: dict[str, str] | None) -> str:
    if quoted is None:
        return "\n".join("- " + _cut_log_quote(line[2:]) if line.startswith("- log: ") else line
                         for line in text.split("\n"))
    for line in sorted(quoted, key=len, reverse=True):  # a longer line before a line it contains
        text = text.replace(line, quoted[line])
    return text


def _cut_manifest_quotes(value: Any, quoted: dict[str, str] | None) -> Any:
    if quoted is None:
        if isinstance(value, str):
            return _cut_log_quote(value)
        if isinstance(value, list):
            return [_cut_manifest_quotes(v, quoted) for v in value]
        if isinstance(value, dict):
            return {k: _cut_manifest_quotes(v, quoted) for k, v in value.items()}
        return value
    for line in sorted(quoted, key=len, reverse=True):
        value = _replace_strings(value, line, quoted[line])
    return value


def redact_file(relname: str, data: bytes, verdict: str | None = None, quoted: dict[str, str] | None = None) -> bytes:
    """The redacted form of one bundle file (``verdict``: the manifest's, to be cut where it is
    quoted; ``quoted``: the marker lines the summary quotes, from ``quoted_log_lines``, None
    when unknown): what the export keeps of it, then the PUBLIC secret pass."""
    text = data.decode("utf-8", errors="replace")
    if verdict:
        text = text.replace(verdict, redact_verdict(verdict))
    name = Path(relname).name
    if name == "log-tail.txt":
        text = redact_log(text)
    elif name in ("probe.json", "probes-before.json"):
        text = json.dumps(_redact_transcript(json.loads(text)), indent=2, sort_keys=True)
    elif name == "log-markers.json":
        text = json.dumps(_redact_markers(json.loads(text)), indent=2, sort_keys=True)
    elif name == "summary.md":
        text = _redact_summary(_replace_all(text, quoted))
    elif relname.startswith("stacks/") and name.endswith(".json"):
        threads = json.loads(text)
        for thread in threads:
            thread.pop("locals", None)
            for frame in thread.get("frames", []):
                frame.pop("locals", None)
        text = json.dumps(threads, indent=2)
    return redact_bytes(relname, text, PUBLIC)


def _keep_body_hashes(original: bytes, redacted: bytes) -> bytes:
    """``requests/requests.json`` redacted, each body's SHA-256 put back: the redaction takes a
    64-hex run for a token, and a replay refuses a body whose hash does not match (the export
    made to attach to an upstream issue must replay). Only with the bodies in the archive: a
    hash without its body could confirm a guessed prompt."""
    try:
        before, after = json.loads(original), json.loads(redacted)
        for old, new in zip(before, after, strict=True):
            new["body_sha256"] = old["body_sha256"]
    except (ValueError, TypeError, KeyError):
        return redacted  # not an index this export can mend: the replay will say what is wrong
    return json.dumps(after, indent=2, sort_keys=True).encode()


def archive_name(bundle: Path, redact: bool = False) -> str:
    return f"{bundle.name}{'-redacted' if redact else ''}.tar.gz"


def export_bundle(bundle: Path, out: Path | None = None, redact: bool = True,
                  on_skip: Callable[[str], None] | None = None, request_bodies: bool = False) -> Path:
    """Write the bundle as ``.tar.gz``, redacted unless ``redact`` is False, and return its
    path; never overwrites (FileExistsError).

    ``out`` is None (``<bundle>[-redacted].tar.gz`` beside the bundle), an existing directory
    (that name inside it) or a file name ending in ``.tar.gz``. The archive holds one top folder
    named after the bundle and only the files its manifest lists (never an earlier archive or a
    stray file); a listed file that is missing or is not a regular file inside the bundle is
    left out and passed to ``on_skip``. Raises ``BundleError`` for a path that is not a bundle,
    an ``out`` that is not a directory or a ``.tar.gz`` name, or one inside the bundle."""
    bundle = bundle.resolve()  # "." names a bundle too; member names come from its real name
    manifest = load_manifest(bundle)
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise BundleError(f"{bundle / MANIFEST}: has no file list; not a bundle this mlxwatch can export")
    if out is None:
        target = bundle.parent / archive_name(bundle, redact)
    elif out.is_dir():
        target = out / archive_name(bundle, redact)
    elif out.name.endswith(".tar.gz"):
        target = out
    else:
        raise BundleError(f"{out}: give an existing directory or a file name ending in .tar.gz")
    target = target.parent.resolve() / target.name
    if target.is_relative_to(bundle):
        raise BundleError(f"{target} is inside the bundle {bundle}; write the archive elsewhere (--out DIR)")
    if target.exists():
        raise FileExistsError(f"{target} exists; not overwriting")
    files: dict[str, dict] = {}
    members: list[tuple[str, bytes]] = []
    quoted = quoted_log_lines(_member(bundle, MARKERS) if MARKERS in listed else None)
    for relname in sorted(listed):
        if relname == MANIFEST or (is_body_file(relname) and not request_bodies):
            continue
        data = _member(bundle, relname)
        if data is None:
            if on_skip is not None:
                on_skip(relname)
            continue
        if redact and not is_body_file(relname):
            redacted = redact_file(relname, data, manifest.get("verdict"), quoted)
            data = _keep_body_hashes(data, redacted) if relname == INDEX and request_bodies else redacted
        files[relname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        members.append((relname, data))
    if redact:
        if manifest.get("verdict"):
            manifest = _replace_strings(manifest, manifest["verdict"], redact_verdict(manifest["verdict"]))
        manifest = _cut_manifest_quotes(manifest, quoted)  # the classification's evidence quotes log lines
        manifest = redact_json({k: v for k, v in manifest.items() if k != "files"}, PUBLIC)
        manifest.update(files=files, redacted=True, redaction=REDACTED_FILES_NOTE)
    else:
        manifest = {**manifest, "files": files, "redacted": False, "redaction": RAW_FILES_NOTE}  # what the archive holds
    manifest["request_bodies"] = request_bodies
    members.append((MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode()))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for relname, data in members:
            info = tarfile.TarInfo(f"{bundle.name}/{relname}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
            tar.addfile(info, io.BytesIO(data))
    from mlxwatch.storage import write_new

    write_new(target, buffer.getvalue())
    return target


MAX_MEMBER_BYTES = 64 * 1024 * 1024  # bundle files are capped well below this (logs, stacks: MBs)


def _member(bundle: Path, relname: str) -> bytes | None:
    """A listed file's bytes, or None if it is missing, escapes the bundle or is not a regular file."""
    if not isinstance(relname, str) or relname.startswith("/") or ".." in Path(relname).parts:
        return None
    path = bundle / relname
    try:
        if path.is_symlink() or not path.resolve().is_relative_to(bundle):
            return None
        return read_bounded(path, MAX_MEMBER_BYTES)
    except (OSError, ValueError):
        return None


@dataclass
class ArchiveView:
    """What ``bundle show`` needs from an exported archive."""

    path: Path
    name: str  # the archive's top folder: the bundle's name
    manifest: dict[str, Any] | None
    summary: str | None


MAX_ARCHIVE_MEMBERS = 10_000


def read_archive(path: Path) -> ArchiveView:
    """Read ``summary.md`` and ``manifest.json`` from an exported bundle archive (without
    extracting anything). Raises ``BundleError`` for anything that is not one."""
    found: dict[str, bytes] = {}
    tops: set[str] = set()
    try:
        with tarfile.open(path, "r:gz") as tar:
            for count, member in enumerate(tar, 1):
                if count > MAX_ARCHIVE_MEMBERS:
                    break
                parts = member.name.split("/")
                if parts[0]:
                    tops.add(parts[0])
                if len(parts) == 2 and parts[1] in (MANIFEST, SUMMARY) and member.isfile():
                    if member.size > MAX_MANIFEST_BYTES:
                        raise BundleError(f"{path}: {member.name} is larger than {MAX_MANIFEST_BYTES} bytes")
                    handle = tar.extractfile(member)
                    found[parts[1]] = handle.read() if handle is not None else b""
                    if len(found) == 2:
                        break
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise BundleError(f"{path}: not a readable .tar.gz bundle archive ({exc})") from None
    if not found:
        raise BundleError(f"{path}: an archive, but not of a bundle (no <bundle>/{MANIFEST} or {SUMMARY})")
    manifest = None
    if MANIFEST in found:
        try:
            manifest = json.loads(found[MANIFEST].decode("utf-8"))
        except ValueError as exc:
            raise BundleError(f"{path}: its {MANIFEST} is unreadable ({exc})") from None
        if not isinstance(manifest, dict):
            raise BundleError(f"{path}: its {MANIFEST} is not a JSON object")
    summary = found[SUMMARY].decode("utf-8", errors="replace") if SUMMARY in found else None
    name = sorted(tops)[0] if len(tops) == 1 else path.name.removesuffix(".tar.gz")
    return ArchiveView(path, name, manifest, summary)
