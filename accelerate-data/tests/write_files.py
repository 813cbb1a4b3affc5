"""Writes the files accelerate-data's tests read back: token files as numpy, nanoGPT and llm.c
write them, Arrow IPC files as pyarrow writes them, and Hugging Face datasets folders as
`save_to_disk` writes them. Every value is a function of its row, which the tests recompute."""

import sys

import datasets
import numpy as np
import pyarrow as pa

out = sys.argv[1]

# Token files: numpy's .npy in several integer types, nanoGPT's raw uint16 .bin, and llm.c's
# .bin (a header of 256 int32: magic 20240520, version 1, token count; then uint16 tokens), as
# llm.c's dev/data/data_common.py writes it.
np.save(f"{out}/u16.npy", np.arange(1000, dtype=np.uint16))
np.save(f"{out}/u32.npy", np.arange(1000, dtype=np.uint32) * 70000)
np.save(f"{out}/i64.npy", np.arange(1000, dtype=np.int64).reshape(10, 100))
np.arange(1000, dtype=np.uint16).tofile(f"{out}/nanogpt.bin")
header = np.zeros(256, dtype=np.int32)
header[:3] = [20240520, 1, 1000]
with open(f"{out}/llmc.bin", "wb") as f:
    f.write(header.tobytes())
    f.write(np.arange(1000, dtype=np.uint16).tobytes())

# Documents as llm.c's fineweb.py writes them: GPT-2's end-of-text token (50256) before each.
# Document d holds the tokens 10 d .. 10 d + d.
documents = np.concatenate(
    [np.array([50256] + list(range(10 * d, 10 * d + d + 1)), dtype=np.uint16) for d in range(20)]
)
header[:3] = [20240520, 1, len(documents)]
with open(f"{out}/llmc_documents.bin", "wb") as f:
    f.write(header.tobytes())
    f.write(documents.tobytes())


def rows(n):
    return {
        "text": [f"row {i} " * (i % 7) for i in range(n)],
        "label": [i % 5 for i in range(n)],
        "input_ids": [list(range(i, i + i % 9)) for i in range(n)],
    }


# Arrow IPC, both formats, several record batches.
table = pa.table(rows(2500))
with pa.ipc.new_file(f"{out}/file.arrow", table.schema) as writer:
    for batch in table.to_batches(max_chunksize=700):
        writer.write_batch(batch)
with pa.ipc.new_stream(f"{out}/stream.arrow", table.schema) as writer:
    for batch in table.to_batches(max_chunksize=700):
        writer.write_batch(batch)

# Hugging Face datasets: token ids as tokenizers give them (a sequence of int32), three files.
features = datasets.Features(
    {
        "text": datasets.Value("string"),
        "label": datasets.ClassLabel(num_classes=5),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
    }
)
train = datasets.Dataset.from_dict(rows(2500), features=features)
train.save_to_disk(f"{out}/hf", num_shards=3)
datasets.DatasetDict(
    {"train": train, "test": datasets.Dataset.from_dict(rows(10), features=features)}
).save_to_disk(f"{out}/hf_dict")

# Parquet: the hub's layout (data/train-0000x-of-00002.parquet), row groups of 300 rows, the
# second file zstd-compressed (pyarrow's default is snappy); and datasets' own to_parquet.
import os

import pyarrow.parquet as pq

os.makedirs(f"{out}/hub/data")
pq.write_table(
    table.slice(0, 1300), f"{out}/hub/data/train-00000-of-00002.parquet", row_group_size=300
)
pq.write_table(
    table.slice(1300),
    f"{out}/hub/data/train-00001-of-00002.parquet",
    row_group_size=300,
    compression="zstd",
)
train.to_parquet(f"{out}/hf.parquet")
