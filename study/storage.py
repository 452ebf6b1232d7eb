"""Where studies are kept: a local folder, or object storage (`--storage s3://BUCKET/PREFIX`, `gs://...`) through
the pyarrow file systems that Ray Tune and Train write their own state with (credentials and endpoints as pyarrow
reads them: AWS_* variables, AWS_ENDPOINT_URL for an S3-compatible server, Google's default credentials).

A location is a string: an absolute local path, or a URI. Tune's experiment state and Train's checkpoints go to the
location directly (Ray writes them). The study's own files are worked on in a local copy (`staging_folder`), pulled
from storage before they are read and pushed back when they change; what a trial writes from any node goes
straight to storage.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from study.errors import UserError

if TYPE_CHECKING:
    import pyarrow.fs

STAGING_VARIABLE = "LAPSTUDY_STAGING"
# Where pyarrow (Ray's storage, the study's files) finds the object store: the study's Ray workers get these from
# the driver, in memory. Credentials are not among them (Ray shows a job's environment on its dashboard): each node
# has its own, from its instance profile or its environment, as Ray's own storage needs.
STORAGE_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION",
                     STAGING_VARIABLE)


# The object stores pyarrow opens (the schemes a location in them starts with): `s3:/x` or `gs:` is a URI typed
# wrong, not a local folder of that name.
OBJECT_STORE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
# How long the reachability check waits for a bucket to answer: offline, pyarrow's GCS client retries for 15 minutes
# and its S3 client waits on a silent endpoint for good.
REACH_TIMEOUT_S = 15.0


def is_remote(location: str | os.PathLike) -> bool:
    location = os.fspath(location)
    return "://" in location and urlsplit(location).scheme not in ("", "file")


def check_location(text: str, argument: str = "--storage") -> str:
    """A location as the user typed it, refused (UserError naming `argument`) when it starts like a URI in object
    storage but names no bucket (`s3://`, `gs:/b`); a URI is returned without its trailing slashes."""
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", text)
    if not (is_remote(text) or (scheme and scheme.group(1).lower() in OBJECT_STORE_SCHEMES)):
        return text
    parts = urlsplit(text)
    if not text.startswith(f"{parts.scheme}://") or not parts.netloc:
        raise UserError(f"{argument} {text}: names no bucket; give {parts.scheme or scheme.group(1)}://BUCKET/PREFIX "
                        "(or a local folder)", field=argument)
    return text.rstrip("/")


def filesystem(location: str, argument: str = "--storage") -> tuple[pyarrow.fs.FileSystem, str]:
    """The file system holding `location` and the path within it; `argument` names where the user gave it."""
    import pyarrow.fs

    if not is_remote(location):
        return pyarrow.fs.LocalFileSystem(), str(Path(location).absolute())
    try:
        return pyarrow.fs.FileSystem.from_uri(location)
    except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError, OSError) as exc:
        raise UserError(f"{argument} {location}: pyarrow cannot open it ({' '.join(str(exc).split())}); use a "
                        "local folder, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX") from None


def join(location: str, *parts: str) -> str:
    return posixpath.join(location, *parts) if is_remote(location) else str(Path(location).joinpath(*parts))


def staging_folder(location: str, purpose: str = "work") -> Path:
    """A local copy of a location in object storage, under $LAPSTUDY_STAGING or the temporary folder: the study
    driver's working copy ("work"), the same path on every machine (a resumed study's searcher reopens its Optuna
    journal where it was), or the copy the reading commands pull ("read"), which never touches a running driver's."""
    parts = urlsplit(location)
    root = Path(os.environ.get(STAGING_VARIABLE) or Path(tempfile.gettempdir()) / "lapstudy-staging")
    return root / purpose / parts.scheme / parts.netloc / parts.path.strip("/")


def check_reachable(location: str, argument: str = "--storage", timeout: float = REACH_TIMEOUT_S) -> None:
    """UserError unless the bucket of a location in object storage answers, and is there, within `timeout` seconds
    (before anything is started); `argument` names where the user gave the location.

    Asked in a process of its own, killed at the time-out: pyarrow's S3 client never gives up on an endpoint that
    accepts connections and says nothing, and the interpreter would then hang at exit finalizing it."""
    if not is_remote(location):
        return
    bucket = urlsplit(location).netloc
    ask = [sys.executable, "-c", "import sys; from study.storage import _answer; _answer(*sys.argv[1:])", location,
           argument]
    try:
        done = subprocess.run(ask, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"{argument} {location}: bucket {bucket!r} did not answer within {timeout:g} s (waited for "
                        f"{_endpoint(location)} to list it); check the network, the endpoint and the "
                        "credentials") from None
    answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {
        "error": " ".join(done.stderr.split()[-30:]) or f"exit code {done.returncode}"}
    if "refused" in answer:
        raise UserError(answer["refused"])
    if "error" in answer:
        raise UserError(f"{argument} {location}: cannot reach it ({answer['error']})")
    if not answer["found"]:
        raise UserError(f"{argument} {location}: bucket {bucket!r} not found (or not visible with these "
                        "credentials)")


def _answer(location: str, argument: str) -> None:
    """check_reachable's question, asked in its own process: one JSON line on stdout."""
    import pyarrow.fs

    try:
        fs, path = filesystem(location, argument)  # an S3 location: pyarrow asks for the bucket's region here
        answer = {"found": fs.get_file_info(path.split("/", 1)[0]).type != pyarrow.fs.FileType.NotFound}
    except UserError as exc:
        answer = {"refused": str(exc)}
    except OSError as exc:
        answer = {"error": " ".join(str(exc).split())}
    print(json.dumps(answer), flush=True)


def _endpoint(location: str) -> str:
    """Whom the storage check asks, in words: the endpoint pyarrow's client talks to for this scheme."""
    scheme = urlsplit(location).scheme
    if scheme == "s3":
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "Amazon S3"
    if scheme in ("gs", "gcs"):
        return "Google Cloud Storage (and its credentials)"
    return f"the {scheme} file system"


def has_entries(location: str) -> bool:
    import pyarrow.fs

    fs, path = filesystem(location)
    return bool(fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True)))


def write_text(location: str, text: str) -> None:
    fs, path = filesystem(location)
    fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as out:  # an object appears whole when the stream closes
        out.write(text.encode())


def upload(local: Path, location: str) -> None:
    """A local file or folder to `location` (a folder's files under it)."""
    import pyarrow.fs

    fs, path = filesystem(location)
    fs.create_dir(posixpath.dirname(path) if local.is_file() else path, recursive=True)
    pyarrow.fs.copy_files(str(local), path, source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=fs)


def download(location: str, local: Path, skip: frozenset[str] = frozenset(), only: frozenset[str] = frozenset()):
    """The files under `location` into `local` (created): those under the top-level names in `only` (all if empty),
    except those under the names in `skip`."""
    import pyarrow.fs

    fs, path = filesystem(location)
    selector = pyarrow.fs.FileSelector(path, recursive=True, allow_not_found=True)
    for info in fs.get_file_info(selector):
        relative = info.path[len(path):].lstrip("/")
        top = relative.split("/", 1)[0]
        if info.type != pyarrow.fs.FileType.File or top in skip or (only and top not in only):
            continue
        target = local / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(info.path) as source, open(target, "wb") as out:
            out.write(source.read())
