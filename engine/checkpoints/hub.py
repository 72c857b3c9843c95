"""Hugging Face Hub ids as models: downloaded by huggingface_hub when online, read from its cache offline."""

import re

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def is_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and ".." not in name


def hub_checkpoint(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot directory of `repo_id` at `revision` (a branch, tag or commit; default main)."""
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES)
    except RevisionNotFoundError:
        raise ValueError(f"revision: {revision!r} does not exist for model {repo_id!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model: {repo_id!r} is not a Hugging Face Hub repository (or it is private)") from None
    except LocalEntryNotFoundError:
        mode = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the Hub is unreachable"
        raise ValueError(
            f"model: {where} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and "
            f"{mode}; download it where the Hub is reachable (`hf download {repo_id}`) or copy "
            f"the cache"
        ) from None
    except HfHubHTTPError as e:
        raise ValueError(f"model: downloading {where} from the Hub failed: {e}") from None
