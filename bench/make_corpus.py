"""Make a corpus of at least ``--gb`` GB of text from this machine's source files and documentation, written as
Parquet and JSON Lines (plain and zstd), the formats ``gossiploco data prepare`` reads (nothing is downloaded).

Documents are the UTF-8 text files (sources, headers, docs, markup; at most 2 MB each, each inode once, sorted
by path) under ``--roots`` (default: the Python standard library, /usr/share/doc, /usr/include and the venv's
site-packages). A machine holds less unique text than a gigabyte (this one: about 0.45 GB), so the documents
are written in passes until the target is reached: pass k repeats the documents of pass 0 with its number
in each row's ``pass`` column. The text is still tokenized in full by ``prepare``, which is what is measured;
a training run would see each document more than once per epoch.

Half the text goes to Parquet files (zstd, row groups of 1,000 rows), half to JSON Lines files alternating plain
and ``.zst``; each file holds about ``--file-mb`` MB of text. ``OUT/corpus.json`` lists the files, the unique
and total text bytes, and the number of documents.

    python -m bench.make_corpus --out /tmp/corpus/src --gb 1.0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

TEXT_SUFFIXES = {".py", ".pyi", ".pyx", ".pxd", ".txt", ".md", ".rst", ".html", ".c", ".h", ".hpp", ".cpp", ".cc",
                 ".cu", ".cuh", ".js", ".ts", ".css", ".json", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".sh", ".pl",
                 ".pm", ".tex", ".xml", ".in", ".inc", ".f90"}
DEFAULT_ROOTS = [f"/usr/lib/python3.{sys.version_info.minor}", "/usr/lib/python3", "/usr/share/doc", "/usr/include",
                 *sorted(str(p) for p in Path(sys.prefix).glob("lib/python3*/site-packages"))]
MAX_FILE_BYTES = 2_000_000


def text_files(roots: list[str]) -> list[Path]:
    """The text files under ``roots``: suffix in ``TEXT_SUFFIXES``, no symlinks, each inode once, sorted by path."""
    seen: set[tuple[int, int]] = set()
    found: list[Path] = []
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                path = Path(folder) / name
                if path.suffix.lower() not in TEXT_SUFFIXES or path.is_symlink():
                    continue
                try:
                    stat = path.stat()
                except OSError:
                    continue
                if (stat.st_dev, stat.st_ino) in seen or not 0 < stat.st_size <= MAX_FILE_BYTES:
                    continue
                seen.add((stat.st_dev, stat.st_ino))
                found.append(path)
    return sorted(found)


def documents(files: list[Path]) -> list[tuple[str, str]]:
    """(path, text) of every file that is UTF-8 text (others are left out and counted on stderr)."""
    docs, skipped = [], 0
    for path in files:
        try:
            docs.append((str(path), path.read_bytes().decode("utf-8")))
        except (OSError, UnicodeDecodeError):
            skipped += 1
    print(f"{len(docs)} UTF-8 text files, {skipped} skipped (unreadable or not UTF-8)", file=sys.stderr)
    return docs


class Writer:
    """Rows spread over Parquet and JSON Lines files of about ``file_bytes`` of text each."""

    def __init__(self, out: Path, file_bytes: int):
        self.out, self.file_bytes = out, file_bytes
        self.rows: list[dict] = []
        self.size = 0
        self.files: list[str] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.size += len(row["text"].encode("utf-8"))
        if self.size >= self.file_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        number = len(self.files)
        kind = ("parquet", "jsonl", "parquet", "jsonl.zst")[number % 4]
        path = self.out / f"part-{number:04d}.{kind}"
        if kind == "parquet":
            table = pa.Table.from_pylist(self.rows)
            pq.write_table(table, path, row_group_size=1000, compression="zstd")
        else:
            data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in self.rows).encode("utf-8")
            path.write_bytes(zstandard.ZstdCompressor(level=3).compress(data) if kind.endswith(".zst") else data)
        self.files.append(path.name)
        self.rows, self.size = [], 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gb", type=float, default=1.0, help="Text to write, in GB (10^9 bytes).")
    parser.add_argument("--file-mb", type=float, default=128.0, help="Text per file, in MB.")
    parser.add_argument("--roots", nargs="*", default=DEFAULT_ROOTS)
    args = parser.parse_args()
    start = time.perf_counter()
    docs = documents(text_files([r for r in args.roots if Path(r).is_dir()]))
    unique = sum(len(text.encode("utf-8")) for _, text in docs)
    target = int(args.gb * 1e9)
    args.out.mkdir(parents=True, exist_ok=False)
    writer = Writer(args.out, int(args.file_mb * 1e6))
    written = rows = passes = 0
    while written < target:
        for path, text in docs:
            writer.add({"text": text, "path": path, "pass": passes})
            written += len(text.encode("utf-8"))
            rows += 1
            if written >= target:
                break
        passes += 1
    writer.flush()
    info = {"files": writer.files, "unique_text_bytes": unique, "text_bytes": written, "documents": rows,
            "unique_documents": len(docs), "passes": passes,
            "file_bytes": sum((args.out / f).stat().st_size for f in writer.files),
            "seconds": time.perf_counter() - start}
    (args.out / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "files"}))


if __name__ == "__main__":
    main()
