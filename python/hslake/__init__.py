"""hslake: stream EAGLE-3 hidden states from an hslake dataset into PyTorch.

    import hslake, torch
    ds = hslake.Dataset("s3://bucket/kimi-hs")          # schema, versions, counts
    loader = hslake.Loader("s3://bucket/kimi-hs", batch_size=8, rank=rank,
                           world_size=world, seed=0, aux_layers=[2, 30, 58], target=60)
    for batch in torch.utils.data.DataLoader(loader, batch_size=None):
        batch["aux_hidden_states"]      # [B, T, 3*H] bfloat16
        ...
    state = loader.state_dict()          # resume exactly, also in another process

The native part (Rust) reads, shuffles, partitions and assembles batches on its own threads;
this wrapper only turns its buffers into torch tensors, without copies and without a
float32 detour (bf16 bits become torch.bfloat16 through a dtype view of the same memory).
"""
from __future__ import annotations

import json
from typing import Any, Optional

from ._hslake import ConfigError, HslakeError, NativeDataset, __version__
from ._hslake import build_info, export_trainer_files, loader_options, preset_points, write_synthetic

__all__ = ["Dataset", "Loader", "HslakeError", "ConfigError", "write_synthetic", "preset_points",
           "export_trainer_files", "build_info", "loader_options", "__version__"]


def __getattr__(name: str) -> Any:
    # torch is imported with the loader only: hslake.ray's workers and hslake.Dataset need none.
    if name == "Loader":
        from .loader import Loader

        globals()["Loader"] = Loader
        return Loader
    raise AttributeError(f"module 'hslake' has no attribute {name!r}")


class Dataset:
    """An hslake dataset (file://, s3://, memory:// URL or a local path): schema and counts."""

    def __init__(self, url: str, *, timeout: float = 60.0):
        self._native = NativeDataset(url, timeout)

    @property
    def url(self) -> str:
        return self._native.url

    def versions(self) -> list[int]:
        """Committed versions, oldest first."""
        return list(self._native.versions())

    def manifest(self, version: Optional[int] = None) -> dict:
        """The manifest of a version (default: latest), with a "counts" entry added."""
        return json.loads(self._native.manifest_json(version))

    @property
    def version(self) -> int:
        return self.manifest()["version"]

    @property
    def schema(self) -> dict:
        return self.manifest()["schema"]

    def counts(self, version: Optional[int] = None) -> dict:
        """num_samples, num_tokens, bytes (stored) and raw_bytes (uncompressed tensors)."""
        return self.manifest(version)["counts"]

    def __len__(self) -> int:
        return self.counts()["num_samples"]

    def __repr__(self) -> str:
        c = self.counts()
        return f"hslake.Dataset({self.url!r}, samples={c['num_samples']}, tokens={c['num_tokens']})"
