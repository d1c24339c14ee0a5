"""What an HTTP reply's body says, in one line.

mlx_lm.server answers the probe's requests with JSON or a plain-text line (``Not Found``); it
never sends an HTML page to a well-formed request. An HTML page is another program's answer
(``python3 -m http.server``, a proxy, a web app on the port): it is named as such, with its own
message, never printed raw. A new user's ``check`` printed http.server's 9-line error page as
the reason, ``status`` showed it with ``?`` for each newline, and every log line carried it::

    body_summary('<!DOCTYPE HTML>...<p>Message: Unsupported method (\\'POST\\').</p>...')
    # "an HTML page (Unsupported method ('POST').)"
"""

from __future__ import annotations

import html
import re

_MESSAGE = re.compile(r"<p>\s*Message:\s*(.*?)</p>", re.S | re.I)  # http.server's send_error page
_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.S | re.I)
_HEADING = re.compile(r"<h1[^>]*>(.*?)</h1>", re.S | re.I)
_TAG = re.compile(r"<[^>]*>")


def is_html(text: str, content_type: str = "") -> bool:
    head = text.lstrip()[:64].lower()
    return "text/html" in content_type.lower() or head.startswith(("<!doctype html", "<html"))


def body_summary(text: str, content_type: str = "", limit: int = 200) -> str:
    """``text`` in one line of at most about ``limit`` characters: an HTML page as ``an HTML
    page (its message)``, any other body with its whitespace folded to single spaces."""
    if not is_html(text, content_type):
        return " ".join(text.split())[:limit]
    found = _MESSAGE.search(text) or _TITLE.search(text) or _HEADING.search(text)
    detail = " ".join(html.unescape(_TAG.sub(" ", found.group(1))).split())[:limit] if found else ""
    return f"an HTML page ({detail})" if detail else "an HTML page"


NOT_MLX = "mlx-lm answers with JSON or plain text, so another program answers at this URL"
