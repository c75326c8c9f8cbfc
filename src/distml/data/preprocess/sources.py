"""Where a preprocessing job's input comes from, and how it is cut into shards.

The coordinator *plans* (cuts the input into :class:`Shard` descriptions: small JSON-able dicts);
a worker *reads* one shard into a :class:`pyarrow.Table` on its own machine. Nothing but the
description travels, so a worker needs the input at the same path (or URL) as the coordinator.

- files: a folder or a glob; each shard is ``files_per_shard`` paths, handed to the transform as
  a one-column table ``path`` (the transform opens them). A link that leads out of the folder
  (or out of the glob's fixed part) is refused: a worker reads only inside the input.
- CSV: byte ranges cut at line ends (the way Dask's ``read_csv`` cuts blocks), each read with the
  header and the column types of the first block, so every shard has the same schema. A quoted
  field holding a newline can be cut in two: such files need ``blocksize`` large enough to hold
  them in one block, or conversion to Parquet first.
- Parquet: row groups, ``row_groups_per_shard`` at a time, from one or more files.
- SQL: a table read through SQLAlchemy in pages of ``rows_per_shard`` rows, ordered by a key
  column (``ORDER BY key LIMIT n OFFSET k``), so the same shard always holds the same rows. The
  table and key are checked against the database's own catalogue before any query is built.

>>> shards = plan(CsvSource(path="rows.csv", blocksize=1 << 20))  # doctest: +SKIP
>>> read_shard(shards[0]).num_rows                                # doctest: +SKIP
"""

from __future__ import annotations

import glob
import io
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

# SQLAlchemy (an optional extra) is imported only by the SQL source's functions.

Shard = dict[str, Any]  # {"id": int, "kind": ..., what the reader needs}


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FilesSource(_Source):
    kind: Literal["files"] = "files"
    pattern: str  # a folder (every file in it, recursively) or a glob
    files_per_shard: Annotated[int, Field(ge=1)] = 16


class CsvSource(_Source):
    kind: Literal["csv"] = "csv"
    path: str
    blocksize: Annotated[int, Field(ge=1024)] = 16 * 2**20


class ParquetSource(_Source):
    kind: Literal["parquet"] = "parquet"
    paths: list[str]
    row_groups_per_shard: Annotated[int, Field(ge=1)] = 1


class SqlSource(_Source):
    kind: Literal["sql"] = "sql"
    url: str  # a SQLAlchemy URL: sqlite:///rows.db, postgresql://...
    table: str
    key: str
    rows_per_shard: Annotated[int, Field(ge=1)] = 100_000

    def safe_url(self) -> str:
        """The URL without its password: what messages, the job's record and the shards handed
        to workers say. A worker connects with the password of its own environment."""
        return without_password(self.url)

    def password(self) -> str | None:
        from sqlalchemy.engine import make_url

        return make_url(self.url).password


SQL_PASSWORD_ENV = "DISTML_SQL_PASSWORD"


def without_password(url: str) -> str:
    """A SQLAlchemy URL with no password in it (not even a mask), as text."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    return parsed._replace(password=None).render_as_string(hide_password=False)


def connect_url(url: str):
    """The URL to connect with: ``url``, with the password of ``DISTML_SQL_PASSWORD`` when it
    names none and the variable is set (drivers' own variables, as ``PGPASSWORD``, work too)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    password = os.environ.get(SQL_PASSWORD_ENV)
    if parsed.password is None and password:
        parsed = parsed.set(password=password)
    return parsed


Source = Annotated[FilesSource | CsvSource | ParquetSource | SqlSource, Field(discriminator="kind")]


class SourceError(ValueError):
    """The input cannot be planned: missing, empty, or not what its kind says."""


def plan(source: Source) -> list[Shard]:
    """Cut ``source`` into shards, numbered from 0 in input order."""
    shards = _PLANNERS[source.kind](source)
    if not shards:
        raise SourceError(f"{_describe(source)} holds no input")
    return [{"id": i, **shard} for i, shard in enumerate(shards)]


def read_shard(shard: Shard) -> pa.Table:
    return _READERS[shard["kind"]](shard)


def _describe(source: Source) -> str:
    if isinstance(source, SqlSource):
        return f"table {source.table!r} at {source.safe_url()}"
    if isinstance(source, ParquetSource):
        return ", ".join(source.paths)
    return source.pattern if isinstance(source, FilesSource) else source.path


# -- files ---------------------------------------------------------------------------------------


def files_root(pattern: str) -> Path:
    """The folder every file of ``pattern`` lies in, resolved: the pattern itself when it is a
    folder, else its part before the first wildcard."""
    path = Path(pattern)
    if not path.is_dir():
        fixed = _until_magic(path.parts)
        path = Path(*fixed) if fixed else Path(".")
    return path.resolve()


def _until_magic(parts: tuple[str, ...]) -> list[str]:
    fixed = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return fixed


def inside(path: Path, root: Path) -> bool:
    """Whether ``path``, once its links and ``..`` are resolved, lies in the resolved ``root``."""
    return path.resolve().is_relative_to(root)


def _plan_files(source: FilesSource) -> list[Shard]:
    root = Path(source.pattern)
    if root.is_dir():
        paths = sorted(str(p) for p in root.rglob("*") if p.is_file())
    else:
        paths = sorted(p for p in glob.glob(source.pattern, recursive=True) if os.path.isfile(p))
    top = files_root(source.pattern)
    for path in paths:
        if not inside(Path(path), top):
            raise SourceError(f"{path} links outside the input folder {top}: copy it in instead")
    n = source.files_per_shard
    return [{"kind": "files", "paths": paths[i : i + n]} for i in range(0, len(paths), n)]


def _read_files(shard: Shard) -> pa.Table:
    return pa.table({"path": pa.array(shard["paths"], pa.string())})


# -- CSV -----------------------------------------------------------------------------------------


def _plan_csv(source: CsvSource) -> list[Shard]:
    path = Path(source.path)
    if not path.is_file():
        raise SourceError(f"no CSV file at {path}")
    size = path.stat().st_size
    with path.open("rb") as f:
        header_end = len(f.readline())
        cuts = [header_end]
        while cuts[-1] < size:
            f.seek(min(cuts[-1] + source.blocksize, size))
            f.readline()  # to the end of the line the cut fell in
            cuts.append(min(f.tell(), size))
    if len(cuts) < 2:  # a header and no rows (or an empty file): no shard to plan
        return []
    first = {"kind": "csv", "path": str(path), "header": header_end}
    types = _column_types(read_shard({**first, "start": cuts[0], "end": cuts[1], "types": {}}))
    return [
        {**first, "start": a, "end": b, "types": types}
        for a, b in zip(cuts, cuts[1:], strict=False)
        if b > a
    ]


def _column_types(table: pa.Table) -> dict[str, str]:
    return {f.name: str(f.type) for f in table.schema}


def _read_csv(shard: Shard) -> pa.Table:
    with open(shard["path"], "rb") as f:
        header = f.read(shard["header"])
        f.seek(shard["start"])
        body = f.read(shard["end"] - shard["start"])
    types = {name: pa.type_for_alias(t) for name, t in shard["types"].items()}
    return pacsv.read_csv(
        io.BytesIO(header + body), convert_options=pacsv.ConvertOptions(column_types=types)
    )


# -- Parquet -------------------------------------------------------------------------------------


def _plan_parquet(source: ParquetSource) -> list[Shard]:
    shards = []
    for path in source.paths:
        if not Path(path).is_file():
            raise SourceError(f"no Parquet file at {path}")
        groups = pq.ParquetFile(path).metadata.num_row_groups
        step = source.row_groups_per_shard
        shards += [
            {"kind": "parquet", "path": path, "row_groups": list(range(g, min(g + step, groups)))}
            for g in range(0, groups, step)
        ]
    return shards


def _read_parquet(shard: Shard) -> pa.Table:
    return pq.ParquetFile(shard["path"]).read_row_groups(shard["row_groups"])


# -- SQL -----------------------------------------------------------------------------------------


def _sql_table(url: str, table: str, key: str):
    """The engine and the reflected table, refusing names the database does not have."""
    import sqlalchemy as sa

    engine = sa.create_engine(connect_url(url))
    meta = sa.MetaData()
    try:
        t = sa.Table(table, meta, autoload_with=engine)
    except sa.exc.NoSuchTableError:
        raise SourceError(f"the database has no table {table!r}") from None
    if key not in t.columns:
        raise SourceError(f"table {table!r} has no column {key!r}; it has {list(t.columns.keys())}")
    return engine, t


def _plan_sql(source: SqlSource) -> list[Shard]:
    import sqlalchemy as sa

    engine, t = _sql_table(source.url, source.table, source.key)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
    engine.dispose()
    n = source.rows_per_shard
    where = {"kind": "sql", "url": source.safe_url(), "table": source.table, "key": source.key}
    return [{**where, "offset": k, "limit": n} for k in range(0, rows, n)]


def _read_sql(shard: Shard) -> pa.Table:
    import sqlalchemy as sa

    engine, t = _sql_table(shard["url"], shard["table"], shard["key"])
    query = sa.select(t).order_by(t.c[shard["key"]]).offset(shard["offset"]).limit(shard["limit"])
    with engine.connect() as conn:
        result = conn.execute(query)
        columns = list(result.keys())
        rows = result.fetchall()
    engine.dispose()
    return pa.table({c: [row[i] for row in rows] for i, c in enumerate(columns)})


_PLANNERS = {"files": _plan_files, "csv": _plan_csv, "parquet": _plan_parquet, "sql": _plan_sql}
_READERS = {"files": _read_files, "csv": _read_csv, "parquet": _read_parquet, "sql": _read_sql}
