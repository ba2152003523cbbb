"""Hugging Face model ids (`org/name`) resolved to snapshots already in the local Hugging Face
cache. Nothing is downloaded: serving never reaches the network (HF_HUB_OFFLINE semantics)."""
from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id


def hub_cache_dir() -> Path:
    """The cache huggingface_hub uses: HF_HUB_CACHE, else HF_HOME/hub, else its default. Read
    from the environment at each call, not once at import as huggingface_hub's constants."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def is_repo_id(name: str) -> bool:
    """`org/name` as the Hub spells repositories (a relative path could look the same; callers
    try the path first)."""
    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot directory of `repo_id` (refs/main unless `revision`), or a ValueError
    that says where it looked and how to download the model."""
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        raise ValueError(
            f"model {repo_id!r} is not a local path and is not in the Hugging Face cache "
            f"({cache}, set by HF_HUB_CACHE or HF_HOME); liteinfer does not download models: "
            f"huggingface-cli download {repo_id}") from None
