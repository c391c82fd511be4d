"""hslake → SpecForge 0.2: batches as its offline EAGLE-3 DataLoader yields them.

SpecForge stores one sample per file (``aux_hidden_state`` ``[1, T, 3H]``, ``hidden_state``
``[1, T, H]`` after the final norm, ``input_ids``, ``loss_mask``), normalises each
(``algorithms/eagle3/data.py::normalize_offline_sample``: truncate to ``max_len``, clear the
loss mask on the last token, an all-ones attention mask) and pads a batch to its longest
sample with zeros (``data/utils.py::DataCollatorWithPadding``). The shift by one happens later,
in its ``TargetHead.preprocess``. ``SpecForgeLoader`` yields the collate's dict from an hslake
dataset streamed by ``hslake.Loader(preset="specforge")``::

    from hslake.integrations.specforge import SpecForgeLoader, train_batch
    for batch in SpecForgeLoader("s3://bucket/smollm2-hs", batch_size=4, max_len=2048):
        out = strategy.forward_loss(train_batch(batch))   # SpecForge's Eagle3TrainStrategy

Keys: ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]`` (int64), ``hidden_state``
``[B, T, 3H]``, ``target`` ``[B, T, H]``.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch

import hslake

__all__ = ["SpecForgeLoader", "collate_padded", "train_batch"]


def collate_padded(batch: dict) -> dict:
    """One padded hslake batch as SpecForge's ``DataCollatorWithPadding`` output."""
    attention = batch["attention_mask"]
    loss_mask = batch["loss_mask"].clone()
    lengths = attention.sum(dim=1)
    rows = torch.nonzero(lengths > 0).flatten()
    # normalize_offline_sample: no loss on each sample's last token (nothing follows it).
    loss_mask[rows, lengths[rows] - 1] = 0
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "hidden_state": batch["aux_hidden_states"],
        "target": batch["target_hidden_states"],
    }


def train_batch(batch: dict, sample_ids: Optional[Sequence] = None):
    """The collate dict as SpecForge's ``TrainBatch`` for ``Eagle3TrainStrategy.forward_loss``
    (target given as the final-norm hidden state, projected by its ``TargetHead``)."""
    from specforge.runtime.contracts import TrainBatch

    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "sample_ids"}
    ids = sample_ids if sample_ids is not None else batch.get("sample_ids", torch.empty(0)).tolist()
    return TrainBatch(sample_ids=[str(i) for i in ids], strategy="eagle3", tensors=tensors,
                      metadata={"target_repr": "hidden_state"})


class SpecForgeLoader(torch.utils.data.IterableDataset):
    """Padded SpecForge batches streamed from an hslake dataset.

    ``batch_size`` samples per batch, each truncated to ``max_len`` tokens (SpecForge's
    ``--max-length``). Other keyword arguments go to ``hslake.Loader``. ``with_sample_ids=True``
    adds the batch's hslake sample ids under ``sample_ids``.
    """

    def __init__(self, url: str, batch_size: int, max_len: int = 2048, *, with_sample_ids: bool = False,
                 **loader_kwargs):
        super().__init__()
        for bad in ("preset", "aux_layers", "target", "packed", "max_tokens", "max_seq_len", "pad_token_id"):
            if bad in loader_kwargs:
                raise hslake.ConfigError(
                    f"SpecForgeLoader sets {bad} itself (SpecForge's layers, zero padding, "
                    f"max_len truncation); leave it out")
        self.with_sample_ids = with_sample_ids
        self.loader = hslake.Loader(url, batch_size=batch_size, max_seq_len=max_len, pad_token_id=0,
                                    preset="specforge", **loader_kwargs)

    def __iter__(self) -> Iterator[dict]:
        for b in self.loader:
            out = collate_padded(b)
            if self.with_sample_ids:
                out["sample_ids"] = b["sample_ids"]
            yield out

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
