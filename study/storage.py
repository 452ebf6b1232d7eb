"""Where studies are kept: a local folder, or object storage (`--storage s3://BUCKET/PREFIX`, `gs://...`) through
the pyarrow file systems that Ray Tune and Train write their own state with (credentials and endpoints as pyarrow
reads them: AWS_* variables, AWS_ENDPOINT_URL for an S3-compatible server, Google's default credentials).

A location is a string: an absolute local path, or a URI. Tune's experiment state and Train's checkpoints go to the
location directly (Ray writes them). The study's own files are worked on in a local copy (`staging_folder`), pulled
from storage before they are read and pushed back when they change; what a trial writes from any node goes
straight to storage.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.fs

from study.errors import UserError

STAGING_VARIABLE = "LAPSTUDY_STAGING"
# Where pyarrow (Ray's storage, the study's files) finds the object store: the study's Ray workers get these from
# the driver, in memory. Credentials are not among them (Ray shows a job's environment on its dashboard): each node
# has its own, from its instance profile or its environment, as Ray's own storage needs.
STORAGE_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION",
                     STAGING_VARIABLE)


def is_remote(location: str | os.PathLike) -> bool:
    location = os.fspath(location)
    return "://" in location and urlsplit(location).scheme not in ("", "file")


def filesystem(location: str, argument: str = "--storage") -> tuple[pyarrow.fs.FileSystem, str]:
    """The file system holding `location` and the path within it; `argument` names where the user gave it."""
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


def check_reachable(location: str, argument: str = "--storage") -> None:
    """UserError unless the bucket of a location in object storage can be read (before anything is started);
    `argument` names where the user gave the location."""
    if not is_remote(location):
        return
    fs, path = filesystem(location, argument)
    bucket = path.split("/", 1)[0]
    try:
        found = fs.get_file_info(bucket).type != pyarrow.fs.FileType.NotFound
    except OSError as exc:
        raise UserError(f"{argument} {location}: cannot reach it ({' '.join(str(exc).split())})") from None
    if not found:
        raise UserError(f"{argument} {location}: bucket {bucket!r} not found (or not visible with these "
                        "credentials)")


def has_entries(location: str) -> bool:
    fs, path = filesystem(location)
    return bool(fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True)))


def write_text(location: str, text: str) -> None:
    fs, path = filesystem(location)
    fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as out:  # an object appears whole when the stream closes
        out.write(text.encode())


def upload(local: Path, location: str) -> None:
    """A local file or folder to `location` (a folder's files under it)."""
    fs, path = filesystem(location)
    fs.create_dir(posixpath.dirname(path) if local.is_file() else path, recursive=True)
    pyarrow.fs.copy_files(str(local), path, source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=fs)


def download(location: str, local: Path, skip: frozenset[str] = frozenset(), only: frozenset[str] = frozenset()):
    """The files under `location` into `local` (created): those under the top-level names in `only` (all if empty),
    except those under the names in `skip`."""
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
