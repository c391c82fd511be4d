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
import queue
import threading
from typing import Iterator, Optional

import torch

import hslake

__all__ = ["SpeculatorsLoader", "collate_packed"]


def collate_packed(batch: dict, total_seq_len: int, dtype: torch.dtype = torch.bfloat16,
                   pin_memory: bool = False) -> dict:
    """One packed hslake batch (``[1, ΣT]`` with ``cu_seqlens``) as speculators' collate output
    (in page-locked memory with ``pin_memory``, ready for a non-blocking copy to the GPU)."""
    cu = batch["cu_seqlens"].tolist()
    # shift_batch drops each document's first token (ids, mask, positions, target) and its
    # last aux state, so document i keeps lengths[i] - 1 positions.
    kept = [max(e - s - 1, 0) for s, e in zip(cu[:-1], cu[1:])]
    m = sum(kept)
    if m > total_seq_len:
        raise hslake.ConfigError(
            f"a packed batch of {m} tokens after the shift does not fit total_seq_len "
            f"{total_seq_len}; the loader's max_tokens must not exceed it")

    ids, mask = batch["input_ids"][0], batch["loss_mask"][0]
    aux, target = batch["aux_hidden_states"][0], batch["target_hidden_states"][0]
    positions = batch["position_ids"][0]
    out_ids = torch.zeros((1, total_seq_len), dtype=torch.int64, pin_memory=pin_memory)
    out_mask = torch.zeros((1, total_seq_len), dtype=torch.int64, pin_memory=pin_memory)
    out_pos = torch.zeros((1, total_seq_len), dtype=torch.int64, pin_memory=pin_memory)
    out_doc = torch.full((1, total_seq_len), -1, dtype=torch.int64, pin_memory=pin_memory)
    # The hidden states are most of the bytes: written once, only their padding zeroed, and
    # copied as one contiguous slice per document (a boolean gather was 4x slower).
    out_aux = torch.empty((1, total_seq_len, aux.shape[-1]), dtype=dtype, pin_memory=pin_memory)
    out_tgt = torch.empty((1, total_seq_len, target.shape[-1]), dtype=dtype, pin_memory=pin_memory)
    out_aux[0, m:] = 0
    out_tgt[0, m:] = 0
    o = 0
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        k = e - s - 1
        if k <= 0:
            continue
        out_ids[0, o:o + k] = ids[s + 1:e]
        out_mask[0, o:o + k] = mask[s + 1:e]
        out_pos[0, o:o + k] = positions[s + 1:e]
        out_aux[0, o:o + k] = aux[s:e - 1]
        out_tgt[0, o:o + k] = target[s + 1:e]
        out_doc[0, o:o + k] = i
        o += k
    return {
        "input_ids": out_ids,
        "hidden_states": out_aux,
        "verifier_last_hidden_states": out_tgt,
        "loss_mask": out_mask,
        "position_ids": out_pos,
        "document_ids": out_doc,
        "error_records": 0,
    }


_DONE = object()


class SpeculatorsLoader(torch.utils.data.IterableDataset):
    """Packed, shifted speculators batches streamed from an hslake dataset.

    ``total_seq_len`` is speculators' ``--total-seq-len``: the token budget of one packed row
    (samples are packed greedily in hslake's shuffled order and truncated to it).
    ``hidden_states_dtype`` is the dtype ``CollateFn`` casts hidden states to. Other keyword
    arguments go to ``hslake.Loader`` (``rank``, ``world_size``, ``seed``, ``shuffle``,
    ``version``, ``decode_threads``, ...). ``prefetch`` batches are collated ahead by a
    background thread (0: in the caller's thread); ``pin_memory`` writes them
    into page-locked memory there (use it instead of the DataLoader's, which pins in the training
    thread). ``with_sample_ids=True`` adds the hslake ids of the
    packed samples under ``sample_ids`` (speculators' model would reject the extra key).
    """

    def __init__(self, url: str, total_seq_len: int, *, hidden_states_dtype: torch.dtype = torch.bfloat16,
                 with_sample_ids: bool = False, prefetch: int = 2, pin_memory: bool = False, **loader_kwargs):
        super().__init__()
        for bad in ("preset", "aux_layers", "target", "packed", "batch_size", "max_tokens"):
            if bad in loader_kwargs:
                raise hslake.ConfigError(
                    f"SpeculatorsLoader sets {bad} itself (speculators' layers, packed rows of "
                    f"total_seq_len tokens); leave it out")
        self.total_seq_len = int(total_seq_len)
        self.dtype = hidden_states_dtype
        self.with_sample_ids = with_sample_ids
        if int(prefetch) < 0:
            raise hslake.ConfigError(f"prefetch must be 0 or more batches, got {prefetch}")
        self.prefetch = int(prefetch)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        # The resume point after the last batch handed to the trainer (the prefetch thread
        # runs ahead of it); None: the underlying loader's own.
        self._state: Optional[dict] = None
        self.loader = hslake.Loader(url, max_tokens=self.total_seq_len, packed=True, preset="speculators",
                                    **loader_kwargs)
        self._tokens = hslake.Dataset(url).counts(self.loader.version)["num_tokens"]

    def _collated(self) -> Iterator[tuple]:
        for b in self.loader:
            out = collate_packed(b, self.total_seq_len, self.dtype, self.pin_memory)
            if self.with_sample_ids:
                out["sample_ids"] = b["sample_ids"]
            yield out, self.loader.state_dict()

    def __iter__(self) -> Iterator[dict]:
        if self.prefetch == 0:
            for out, state in self._collated():
                self._state = state
                yield out
            return
        # Collating copies every hidden state once; a thread does it while the trainer's step
        # runs (torch's copies release the GIL), as DataLoader workers do for speculators' reader.
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce():
            try:
                for item in self._collated():
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            pass
                    if stop.is_set():
                        return
                q.put(_DONE)
            except BaseException as e:  # handed to the consumer, raised there
                q.put(e)

        worker = threading.Thread(target=produce, name="hslake-speculators-collate", daemon=True)
        worker.start()
        finished = False
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    raise item
                out, self._state = item
                yield out
        finally:
            stop.set()
            worker.join()
            if not finished and self._state is not None:
                # Left mid-epoch: the next iteration starts after the last batch handed out,
                # not after the ones the thread had collated ahead.
                self.loader.load_state_dict(self._state)

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
        return self._state if self._state is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._state = None

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
        self._state = None
