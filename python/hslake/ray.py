"""Ray Data over an hslake dataset version: ``read_hslake`` and its ``HslakeDatasource``.

    import hslake.ray
    from ray.data.expressions import col
    ds = hslake.ray.read_hslake("s3://bucket/kimi-hs", points=[30, "final_norm"],
                                columns=["sample_id", "seq_len"], where=col("seq_len") > 512)
    ds.map_batches(...)                   # layer_30, final_norm: [seq_len, hidden] each

One read task per row group (a row group is the unit a shard is written and read in); with
``override_num_blocks`` (or the older ``parallelism``) exactly that many tasks, made by joining
neighbouring row groups or cutting the largest ones into row ranges. Every task reads through the
native module (``hslake._hslake.NativeReader``): the store's checks and its one tensor decoder.

Tensors are Ray tensor columns of variable first dimension (``ArrowVariableShapedTensorType``),
one ``[seq_len, hidden]`` array per row, as numpy has them: float16 and float32 as stored,
bfloat16 widened to float32 (exactly), fp8 times its per-token scale in float32.
"""
from __future__ import annotations

import functools
import heapq
from typing import Any, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

try:
    import ray.data
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask
    from ray.data.expressions import Expr
    from ray.data.extensions import ArrowVariableShapedTensorArray, ArrowVariableShapedTensorType
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"hslake.ray needs Ray Data, which is not importable here ({e}); "
        "install it with: pip install 'hslake[ray]'"
    ) from e

from ._hslake import ConfigError, NativeReader

__all__ = ["read_hslake", "HslakeDatasource"]

# (shard, row group, first row, end row, rows in the row group): the rows one block reads.
Piece = tuple[int, int, int, int, int]

# Readers opened in this process (a Ray worker runs many tasks), by what they were opened with.
_READERS: dict[tuple, NativeReader] = {}


def _table(ipc: bytes) -> pa.Table:
    return pa.ipc.open_stream(ipc).read_all()


def _predicate(where: Any) -> Optional[pc.Expression]:
    """``where`` as a pyarrow expression: a Ray Data expression, its string form (as
    ``Dataset.filter(expr=...)`` takes it) or a pyarrow one."""
    if where is None or isinstance(where, pc.Expression):
        return where
    if isinstance(where, str):
        from ray.data._internal.planner.plan_expression.expression_evaluator import (
            ExpressionEvaluator,
        )

        try:
            where = ExpressionEvaluator.parse_native_expression(where)
        except Exception as e:
            raise ConfigError(f"where {where!r} does not parse as a Ray Data expression: {e}") from None
    if isinstance(where, Expr):
        try:
            return where.to_pyarrow()
        except Exception as e:
            raise ConfigError(f"where {where!r} has no Arrow form: {e}") from None
    raise ConfigError(
        "where: expected a Ray Data expression (ray.data.expressions.col('seq_len') > 100), "
        f"its string form ('seq_len > 100') or a pyarrow.compute.Expression, not {type(where).__name__}"
    )


def _plan(row_groups: Sequence[tuple[int, int, int, int]], blocks: Optional[int]) -> list[list[Piece]]:
    """The pieces each read task reads: one row group each, or with ``blocks`` exactly that
    many tasks (at most one per row), neighbours joined or the largest pieces halved."""
    pieces = [(s, rg, 0, rows, rows) for s, rg, rows, _ in row_groups if rows > 0]
    if blocks is None:
        return [[p] for p in pieces]
    blocks = min(blocks, sum(p[3] for p in pieces))
    if len(pieces) < blocks:
        # Halve the piece with the most rows until there are enough; keep dataset order.
        heap = [(-(p[3] - p[2]), p) for p in pieces]
        heapq.heapify(heap)
        while len(heap) < blocks:
            _, (s, rg, a, b, n) = heapq.heappop(heap)
            mid = (a + b) // 2
            heapq.heappush(heap, (-(mid - a), (s, rg, a, mid, n)))
            heapq.heappush(heap, (-(b - mid), (s, rg, mid, b, n)))
        return [[p] for p in sorted(p for _, p in heap)]
    # Join neighbours into `blocks` runs of about equal rows, each run non-empty.
    groups: list[list[Piece]] = []
    left_rows = sum(p[3] - p[2] for p in pieces)
    i = 0
    for g in range(blocks, 0, -1):
        group, rows = [], 0
        while i < len(pieces) and (not group or (rows < left_rows / g and len(pieces) - i > g - 1)):
            group.append(pieces[i])
            rows += pieces[i][3] - pieces[i][2]
            i += 1
        left_rows -= rows
        groups.append(group)
    return groups


class HslakeDatasource(Datasource):
    """A pinned version of an hslake dataset as a Ray Data source (see ``read_hslake``)."""

    def __init__(self, url: str, version: Optional[int] = None, points: Optional[Sequence[Union[int, str]]] = None,
                 columns: Optional[Sequence[str]] = None, where: Any = None, *,
                 blocks: Optional[int] = None, timeout: float = 60.0):
        super().__init__()
        if isinstance(points, (int, str)):
            points = [points]
        if isinstance(columns, str):
            columns = [columns]
        reader = NativeReader(url, version, None if columns is None else list(columns),
                              None if points is None else [str(p) for p in points], timeout)
        # Every task reads the version pinned now, whatever is committed meanwhile.
        self._key = (url, reader.version, tuple(reader.columns), tuple(reader.points), timeout)
        if not reader.columns and not reader.points:
            raise ConfigError("nothing to read: columns and points are both empty")
        self._dtype = reader.tensor_dtype
        self._row_groups = reader.row_groups()
        self._blocks = blocks
        self._where = _predicate(where)
        self._filter_columns: list[str] = []
        meta = _table(reader.schema_ipc(reader.metadata_columns)).schema
        if self._where is not None:
            # A predicate sees the columns asked for and every scalar one (ids, lengths,
            # statistics); token lists only where asked for, as they are the large ones.
            self._filter_columns = [f.name for f in meta if f.name in reader.columns
                                    or not pa.types.is_list(f.type)]
            empty = meta.empty_table().select(self._filter_columns)
            try:
                empty.filter(self._where)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, TypeError) as e:
                raise ConfigError(f"where {where!r}: {e} (it may use the columns {self._filter_columns})") from None
        self._schema = pa.schema(
            [meta.field(c) for c in reader.columns]
            + [pa.field(p, ArrowVariableShapedTensorType(pa.from_numpy_dtype(np.dtype(self._dtype)), 2))
               for p in reader.points])
        self._hidden = reader.hidden
        _READERS.setdefault(self._key, reader)
        # Pickled into every read task, so it holds nothing that grows with the dataset.
        self._reads = _Reads(self._key, self._where, self._filter_columns, self._schema)

    @property
    def version(self) -> int:
        """The pinned version every read task reads."""
        return self._key[1]

    def get_name(self) -> str:
        return "Hslake"

    def _bytes(self, rows: int, tokens: int) -> int:
        per_token = np.dtype(self._dtype).itemsize * self._hidden * len(self._key[3]) + 5
        return int(rows * 8 * len(self._key[2]) + tokens * per_token)

    def estimate_inmemory_data_size(self) -> Optional[int]:
        return sum(self._bytes(rows, tokens) for _, _, rows, tokens in self._row_groups)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: Optional[int] = None,
                       data_context: Any = None) -> list[ReadTask]:
        # Ray's own choice of parallelism is a guess from data size and CPUs; unless the caller
        # set the number of blocks, a task is a row group.
        plan = _plan(self._row_groups, parallelism if self._blocks is not None else None)
        tokens = {(s, rg): (rows, t) for s, rg, rows, t in self._row_groups}
        tasks = []
        for pieces in plan:
            rows = sum(b - a for _, _, a, b, _ in pieces)
            est_tokens = sum(tokens[(s, rg)][1] * (b - a) // max(n, 1) for s, rg, a, b, n in pieces)
            meta = BlockMetadata(
                num_rows=rows if self._where is None else None,
                size_bytes=self._bytes(rows, est_tokens),
                input_files=None,
                exec_stats=None,
            )
            # The task carries its pieces and the small `_Reads`, never the datasource: a
            # closure over `self` pickled every row group of the version into every task.
            tasks.append(ReadTask(functools.partial(self._reads.read, pieces), meta, schema=self._schema,
                                  per_task_row_limit=per_task_row_limit))
        return tasks


class _Reads:
    """What a read task needs to read its pieces: the key its reader is opened with, the
    predicate and the output schema. Each task reads through the native reader, whose first
    read of a shard holds the file's footer to the manifest's row groups (the store's
    ``check_row_groups``, as for the loader): a claim the file does not bear out raises
    ``hslake.HslakeError`` naming the file, never rows silently lost or added."""

    def __init__(self, key: tuple, where: Optional[pc.Expression], filter_columns: list[str], schema: pa.Schema):
        self.key, self.where, self.filter_columns, self.schema = key, where, filter_columns, schema

    def reader(self) -> NativeReader:
        reader = _READERS.get(self.key)
        if reader is None:
            url, version, columns, points, timeout = self.key
            reader = _READERS[self.key] = NativeReader(url, version, list(columns), list(points), timeout)
        return reader

    def read(self, pieces: list[Piece]) -> list[pa.Table]:
        tables = [self.read_piece(p) for p in pieces]
        return [tables[0] if len(tables) == 1 else pa.concat_tables(tables)]

    def read_piece(self, piece: Piece) -> pa.Table:
        reader = self.reader()
        shard, rg, a, b, n = piece
        rows: Optional[list[int]] = None if (a, b) == (0, n) else list(range(a, b))
        if self.where is not None:
            meta = _table(reader.read(shard, rg, rows, self.filter_columns, False)[0])
            meta = meta.append_column("__hslake_row", pa.array(range(a, b), pa.int64()))
            rows = meta.filter(self.where).column("__hslake_row").to_pylist()
            if not rows:
                return self.schema.empty_table()
        ipc, tensors = reader.read(shard, rg, rows, list(self.key[2]), True)
        table = _table(ipc)
        for name, dtype, hidden, buf, offsets in tensors:
            table = table.append_column(self.schema.field(name), [_tensor_column(buf, dtype, hidden, offsets)])
        return table


def _tensor_column(buf: Any, dtype: str, hidden: int, offsets: list[int]) -> pa.Array:
    """Rows ``offsets[r]..offsets[r + 1]`` of a ``[tokens, hidden]`` buffer as a Ray tensor column."""
    if len(buf) == 0:
        flat = np.empty((0, hidden), dtype=dtype)
    else:
        flat = np.frombuffer(buf, dtype=dtype).reshape(-1, hidden)
    return ArrowVariableShapedTensorArray.from_numpy([flat[s:e] for s, e in zip(offsets, offsets[1:])])


def read_hslake(url: str, version: Optional[int] = None, points: Optional[Sequence[Union[int, str]]] = None,
                columns: Optional[Sequence[str]] = None, where: Any = None, *,
                override_num_blocks: Optional[int] = None, parallelism: int = -1,
                timeout: float = 60.0, **read_args: Any) -> "ray.data.Dataset":
    """A version of an hslake dataset (default: the latest, pinned now) as a Ray Dataset.

    ``points``: capture points whose tensors to read (``2``, ``"layer_2"``, ``"final_norm"``;
    default: all), each a column of that name (``layer_2``) of ``[seq_len, hidden]`` tensors.
    ``columns``: metadata columns (``sample_id``, ``seq_len``, ``num_loss_tokens``,
    ``input_ids``, ``loss_mask``, the statistics ``<point>_norm``, ``_max_abs``,
    ``_nan_count``, ``_inf_count``; default: all). ``where``: rows to keep, a Ray Data
    expression over the metadata columns (``col("seq_len") > 100``), its string form, or a
    pyarrow expression; it is checked against the columns now, evaluated in each read task
    before any tensor is decoded, and may use the scalar columns and those asked for.

    One read task per row group; ``override_num_blocks`` (or ``parallelism``) gives exactly
    that many (at most one per row). Other keywords go to ``ray.data.read_datasource``
    (``concurrency``, ``ray_remote_args``, ...). An unknown point or column, a bad version or
    URL and a ``where`` that does not fit the columns raise ``hslake.ConfigError`` naming it.
    """
    blocks = override_num_blocks if override_num_blocks is not None else (parallelism if parallelism > 0 else None)
    if blocks is not None and (not isinstance(blocks, int) or blocks < 1):
        raise ConfigError(f"override_num_blocks {blocks!r}: expected a positive integer")
    source = HslakeDatasource(url, version, points, columns, where, blocks=blocks, timeout=timeout)
    if override_num_blocks is not None:
        read_args["override_num_blocks"] = override_num_blocks
    elif parallelism > 0:
        read_args["parallelism"] = parallelism
    return ray.data.read_datasource(source, **read_args)
