"""A compaction item's encrypted_content: the summary the served model wrote, as an opaque token.

The token carries the summary itself (zlib, base64url) and a checksum, so it resolves after a
restart and on any node; it is not a secret (the client sent the conversation it summarizes), and
one made up by a client is only text it could have sent as a message.
"""

from __future__ import annotations

import base64
import hashlib
import zlib

from ....errors import InvalidInput

PREFIX = "wkc1."
SUMMARY_HEADER = "A summary of the conversation so far, written when it was compacted:\n\n"


def encode(summary: str) -> str:
    raw = summary.encode()
    check = hashlib.sha256(raw).hexdigest()[:16]
    return f"{PREFIX}{check}.{base64.urlsafe_b64encode(zlib.compress(raw)).decode()}"


def decode(token: str, param: str) -> str:
    """The summary in a token this server made; a 400 naming param otherwise."""
    try:
        check, body = token.removeprefix(PREFIX).split(".", 1)
        raw = zlib.decompress(base64.urlsafe_b64decode(body.encode()), bufsize=1 << 16)
        ok = token.startswith(PREFIX) and hashlib.sha256(raw).hexdigest()[:16] == check
    except (ValueError, zlib.error):
        ok = False
    if not ok:
        raise InvalidInput(f"{param}: encrypted_content was not made by this server's compaction", param=param)
    return raw.decode()


def summary_message(token: str, param: str) -> str:
    """A compaction item as the user message it renders as."""
    return SUMMARY_HEADER + decode(token, f"{param}.encrypted_content")
