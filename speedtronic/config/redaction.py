"""Config values as plain data, and secrets taken out of them before anything is written.

Used by :meth:`SpeedtronicConfig.to_dict`, hence by ``config.yaml`` in the run directory,
checkpoints, W&B and the resume check. It imports only ``errors`` (the URL pattern it shares
with the CLI's message masking), so the schema and the loader can both depend on it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from ..errors import URL_USERINFO

__all__ = ["REDACTED", "redact", "to_plain", "url_has_credentials"]

REDACTED = "<redacted>"

# Key names that hold credentials ("num_tokens" is not one: match whole words only).
_SECRET_KEY = re.compile(r"(^|_)(token|secret|password|api_key|access_key|secret_key)$")
_URL_USERINFO = URL_USERINFO  # shared with the CLI's message masking (errors.mask_secrets)


_URL_CREDENTIALS = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^@\s/]*(:[^@\s]*)?@|"
                              r"^[A-Za-z][A-Za-z0-9+.-]*://[^@\s]*:[^@\s]*@")


def url_has_credentials(url: str) -> bool:
    """``scheme://user:secret@host...`` (the secret may hold '/', which ends a URL's authority
    for ``urllib``), or ``scheme://user@host``."""
    return bool(_URL_CREDENTIALS.match(url))


def to_plain(value: Any) -> Any:
    """Dataclasses, paths, tuples -> dicts, strings, lists (JSON/YAML-safe)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"<{type(value).__name__} object>"  # a live dataset passed from Python


def redact(value: Any) -> Any:
    """Replace values under secret-looking keys and credentials embedded in URLs."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if item and isinstance(item, str) and _SECRET_KEY.search(str(key).lower()):
                out[key] = REDACTED
            else:
                out[key] = redact(item)
        return out
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _URL_USERINFO.sub(rf"\1{REDACTED}@", value)
    return value
