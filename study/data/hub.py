"""Hugging Face hub access: a fast offline check, the token from the environment, and the parquet files of a split.

Every hub source reads the dataset's parquet files with `ray.data.read_parquet` (streamed, one read task per file
fragment), whether they live on the hub (`hf://` paths through `huggingface_hub.HfFileSystem`) or in a local copy of
the hub repository (`local_dir`, or `$LAPSTUDY_DATA_DIR/<owner>/<name>`): the same code path either way.

The token of gated datasets (ImageNet-1k) is read from `HF_TOKEN` when the files are opened and handed to the
filesystem object only; it is never part of a config, a param, an exported file or a log line.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

from study.errors import UserError

PROBE_TIMEOUT_S = 3.0
MIRROR_ENV = "LAPSTUDY_DATA_DIR"
# What to use instead when the hub cannot be reached.
OFFLINE_SOURCES = ("parquet (local shards), image_folder, text_files, digits, pydoc_text, shapes_segmentation, "
                   "toy_translation")


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def offline_flag() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _connect(host: str, port: int, timeout: float) -> None:
    socket.create_connection((host, port), timeout=timeout).close()


def hub_reachable() -> tuple[bool, str]:
    """(reachable, why not) within PROBE_TIMEOUT_S."""
    if offline_flag():
        return False, "HF_HUB_OFFLINE is set"
    return probe_url(hub_endpoint())


def probe_url(url: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """probe() of the host and port of an http(s) URL (the scheme's port when it names none)."""
    parsed = urlparse(url)
    return probe(parsed.hostname or "", parsed.port or (443 if parsed.scheme == "https" else 80), timeout)


def probe(host: str, port: int = 443, timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """(reachable, why not) within `timeout`, the DNS lookup included (run in a thread: it has no timeout)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(_connect, host, port, timeout).result(timeout=timeout + 0.5)
        return True, ""
    except concurrent.futures.TimeoutError:
        return False, f"{host} did not answer within {timeout:.0f} s"
    except OSError as error:
        return False, f"{host}: {error.strerror or type(error).__name__}"
    finally:
        pool.shutdown(wait=False)


def require_hub(source: str, what: str) -> None:
    """Fail within seconds, with one line naming the offline alternatives, when the hub cannot be reached."""
    reachable, why = hub_reachable()
    if not reachable:
        raise UserError(
            f"dataset.source: {source} streams {what} from the Hugging Face hub, which is not reachable ({why}); "
            f"offline, use source: {OFFLINE_SOURCES}, or set dataset.local_dir (or ${MIRROR_ENV}) to a local copy "
            "of the hub repository"
        )


def hf_token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


@dataclass(frozen=True)
class HubFiles:
    """The parquet files of each split, and the filesystem that opens them (local or the hub's)."""

    splits: dict[str, list[str]]
    filesystem: object | None  # a pyarrow filesystem for hub files, None for local paths
    features: dict | None  # the dataset's declared features (`datasets` Features as a dict), if any
    local: bool

    def files(self, split: str, field_name: str) -> list[str]:
        if split not in self.splits:
            raise UserError(
                f"dataset.{field_name}: split {split!r} does not exist; "
                f"the dataset has {', '.join(sorted(self.splits))}"
            )
        return self.splits[split]


def local_copy(hub_id: str, local_dir: str | None) -> str | None:
    """The local copy to read instead of the hub: local_dir, else $LAPSTUDY_DATA_DIR/<hub id> when it exists."""
    if local_dir:
        path = os.path.expanduser(local_dir)
        if not os.path.isdir(path):
            raise UserError(f"dataset.local_dir: {local_dir} is not a folder (a local copy of the hub repository)")
        return path
    mirror = os.environ.get(MIRROR_ENV)
    if mirror and os.path.isdir(os.path.join(mirror, hub_id)):
        return os.path.join(mirror, hub_id)
    return None


def resolve_parquet_files(hub_id: str, *, config_name: str | None, revision: str | None, local_dir: str | None,
                          source: str, what: str) -> HubFiles:
    """Ask `datasets` which parquet files make each split of (hub_id, config_name), locally or on the hub."""
    import datasets

    local = local_copy(hub_id, local_dir)
    if local is None:
        require_hub(source, what)
    datasets.logging.set_verbosity_error()
    try:
        builder = datasets.load_dataset_builder(
            local or hub_id, name=config_name, revision=None if local else revision,
            token=None if local else hf_token(),
        )
    except (FileNotFoundError, ValueError) as error:
        # a partial local copy (say only sample/10BT of FineWeb-Edu) makes `datasets` fail on the other configs
        builder = _config_of_partial_copy(local, config_name) if local else None
        if builder is None:
            where = local or hub_id
            raise UserError(
                f"dataset: cannot open {where!r} (config {config_name!r}): {str(error).splitlines()[0]}"
            ) from None
    except Exception as error:  # gated/unauthorised datasets surface as hub HTTP errors
        if "gated" in str(error).lower() or "401" in str(error) or "403" in str(error):
            raise UserError(
                f"dataset: {hub_id} is gated: accept its terms on the hub and export HF_TOKEN "
                "with a token that has access"
            ) from None
        raise
    data_files = builder.config.data_files if not isinstance(builder, dict) else builder
    data_files = data_files or {}
    splits = {str(split): sorted(str(f) for f in files) for split, files in data_files.items()}
    splits = {split: files for split, files in splits.items() if files}
    if not splits or not all(f.endswith(".parquet") for files in splits.values() for f in files):
        raise UserError(f"dataset: {local or hub_id} has no parquet files to stream "
                        f"(found {sum(map(len, splits.values()))} files)")
    info = getattr(builder, "info", None)
    features = info.features.to_dict() if info is not None and info.features is not None else None
    filesystem = None
    if any(f.startswith("hf://") for files in splits.values() for f in files):
        import pyarrow.fs
        from huggingface_hub import HfFileSystem

        filesystem = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(HfFileSystem(token=hf_token())))
        splits = {split: [f.removeprefix("hf://") for f in files] for split, files in splits.items()}
    return HubFiles(splits=splits, filesystem=filesystem, features=features, local=local is not None)


def _config_of_partial_copy(local: str, config_name: str | None) -> dict | None:
    """The data files of one config of a local copy, from the `configs:` of its README (the dataset card), resolved
    with `datasets`' own pattern matching; None when the card does not declare the config."""
    import yaml
    from datasets.data_files import DataFilesDict

    card = os.path.join(local, "README.md")
    if not os.path.isfile(card):
        return None
    text = open(card, encoding="utf-8").read()
    if not text.startswith("---"):
        return None
    meta = yaml.safe_load(text.split("---", 2)[1]) or {}
    configs = meta.get("configs") or []
    chosen = next((c for c in configs if c.get("config_name") == config_name), None) if config_name else (
        next((c for c in configs if c.get("default")), configs[0] if configs else None))
    if not chosen:
        return None
    patterns = {}
    for entry in chosen.get("data_files") or []:
        paths = entry["path"] if isinstance(entry["path"], list) else [entry["path"]]
        patterns[entry["split"]] = paths
    try:
        return dict(DataFilesDict.from_patterns(patterns, base_path=local))
    except FileNotFoundError:
        return None
