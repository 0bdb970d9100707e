"""Data out of the lab: statistics as CSV or JSON, figures as SVG or HTML, one call each.

    export_stats(dflash[16], "dflash_b16.csv")                        # one SpecDecodeStats
    export_stats({"DFlash": dflash, "prompt lookup": lookup}, "all.json")  # nested dicts of them
    save_figure(fig, "acceptance.svg")                                 # = viz.save_figure

CSV holds one row per stats object (its name, its counters and rates, one column per
draft position); JSON keeps the nesting of the dict it was given. Files are written
to a temporary name and renamed, so a failed write leaves nothing half-written.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from .runtime import atomic_file
from .spec_decode.stats import SpecDecodeStats
from .viz.common import save_figure

__all__ = ["export_stats", "flatten_stats", "save_figure"]


def flatten_stats(obj, name: str = "") -> list[tuple[str, SpecDecodeStats]]:
    """(name, stats) pairs of a SpecDecodeStats or a (nested) dict / list of them; names join keys with ' / '."""
    if isinstance(obj, SpecDecodeStats):
        return [(name or "stats", obj)]
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        raise TypeError(f"export_stats: expected SpecDecodeStats or a dict/list of them, got {type(obj).__name__}"
                        + (f" at {name!r}" if name else ""))
    pairs = []
    for key, value in items:
        pairs += flatten_stats(value, f"{name} / {key}" if name else str(key))
    return pairs


def _jsonable(obj, name: str = ""):
    if isinstance(obj, SpecDecodeStats):
        return obj.to_dict()
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, f"{name} / {k}" if name else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, f"{name} / {i}" if name else str(i)) for i, v in enumerate(obj)]
    raise TypeError(f"export_stats: cannot write {type(obj).__name__}" + (f" at {name!r}" if name else "")
                    + " (only SpecDecodeStats and dicts/lists of them)")


def export_stats(obj, path) -> Path:
    """Write SpecDecodeStats (or a nested dict/list of them) to ``path``: ``.csv`` or ``.json``."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        text = json.dumps(_jsonable(obj), indent=2) + "\n"
    elif suffix == ".csv":
        rows = [{"name": name, **stats.csv_row()} for name, stats in flatten_stats(obj)]
        columns = list(dict.fromkeys(key for row in rows for key in row))  # union, first-seen order
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        text = buf.getvalue()
    else:
        raise ValueError(f"export_stats: path must end in .csv or .json, got {path.name!r}")
    atomic_file(path, lambda tmp: Path(tmp).write_text(text))
    return path
