"""What every benchmark CLI shares: writing results (timing lives in ``dflash_lab.measure``).

Results go to benchmarks/ as JSON (and a markdown table), written atomically: a
failed run leaves the old files.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime import atomic_file, write_json

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
