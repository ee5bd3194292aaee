"""Hide the secrets of URLs before they are shown: printed, logged, or stored with a run.

``redact_url`` replaces the password of every ``scheme://user:password@host`` in a string (a bare URL or a
message quoting one) and the value of every secret-looking query parameter (``?password=...``,
``&sslpassword=...``, ``&token=...``) with ``***``, whatever the scheme: ``postgresql+psycopg://``,
``http://``, ``https://``, ``mysql://``... The user name, host, port, path and other parameters stay, so the
message still says where privbench looked.

    >>> redact_url("postgresql://privbench:s3cret@db:5432/runs")
    'postgresql://privbench:***@db:5432/runs'
    >>> redact_url("http://mlflow:8080/?user=me&password=s3cret")
    'http://mlflow:8080/?user=me&password=***'
"""

from __future__ import annotations

import re

MASK = "***"
# scheme://  then the rest of the URL, up to whitespace or a character that closes a quoted URL in a message
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s'\"<>`]*)")
_SECRET_PARAM = re.compile(
    r"(?P<key>(?:^|[?&;])[^=&;#]*(?:pass(?:word)?|passwd|pwd|secret|token|api[_-]?key|access[_-]?key)[^=&;#]*=)"
    r"(?P<value>[^&;#]*)",
    re.IGNORECASE,
)


def redact_url(text: str) -> str:
    """``text`` with the password of every URL in it, and every secret query parameter, replaced by ``***``."""
    return _URL.sub(lambda m: m.group("scheme") + _redact_rest(m.group("rest")), text)


def _redact_rest(rest: str) -> str:
    """The part of one URL after ``scheme://``: ``[user[:password]@]host[:port][/path][?query][#fragment]``."""
    end = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, end)  # the last @ before the query: a password may hold an unescaped @
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        if colon and "/" not in user:
            rest = f"{user}:{MASK}{rest[at:]}"
            end = len(user) + len(MASK) + 1 + (end - at)
    query = rest[end:]
    if query:
        query = _SECRET_PARAM.sub(lambda m: m.group("key") + (MASK if m.group("value") else ""), query)
    return rest[:end] + query
