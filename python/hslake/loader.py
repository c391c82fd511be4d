"""hslake.Loader: the native loader's batches as torch tensors (re-exported as ``hslake.Loader``)."""
from __future__ import annotations

import json
import os
import textwrap
from typing import Any, Iterator, Optional, Sequence

import torch

from ._hslake import ConfigError, NativeLoader, loader_options

_DTYPES = {
    "int64": torch.int64,
    "int32": torch.int32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

# Native objects inherited through fork (e.g. by torch DataLoader workers): their runtime's
# threads exist only in the parent, and dropping them would wait for those threads forever,
# so a child keeps them referenced instead.
_FORK_ORPHANS: list = []


def _tensor(buf: Any, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    td = _DTYPES[dtype]
    if len(buf) == 0:
        return torch.empty(tuple(shape), dtype=td)
    # frombuffer shares the buffer's memory (the tensor keeps the buffer alive).
    return torch.frombuffer(buf, dtype=td).reshape(tuple(shape))


class Loader(torch.utils.data.IterableDataset):
    """EAGLE-3 batches from an hslake dataset, as dicts of torch tensors.

    Give exactly one of ``batch_size`` (samples per batch) or ``max_tokens`` (token budget:
    B x T padded, or the packed length). Keys: ``input_ids``, ``loss_mask``,
    ``position_ids`` [B, T] (int64); ``attention_mask`` [B, T] (padded) or ``cu_seqlens``
    [n+1] (int32) and ``document_ids`` [1, T] (``packed=True``); ``aux_hidden_states``
    [B, T, k*H] (``aux_layers`` concatenated in the given order); ``target_hidden_states``
    [B, T, H]; ``sample_ids`` [B]. bf16 stays bf16.

    ``preset="speculators"`` or ``"specforge"`` picks a trainer's aux layers and target from
    the dataset's layer count (see ``hslake.preset_points``) in place of ``aux_layers`` and
    ``target``; a dataset lacking one of them is refused with what is missing.

    Order: a shuffle fixed by (seed, epoch) on every machine: the window shuffle (default;
    row groups permuted, samples permuted within ``shuffle_window`` row groups), or with
    ``shuffle_mode="sample"`` a full per-sample permutation, read in lookaheads of
    ``lookahead_bytes`` (memory holds about one lookahead); rank r of ``world_size`` reads
    a disjoint part; the remainder is padded by repeating samples (``drop_last=False``, as
    torch's DistributedSampler) or dropped. Iterating runs one epoch from the current state;
    the next ``iter()`` continues (the next epoch after a full pass).

    The keyword arguments are the native loader's options, listed under "Options" below with
    their defaults from its one declaration of them (``hslake.loader_options()``); an unknown
    name is refused.

    ``state_dict()`` after any batch, given to ``load_state_dict()`` of a loader with the
    same settings (in any process), continues with exactly the next batch. Exact resume is
    tracked with ``num_workers=0`` in a torch DataLoader (decoding already runs on
    ``decode_threads`` native threads); with DataLoader workers each worker reads a disjoint
    part of the rank's samples, but the state is not tracked.
    """

    def __init__(
        self,
        url: str,
        batch_size: Optional[int] = None,
        max_tokens: Optional[int] = None,
        *,
        pin_memory: bool = False,
        **options: Any,
    ):
        super().__init__()
        self.url = url
        # Only what the caller gave: the native loader holds every default and refuses unknown
        # names and values of the wrong type, naming them.
        given = {"batch_size": batch_size, "max_tokens": max_tokens}
        self._options = {k: v for k, v in given.items() if v is not None}
        self._options.update(options)
        self.pin_memory = pin_memory
        # Opening here checks every argument against the dataset at once (bad rank, missing
        # layer, unknown version, unreachable store): errors surface at construction.
        self._native: Optional[NativeLoader] = None
        self._pid = (-1, 0, 1)
        native = self._get_native()
        if self._options.get("version") is None:
            # Pin the version seen now, so every worker and every resume reads the same one.
            self._options["version"] = native.version
        self._state: str = native.initial_state()

    # The native loader owns threads, which do not survive fork: each process opens its own.
    def _get_native(self, worker: int = 0, num_workers: int = 1) -> NativeLoader:
        want = (os.getpid(), worker, num_workers)
        if self._native is None or self._pid != want:
            if self._native is not None and self._pid[0] != want[0]:
                _FORK_ORPHANS.append(self._native)
            options = dict(self._options, worker=worker, num_workers=num_workers)
            try:
                text = json.dumps(options)
            except TypeError as e:
                raise ConfigError(f"loader options must be numbers, strings, booleans or lists: {e}") from None
            self._native = NativeLoader(self.url, text)
            self._pid = want
        return self._native

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_native"] = None
        d["_pid"] = (-1, 0, 1)
        return d

    @property
    def version(self) -> int:
        """The pinned dataset version."""
        return self._get_native().version

    @property
    def world_size(self) -> int:
        """Ranks the samples are split over (the ``world_size`` option, 1 by default)."""
        return self._get_native().world_size

    @property
    def aux_layers(self) -> list[str]:
        return list(self._get_native().aux_layers)

    @property
    def target(self) -> str:
        return self._get_native().target

    @property
    def epoch(self) -> int:
        return self._get_native().state_epoch(self._state)

    def samples_per_epoch(self) -> int:
        """Samples this rank visits per epoch (after padding or dropping)."""
        return self._get_native().samples_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of ``epoch`` (as DistributedSampler)."""
        self._state = self._get_native().epoch_state(int(epoch))

    def stats(self) -> dict:
        """Row groups read and skipped, samples skipped, batches assembled (this process)."""
        return dict(self._get_native().stats())

    def state_dict(self) -> dict:
        """A small JSON-serialisable resume point: after the last batch yielded."""
        return json.loads(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict() of a loader with the same settings."""
        s = json.dumps(state)
        # Checked now (settings, format) rather than at the next iteration.
        self._get_native().check_state(s)
        self._state = s

    def _batch(self, fields) -> dict:
        out = {}
        for name, dtype, shape, buf in fields:
            t = _tensor(buf, dtype, shape)
            if self.pin_memory and torch.cuda.is_available():
                t = t.pin_memory()
            out[name] = t
        return out

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            native = self._get_native(info.id, info.num_workers)
            state = native.epoch_state(native.state_epoch(self._state))
        else:
            native = self._get_native()
            state = self._state
        stream = native.start(state)
        while True:
            item = stream.next()
            if item is None:
                if info is None or info.num_workers <= 1:
                    self._state = stream.state()
                return
            fields, state = item
            if info is None or info.num_workers <= 1:
                self._state = state
            yield self._batch(fields)

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"hslake.Loader({self.url!r}, {given})"


def _options_doc() -> str:
    """The "Options" section of Loader's docstring: each native option, its default, its doc."""
    lines = ["", "    Options:", ""]
    for name, default, doc in loader_options():
        entry = f"``{name}={json.loads(default)!r}``: {doc}"
        lines.append(textwrap.fill(entry, width=96, initial_indent="    ", subsequent_indent="        "))
    return "\n".join(lines) + "\n"


Loader.__doc__ = (Loader.__doc__ or "") + _options_doc()
