"""Pack what `benchmarks/gpu_check.sh` needs on a lent GPU machine, which reaches no package index and no hub and
takes at most 64 MiB of carried files: one ignored folder, ``.gpu-check/``, to carry with the working tree.

- ``wheels/``: the packages layertune needs that the GPU machine lacks (it has Python 3.12, torch, transformers,
  accelerate, peft, pandas, pyarrow, scikit-learn, seaborn), for CPython 3.12 on x86-64 Linux, from the index;
- ``models/paraphrase-MiniLM-L3-v2``: the real small model, its weights stored in float16 (35 MB instead of 67),
  for quality (cached against uncached agreement); it loads as float32 there, as any checkpoint does;
- ``data/``: the GLUE SST-2 files and 2,500 IMDb reviews (2,000 train + 500 test), in the data mirror's layout.

    python benchmarks/gpu_check_prepare.py [--mirror ../shared/data] [--models ../shared/models]
    # then, with the device tool: run "bash benchmarks/gpu_check.sh" carrying [".gpu-check"]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

KIT = Path(".gpu-check")
LIMIT_MB = 64
# What the GPU machine lacks, without their dependencies that it has (numpy, pandas, pyarrow, huggingface-hub,
# requests, fsspec, tqdm, filelock, pyyaml): `pip install --no-deps` there takes exactly these.
WHEELS = ["datasets", "dill", "multiprocess", "xxhash", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "typing-extensions", "psutil", "aiohttp", "aiosignal", "aiohappyeyeballs",
          "frozenlist", "multidict", "yarl", "propcache", "attrs"]
SOURCE_ONLY = ["seqeval>=1.2"]  # pure Python, published as a source archive only: built into a wheel here


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", type=Path, default=Path("../shared/data"))
    parser.add_argument("--models", type=Path, default=Path("../shared/models"))
    args = parser.parse_args(argv)
    if KIT.exists():
        shutil.rmtree(KIT)  # our own output folder (ignored by git): made anew
    wheels(KIT / "wheels")
    model(args.models / "paraphrase-MiniLM-L3-v2", KIT / "models" / "paraphrase-MiniLM-L3-v2")
    data(args.mirror, KIT / "data")
    size = sum(f.stat().st_size for f in KIT.rglob("*") if f.is_file()) / 2**20
    print(f"{KIT}: {size:.1f} MiB (the device carries at most {LIMIT_MB} MiB)")
    if size > LIMIT_MB:
        sys.exit(f"{KIT} is {size:.1f} MiB, over the {LIMIT_MB} MiB the device carries")
    return KIT


def wheels(folder: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any",
                    "-d", str(folder), *WHEELS], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(folder), *SOURCE_ONLY],
                   check=True)


def model(source: Path, target: Path) -> None:
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.name != "model.safetensors":
            shutil.copy2(file, target / file.name)
    weights = load_file(source / "model.safetensors")
    save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()}, target / "model.safetensors",
              metadata={"format": "pt"})


def data(mirror: Path, target: Path) -> None:
    import pandas as pd

    (target / "glue").mkdir(parents=True)
    shutil.copytree(mirror / "glue" / "SST-2", target / "glue" / "SST-2")
    (target / "imdb").mkdir()
    for split, rows in (("train", 2000), ("test", 500)):
        reviews = pd.read_parquet(mirror / "imdb" / f"{split}.parquet")  # balanced, as layertune samples IMDb
        sample = reviews.groupby("label", group_keys=False).sample(n=rows // 2, random_state=0)
        sample.sample(frac=1, random_state=0).to_parquet(target / "imdb" / f"{split}.parquet", index=False)


if __name__ == "__main__":
    main()
