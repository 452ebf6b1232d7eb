"""Files a dataset part fetches once from a URL when its local path is missing (nanochat's word list and identity
conversations), as nanochat's `download_file_with_lock` does. The file appears whole or not at all: each fetch
writes its own temporary file beside the path and renames it into place, so concurrent readers (Ray Data tasks on
one node) never see half a file, whoever finishes first."""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.request
from urllib.parse import urlparse

from study.data.hub import probe_url
from study.errors import UserError


def check_fetchable(path: str, url: str | None, field: str, what: str) -> None:
    """Before Ray: `path` is a file, or its `url` answers (a one-line error naming the offline alternative)."""
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        return
    if url is None:
        raise UserError(f"{field}: {path} does not exist ({what})")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise UserError(f"{field.rsplit('.', 1)[0]}.url: must be an http(s) URL, got {url!r}")
    reachable, why = probe_url(url)
    if not reachable:
        raise UserError(f"{field}: {path} is missing and {url} cannot be fetched ({why}); offline, copy the file "
                        f"there or set the path to a local copy ({what})")


def fetch_once(path: str, url: str | None) -> str:
    """The local file at `path` (user-expanded), fetched from `url` first if it is missing."""
    path = os.path.expanduser(path)
    if os.path.isfile(path) or url is None:
        return path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=os.path.basename(path) + ".",
                                       suffix=".part")
    try:
        with os.fdopen(handle, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
            shutil.copyfileobj(response, out)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path
