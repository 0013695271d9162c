"""Copy a wheel without some of its files (and without dropped top-level packages in top_level.txt), with a RECORD
that matches what is left, so that the wheel bundles carried to the GPU machine fit its transfer limit.
    python benchmarks/slim_wheel.py SRC.whl DST.whl --drop 'studio/*' --drop 'bitsandbytes/libbitsandbytes_rocm*'
``--drop`` takes fnmatch patterns over the archive's paths."""

from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import zipfile


def slim(src: str, dst: str, drop: list[str]) -> list[str]:
    """Write ``dst`` as ``src`` less the members matching ``drop``; returns the dropped paths."""
    dropped: list[str] = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        tops = {p.split("/")[0] for p in drop if p.endswith("/*") and "/" not in p[:-2]}
        rows = []
        for info in zin.infolist():
            if info.filename == record:
                continue
            if any(fnmatch.fnmatch(info.filename, p) for p in drop):
                dropped.append(info.filename)
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/top_level.txt"):
                data = b"".join(line for line in data.splitlines(keepends=True) if line.strip().decode() not in tops)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((info.filename, f"sha256={digest}", str(len(data))))
        rows.append((record, "", ""))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        zout.writestr(record, text.getvalue())
    return dropped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--drop", action="append", default=[], help="fnmatch pattern of archive paths to leave out")
    args = parser.parse_args(argv)
    if not args.drop:
        parser.error("--drop: give at least one pattern")
    dropped = slim(args.src, args.dst, args.drop)
    if not dropped:
        parser.error(f"no member of {args.src} matches {args.drop}")
    print(f"{args.dst}: {len(dropped)} members left out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
