"""A preprocessing transform, and a sample input for it.

    python examples/preprocess/features.py texts.csv          # writes 50,000 short texts
    distml preprocess texts.csv --transform examples/preprocess/features.py:hashed_features \\
        --out features/ --workers 2 --blocksize-mb 0.5

Each worker imports this file and calls ``hashed_features`` on one shard (a pyarrow Table of
rows ``id, text, label``): it lower-cases and splits each text and counts its tokens into 64
hashed buckets (the "hashing trick"). The output folder's parts stream into training with
``distml.data.preprocess.PreprocessedShards``.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

BUCKETS = 64


def hashed_features(table: pa.Table) -> dict[str, np.ndarray]:
    texts = table["text"].to_pylist()
    counts = np.zeros((len(texts), BUCKETS), dtype=np.float32)
    for row, text in enumerate(texts):
        for token in text.lower().split():
            digest = hashlib.blake2b(token.encode(), digest_size=4).digest()
            counts[row, int.from_bytes(digest, "little") % BUCKETS] += 1
    return {"id": table["id"].to_numpy(), "x": counts, "label": table["label"].to_numpy()}


def write_sample(path: str, rows: int = 50_000) -> None:
    rng = np.random.default_rng(0)
    vocab = np.array([f"word{i}" for i in range(200)])
    labels = rng.integers(0, 2, size=rows)
    texts = [" ".join(rng.choice(vocab[label * 100 :], size=20)) for label in labels]
    pacsv.write_csv(pa.table({"id": np.arange(rows), "text": texts, "label": labels}), path)


if __name__ == "__main__":
    write_sample(sys.argv[1] if len(sys.argv) > 1 else "texts.csv")
