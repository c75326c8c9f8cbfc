"""What the coordinator and its workers say to each other, as pydantic models with bounds: the
coordinator validates every request body with them (and FastAPI declares them in the OpenAPI
document), a worker every answer. Neither side acts on a field the other made up: a shard
names only what a plan can, an attempt ID only digits.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

WorkerId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[\w.:@-]+$")]
AttemptId = Annotated[str, Field(pattern=r"^\d{1,18}\.\d{1,18}$", max_length=40)]
ShardId = Annotated[int, Field(ge=0, le=2**40)]
Offset = Annotated[int, Field(ge=0, le=2**62)]
PathText = Annotated[str, Field(min_length=1, max_length=4096)]
Name = Annotated[str, Field(min_length=1, max_length=1000)]
MAX_SHARD_ITEMS = 100_000
MAX_ERROR = 20_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerBody(_Strict):
    worker: WorkerId


class AttemptBody(_Strict):
    worker: WorkerId
    attempt: AttemptId


class FailBody(AttemptBody):
    error: Annotated[str, Field(max_length=4000)]


class FilesShard(_Strict):
    id: ShardId
    kind: Literal["files"]
    paths: Annotated[list[PathText], Field(max_length=MAX_SHARD_ITEMS)]


class CsvShard(_Strict):
    id: ShardId
    kind: Literal["csv"]
    path: PathText
    header: Offset
    start: Offset
    end: Offset
    types: Annotated[dict[Name, Name], Field(max_length=MAX_SHARD_ITEMS)]


class ParquetShard(_Strict):
    id: ShardId
    kind: Literal["parquet"]
    path: PathText
    row_groups: Annotated[list[Offset], Field(max_length=MAX_SHARD_ITEMS)]


class SqlShard(_Strict):
    id: ShardId
    kind: Literal["sql"]
    url: Annotated[str, Field(min_length=1, max_length=4096)]
    table: Name
    key: Name
    offset: Offset
    limit: Annotated[int, Field(ge=1, le=2**62)]


ShardModel = Annotated[FilesShard | CsvShard | ParquetShard | SqlShard, Field(discriminator="kind")]


class _Answer(BaseModel):
    """An answer may carry fields a newer coordinator added; they are ignored, never trusted."""

    model_config = ConfigDict(extra="ignore")


class JobAnswer(_Answer):
    transform: Annotated[str, Field(max_length=4096)]
    fingerprint: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    lease_s: Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)]


class Work(_Answer):
    action: Literal["work"]
    attempt: AttemptId
    shard: ShardModel


class Wait(_Answer):
    action: Literal["wait"]
    seconds: Annotated[float, Field(ge=0, le=60, allow_inf_nan=False)]


class Stop(_Answer):
    action: Literal["stop"]
    error: Annotated[str, Field(max_length=MAX_ERROR)] | None


ClaimAnswer = Annotated[Work | Wait | Stop, Field(discriminator="action")]


class CompleteAnswer(_Answer):
    kept: bool


class Ok(_Answer):
    ok: Literal[True] = True
