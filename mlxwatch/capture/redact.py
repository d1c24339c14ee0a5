"""Secrets out of the text a bundle holds: one pass, three levels, used by capture and export.

    NONE     ``capture.redact: false``: the raw bundle keeps everything it read (files 0600 in
             0700 directories)
    PRIVATE  the raw bundle by default: values of secret-looking environment variables, token-
             shaped environment values (40-hex included), secret-named pairs inside environment
             values (``pass=x``), and passwords in URLs (anywhere: command line, environment,
             logs) are removed; command-line flag values and log headers are not (PUBLIC)
    PUBLIC   the export: PRIVATE, plus every environment value; the value after a secret-looking
             flag (``--api-key X``, ``--token=X``, ``--*secret*``, ``--*key*``, ``--*password*``);
             URL user info and secret-looking query parameters; ``Authorization``/``Cookie``
             headers; ``NAME=value`` pairs whose NAME looks secret; token-shaped strings (``sk-…``,
             ``hf_…``, ``ghp_…``, Slack, AWS, JWTs, long hex or base64 secrets); home-directory
             paths folded to ``~``

Evidence must survive: stack frames, file paths, line numbers, PIDs, token counts and hex thread
ids such as ``0x16FF87000``. The shapes below are anchored so they do not match those (a long hex
run touching ``0x`` or a ``/`` is an id or a path, not a secret; ``--max-tokens`` and
``max_tokens=`` are counts: a name is secret when a word of it *is* or *ends in* ``token``).

Usage::

    data = redact_bytes("process.json", data, PUBLIC)    # JSON walked, text line by line
    argv = redact_argv(["mlx_lm.server", "--api-key", "sk-…"], PUBLIC)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

NONE, PRIVATE, PUBLIC = "none", "private", "public"
MARK = "[redacted]"
REMOVED = "[removed]"
ARGV_KEYS = ("cmdline", "argv")  # process.json and the manifest; the shim's heartbeat

# A name (environment variable, flag, query parameter, JSON key) that holds a secret.
_SECRET_PARTS = ("key", "secret", "passw", "passphrase", "credential", "cookie", "auth", "private", "signature")
_SECRET_WORDS = frozenset({"pass", "pwd", "sig", "jwt", "bearer", "session", "sessionid"})


def secret_name(name: str) -> bool:
    """``HF_TOKEN``, ``--api-key``, ``db_password``, ``X-Amz-Signature``: yes; ``max_tokens``: no."""
    low = name.lower().lstrip("-")
    if any(part in low for part in _SECRET_PARTS):
        return True
    return any(w in _SECRET_WORDS or w.endswith("token") for w in re.split(r"[^a-z0-9]+", low))


_URL_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^/\s:@\"'<>]*)(?::([^/\s@\"'<>]*))?@")
_HEADER = re.compile(r"(?i)\b(authorization|proxy-authorization|cookie|set-cookie|x-api-key|api-key|x-auth-token)"
                     r"([\"']?[ \t]*[:=][ \t]*)[^\r\n]+")
_BEARER = re.compile(r"\b(Bearer)[ \t]+[A-Za-z0-9._~+/=-]{8,}")
_QUOTED_PAIR = re.compile(r"([\"'])([\w.-]+)\1([ \t]*:[ \t]*)([\"'])([^\"'\r\n]*)\4")
_PAIR = re.compile(r"(?<![\w-])(-{0,2}[A-Za-z_][\w.-]*)(=)([^\s&;,\"'<>)\]}]+)")
_COLON_PAIR = re.compile(r"(?i)\b(password|passwd|passphrase|secret|api[_-]?key|access[_-]?key)([ \t]*:[ \t]*)(\S+)")
_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][\w.-]*)([ \t]+)(?!-)(\S+)")
_TOKENS = re.compile(
    r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{16,}"  # OpenAI, Anthropic
    r"|\bhf_[A-Za-z0-9]{16,}"  # Hugging Face
    r"|\b(?:gh[pousr]_|github_pat_)[A-Za-z0-9_]{16,}"  # GitHub
    r"|\bglpat-[A-Za-z0-9_-]{16,}"  # GitLab
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"  # Slack
    r"|\bAKIA[0-9A-Z]{16}\b"  # AWS access key id
    r"|\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"  # JWT
)
_TOKEN_PREFIX = re.compile(r"^(hf_|sk-|ghp_|github_pat_|xox[bap]-)")  # an environment value that is a token
_LONG_HEX = re.compile(r"(?<![\w/.+-])[0-9a-fA-F]{32,}(?![\w/+-])")
_LONG_B64 = re.compile(r"(?<![\w/.+-])[A-Za-z0-9+_-]{24,}={0,2}(?![\w/+-])")
_HOME = re.compile(r"(/Users|/home)/[^/\s\"']+")


def _random_looking(run: str) -> bool:
    """A base64/base64url run that is a secret rather than a name: a segment between separators
    of 20 or more characters mixing digits, upper and lower case (model names, identifiers and
    timestamps such as a bundle's ``20261203T085829Z`` do not)."""
    for segment in re.split(r"[-_]", run):
        if len(segment) >= 20 and all(sum(f(c) for c in segment) >= 2 for f in (str.isdigit, str.isupper, str.islower)):
            return True
    return False


def _url_userinfo(level: str) -> Callable[[re.Match], str]:
    def replace(m: re.Match) -> str:
        if level == PUBLIC and (m.group(2) or m.group(3) is not None):
            return f"{m.group(1)}{MARK}@"
        if m.group(3) is not None:
            return f"{m.group(1)}{m.group(2)}:{MARK}@"
        return m.group(0)
    return replace


def _if_secret_name(m: re.Match, name: int, keep: tuple[int, ...]) -> str:
    if not secret_name(m.group(name)):
        return m.group(0)
    return "".join(m.group(i) for i in keep) + MARK


def redact_home(text: str) -> str:
    """Home-directory paths (``$HOME``, ``/Users/<name>``, ``/home/<name>``) become ``~``."""
    home = str(Path.home())
    if home not in ("/", ""):
        text = text.replace(home, "~")
    return _HOME.sub("~", text)


def redact_text(text: str, level: str) -> str:
    """Free text (a log, a stack dump, an exception message, one argument) at ``level``."""
    if level == NONE or not text:
        return text
    text = _URL_USERINFO.sub(_url_userinfo(level), text)
    if level != PUBLIC:
        return text
    text = _HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{MARK}", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {MARK}", text)
    text = _QUOTED_PAIR.sub(lambda m: m.group(0) if not secret_name(m.group(2)) else
                            f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{m.group(4)}{MARK}{m.group(4)}", text)
    text = _PAIR.sub(lambda m: _if_secret_name(m, 1, (1, 2)), text)
    text = _COLON_PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}{MARK}", text)
    text = _FLAG.sub(lambda m: _if_secret_name(m, 1, (1, 2)), text)
    text = _TOKENS.sub(MARK, text)
    text = _LONG_HEX.sub(MARK, text)
    text = _LONG_B64.sub(lambda m: MARK if _random_looking(m.group(0)) else m.group(0), text)
    return redact_home(text)


def redact_argv(argv: list[str], level: str) -> list[str]:
    """A command line: at PUBLIC the value after (or ``=`` of) a secret-looking flag goes too."""
    if level == NONE:
        return list(argv)
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(MARK)
            hide_next = False
            continue
        if level == PUBLIC and arg.startswith("--") and secret_name(arg.split("=", 1)[0]):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + MARK)
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(redact_text(arg, level))
    return out


def token_shaped(value: str) -> bool:
    """An environment value that is a secret by its look: a known token (``hf_…``, ``sk-…``,
    ``ghp_…``, a JWT…), a hex run of 32 or more (a GitHub classic token has 40), or one
    random-looking base64 run; not a path, a model name or a count."""
    value = value.strip().strip("\"'")
    return bool(_TOKEN_PREFIX.match(value) or _TOKENS.search(value) or _LONG_HEX.search(value)
                or (_LONG_B64.fullmatch(value) and _random_looking(value)))


def _env_value(value: str) -> str:
    """PRIVATE, one environment value: URL passwords and secret-named pairs inside it
    (``MYAPP_CONN='user=app pass=[redacted]'``, ``password: x``) cut."""
    value = redact_text(value, PRIVATE)
    value = _PAIR.sub(lambda m: _if_secret_name(m, 1, (1, 2)), value)
    return _COLON_PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}{MARK}", value)


def redact_command_text(text: str) -> str:
    """The command-line rule on free text (a log line quoting a command line, such as the
    daemon's ``server is PID N: mlx_lm.server --api-key …``): secret-looking flags' values
    (``--api-key X``, ``--token=X``), URL user info and token-shaped strings; the rest of the
    line (paths, counts, other flags) as it is."""
    if not text:
        return text
    text = _URL_USERINFO.sub(_url_userinfo(PUBLIC), text)
    text = _PAIR.sub(lambda m: _if_secret_name(m, 1, (1, 2)), text)
    text = _FLAG.sub(lambda m: _if_secret_name(m, 1, (1, 2)), text)
    return _TOKENS.sub(MARK, text)


def redact_environment(env: dict[str, str], level: str) -> dict[str, str]:
    """PRIVATE: secret-looking names and token-shaped values removed, URL passwords and
    ``pass=``-like pairs cut from the rest (``DATABASE_URL=postgres://app:[redacted]@db/x``).
    PUBLIC: every value removed."""
    if level == NONE:
        return dict(env)
    if level == PUBLIC:
        return {k: REMOVED for k in env}
    return {k: REMOVED if secret_name(k) or token_shaped(v or "") else _env_value(v)
            for k, v in env.items()}


def redact_json(value: Any, level: str) -> Any:
    """A JSON value: strings as text, ``cmdline``/``argv`` lists as command lines, ``environment``
    objects as environments; at PUBLIC a string under a secret-looking key is removed."""
    if level == NONE:
        return value
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            if key == "environment" and isinstance(item, dict):
                out[key] = redact_environment({k: str(v) for k, v in item.items()}, level)
            elif key in ARGV_KEYS and isinstance(item, list) and all(isinstance(a, str) for a in item):
                out[key] = redact_argv(item, level)
            elif level == PUBLIC and isinstance(item, str) and isinstance(key, str) and secret_name(key):
                out[key] = MARK
            else:
                out[key] = redact_json(item, level)
        return out
    if isinstance(value, list):
        return [redact_json(v, level) for v in value]
    if isinstance(value, str):
        return redact_text(value, level)
    return value


def redact_bytes(relname: str, data: bytes | str, level: str) -> bytes:
    """One bundle file's content at ``level``: ``.json`` files walked (rewritten only when
    something was removed), any other file as text; bytes that are not UTF-8 are kept as they are."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if level == NONE:
        return raw
    text = raw.decode("utf-8", errors="surrogateescape")
    if relname.endswith(".json"):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        else:
            redacted = redact_json(value, level)
            return raw if redacted == value else json.dumps(redacted, indent=2, sort_keys=True).encode()
    redacted_text = redact_text(text, level)
    return raw if redacted_text == text else redacted_text.encode("utf-8", errors="surrogateescape")
