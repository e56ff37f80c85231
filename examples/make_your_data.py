"""Write the two datasets of docs/pipeline.md's worked example ("Your data, your model") as a user would have them:

    data/user/reviews.csv          review,sentiment          movie-review sentences, labels "negative" / "positive"
    data/user/similarity.parquet   sentence1,sentence2,similarity   sentence pairs in five classes, no dev split

Both are cut from real benchmark data (SST-2 and STS-B, read from the data mirror or the Hugging Face hub): the
reviews keep their labels, spelled out; the pairs' 0-5 similarity score is binned into five named classes.

    python examples/make_your_data.py [--output data/user] [--rows 600]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

# STS-B's scores 0-5, binned into five classes by whole points (5.0 joins the top class).
SIMILARITY_CLASSES = ("unrelated", "distant", "related", "close", "equivalent")


def write_examples(output: Path, rows: int = 600) -> dict[str, Path]:
    from layertune.corpora import load_corpus

    output.mkdir(parents=True, exist_ok=True)
    sst2 = load_corpus("sst2", train_size=rows, seed=0).train.to_pandas()
    reviews = sst2.assign(sentiment=[("negative", "positive")[label] for label in sst2["label"]])
    reviews = reviews.rename(columns={"sentence": "review"})[["review", "sentiment"]]
    reviews.to_csv(output / "reviews.csv", index=False)

    stsb = load_corpus("stsb", train_size=rows, seed=0).train.to_pandas()
    bins = np.minimum(stsb["label"].to_numpy().astype(int), len(SIMILARITY_CLASSES) - 1)
    pairs = stsb.assign(similarity=[SIMILARITY_CLASSES[b] for b in bins])[["sentence1", "sentence2", "similarity"]]
    pairs.to_parquet(output / "similarity.parquet", index=False)
    return {"reviews": output / "reviews.csv", "similarity": output / "similarity.parquet"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("data/user"))
    parser.add_argument("--rows", type=int, default=600, help="examples per dataset")
    arguments = parser.parse_args()
    for name, path in write_examples(arguments.output, arguments.rows).items():
        print(f"{name}: {path}")
