"""What every benchmark CLI shares: writing results (timing lives in ``dflash_lab.measure``).

Results go to benchmarks/ as JSON (and a markdown table), written atomically: a
failed run leaves the old files.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime import REPO_ROOT, atomic_file, target_path, write_json

OUT_HELP = "output folder (default: benchmarks/ for the shipped pair, runs/benchmarks/<target>/ for another pair)"


def pair_out_dir(out=None) -> Path:
    """``out`` when given; else benchmarks/ for the shipped pair and runs/benchmarks/<target dir name>/ for any
    other: the committed records belong to the shipped pair, and a run on your pair never overwrites them."""
    from ..assets import is_shipped_pair

    if out is not None:
        return Path(out)
    if is_shipped_pair():
        return REPO_ROOT / "benchmarks"
    folder = REPO_ROOT / "runs" / "benchmarks" / target_path().resolve().name
    print(f"the pair in use is not the shipped one: results go to {folder} (benchmarks/ holds the shipped pair's)")
    return folder

# ---------------------------------------------------------------------------
# Writing results
# ---------------------------------------------------------------------------


def write_results(out_dir, stem: str, records, markdown: str | None = None) -> list[Path]:
    """<stem>.json (and <stem>.md) under ``out_dir``, each written atomically."""
    out_dir = Path(out_dir)
    paths = [write_json(out_dir / f"{stem}.json", records, indent=1)]
    if markdown is not None:
        paths.append(atomic_file(out_dir / f"{stem}.md", lambda tmp: Path(tmp).write_text(markdown)))
    return paths
