"""LoRARequest: which adapter a request runs with, carried from the front end to the model runner."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """name: what the API calls the adapter (the request's `model`); id: > 0, unique per registration in one
    engine; path: the adapter's source as given (a local directory or a Hub id)."""

    name: str
    id: int
    path: str

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"lora_request.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.id, int) or isinstance(self.id, bool) or self.id < 1:
            raise ValueError(f"lora_request.id must be a positive integer, got {self.id!r}")
        if not self.path or not isinstance(self.path, str):
            raise ValueError(f"lora_request.path must be a non-empty string, got {self.path!r}")

    @property
    def cache_key(self) -> str:
        """What seeds the prefix-cache keys of its requests: two adapters never share KV blocks."""
        return lora_cache_key(self.name, self.path)


def lora_cache_key(name: str, path: str) -> str:
    """LoRARequest.cache_key from the adapter's name and path (the HTTP router has no engine ids)."""
    return f"{name}\x00{path}"
