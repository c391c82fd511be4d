"""hslake → speculators 0.9: batches as its training DataLoader yields them.

speculators reads one sample per row (``ArrowDataset``: aux states ``[T, 3H]``, the verifier's
last-layer states ``[T, H]`` before its final norm, token ids, loss mask), shifts each sample
by one (``models/eagle3/data.py::shift_batch``: token t+1, mask t+1 and target t+1 line up with
aux state t) and packs the samples a batch sampler grouped into one row of ``total_seq_len``
tokens (``train/data.py::CollateFn``). ``SpeculatorsLoader`` does the same from an hslake
dataset streamed by ``hslake.Loader(preset="speculators", packed=True)``, so every batch is
the dict ``CollateFn`` would return for the same samples::

    from hslake.integrations.speculators import SpeculatorsLoader
    loader = SpeculatorsLoader("s3://bucket/smollm2-hs", total_seq_len=4096, seed=0)
    train_loader = torch.utils.data.DataLoader(loader, batch_size=None)
    Trainer(model, config, train_loader).run_training()   # speculators' own Trainer

Keys, each ``[1, total_seq_len, ...]``: ``input_ids``, ``hidden_states`` (``[.., 3H]``),
``verifier_last_hidden_states`` (``[.., H]``), ``loss_mask``, ``position_ids`` (from 1 in
each document, as after ``shift_batch``), ``document_ids`` (-1 on padding), and
``error_records`` (0: hslake never substitutes an empty sample).
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

import hslake

__all__ = ["SpeculatorsLoader", "collate_packed"]


def collate_packed(batch: dict, total_seq_len: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """One packed hslake batch (``[1, ΣT]`` with ``cu_seqlens``) as speculators' collate output."""
    cu = batch["cu_seqlens"].to(torch.int64)
    starts, ends = cu[:-1], cu[1:]
    total = int(cu[-1])
    lengths = ends - starts
    # shift_batch drops each document's first token (ids, mask, positions, target) and its
    # last aux state, so document i keeps lengths[i] - 1 positions.
    pos = torch.arange(total, dtype=torch.int64)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    later = pos != starts[doc]          # every position but each document's first
    earlier = pos != ends[doc] - 1      # every position but each document's last
    kept = (lengths - 1).clamp(min=0)
    m = int(kept.sum())
    if m > total_seq_len:
        raise hslake.ConfigError(
            f"a packed batch of {m} tokens after the shift does not fit total_seq_len "
            f"{total_seq_len}; the loader's max_tokens must not exceed it")

    def pad(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros((total_seq_len, *x.shape[1:]), dtype=out_dtype)
        out[:m] = x
        return out.unsqueeze(0)

    ids, mask = batch["input_ids"][0], batch["loss_mask"][0]
    aux, target = batch["aux_hidden_states"][0], batch["target_hidden_states"][0]
    positions = batch["position_ids"][0]
    document_ids = torch.full((total_seq_len,), -1, dtype=torch.int64)
    document_ids[:m] = torch.repeat_interleave(torch.arange(len(kept)), kept)
    return {
        "input_ids": pad(ids[later], torch.int64),
        "hidden_states": pad(aux[earlier], dtype),
        "verifier_last_hidden_states": pad(target[later], dtype),
        "loss_mask": pad(mask[later], torch.int64),
        "position_ids": pad(positions[later], torch.int64),
        "document_ids": document_ids.unsqueeze(0),
        "error_records": 0,
    }


class SpeculatorsLoader(torch.utils.data.IterableDataset):
    """Packed, shifted speculators batches streamed from an hslake dataset.

    ``total_seq_len`` is speculators' ``--total-seq-len``: the token budget of one packed row
    (samples are packed greedily in hslake's shuffled order and truncated to it).
    ``hidden_states_dtype`` is the dtype ``CollateFn`` casts hidden states to. Other keyword
    arguments go to ``hslake.Loader`` (``rank``, ``world_size``, ``seed``, ``shuffle``,
    ``version``, ``decode_threads``, ...). ``with_sample_ids=True`` adds the hslake ids of the
    packed samples under ``sample_ids`` (speculators' model would reject the extra key).
    """

    def __init__(self, url: str, total_seq_len: int, *, hidden_states_dtype: torch.dtype = torch.bfloat16,
                 with_sample_ids: bool = False, **loader_kwargs):
        super().__init__()
        for bad in ("preset", "aux_layers", "target", "packed", "batch_size", "max_tokens"):
            if bad in loader_kwargs:
                raise hslake.ConfigError(
                    f"SpeculatorsLoader sets {bad} itself (speculators' layers, packed rows of "
                    f"total_seq_len tokens); leave it out")
        self.total_seq_len = int(total_seq_len)
        self.dtype = hidden_states_dtype
        self.with_sample_ids = with_sample_ids
        self.loader = hslake.Loader(url, max_tokens=self.total_seq_len, packed=True, preset="speculators",
                                    **loader_kwargs)
        self._tokens = hslake.Dataset(url).counts(self.loader.version)["num_tokens"]

    def __iter__(self) -> Iterator[dict]:
        for b in self.loader:
            out = collate_packed(b, self.total_seq_len, self.dtype)
            if self.with_sample_ids:
                out["sample_ids"] = b["sample_ids"]
            yield out

    def __len__(self) -> int:
        """Batches per epoch on this rank, estimated as tokens / total_seq_len (rounded up).

        speculators' Trainer asks for it (progress bar, LR schedule horizon); greedy packing
        leaves some room in most rows, so the true count is a little higher. Pass
        ``max_steps``/``scheduler_total_steps`` to the Trainer where the exact horizon matters.
        """
        world = self.loader.world_size
        return max(1, math.ceil(self._tokens / world / self.total_seq_len))

    # Resume and epochs: the underlying loader's.
    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
