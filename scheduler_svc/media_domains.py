"""The form ``--allowed-media-domains`` entries and URL hosts are compared in.

Both the configuration (which checks every entry at start-up) and the URL loader (``scheduler_svc/doors/media_urls.py``,
which compares a URL's host with them) use it, so it sits below both.
"""

from __future__ import annotations

import ipaddress
import re

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")  # one DNS label: letters, digits, inner hyphens, 63 at most


def normalize_domain(entry: str) -> str:
    """An ``--allowed-media-domains`` entry in the form hosts are compared in: lower case, no trailing dot, an IP
    literal in its compressed form (brackets dropped), ``*.suffix`` kept. Raises ValueError naming the entry."""
    text = entry.strip().lower().rstrip(".")
    literal = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return str(ipaddress.ip_address(literal))
    except ValueError:
        pass
    name = text[2:] if text.startswith("*.") else text
    if not name.isascii():
        raise ValueError(f"{entry!r} is not ASCII: write an internationalized name in its xn-- (IDNA) form")
    labels = name.split(".")
    if not all(_LABEL.match(label) for label in labels) or (text.startswith("*.") and len(labels) < 2):
        raise ValueError(
            f"{entry!r} is not a host name, an IP address or '*.' and a domain of two labels or more "
            "(such as media.example.com or *.example.com)"
        )
    return text
