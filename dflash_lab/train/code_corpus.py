"""Stage 0: a larger Python corpus, the standard library plus installed packages' sources.

The standard library alone (~2.4 M training tokens) is too little for the target:
it memorises (CALIBRATION.md). Every Python environment holds much more Python,
in its ``site-packages``. This module takes it, with care:

- **Licences.** Each distribution's licence is read from its metadata
  (``License-Expression``, ``License``, trove classifiers). Only permissive ones
  are taken (MIT, BSD, Apache, PSF, ISC, ...); copyleft (GPL, LGPL, MPL),
  proprietary and unstated licences are left out and recorded as left out.
- **Files.** A file belongs to the distribution whose RECORD lists it. Generated
  code (protobuf stubs, "do not edit" files, data tables) is skipped, and each
  distribution contributes at most ``max_bytes_per_package``, so no single
  library sets the style.
- **Held-out split by file path, as before.** A package file's path is its path
  under ``site-packages`` and ``corpus.split_of`` buckets it; standard-library
  files keep their stdlib-relative paths, so their split does not change.
- **No held-out text in training.** Identical files share one fate: if any copy
  is held out, no copy trains. A training file that repeats three consecutive
  lines of a held-out prompt (a vendored or back-ported copy of a stdlib module)
  is dropped too (``drop_prompt_overlap``).

``save_corpus_pack`` writes the chosen files as one xz-compressed JSON-lines
file (a few times smaller than their tokens, so it travels to a GPU machine) and
a manifest with one entry per package: name, version, licence, files, bytes.
``corpus_streams`` (target_lm.py) reads a pack wherever it takes a corpus root.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import json
import lzma
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from .. import corpus
from ..corpus import SourceFile
from ..runtime import atomic_file, write_json
from .common import Clock

PACK_SUFFIX = ".jsonl.xz"
STDLIB_PACKAGE = "python-stdlib"  # the manifest's name for the standard library (PSF licence)

# SPDX ids and classifier words of permissive licences; anything else is left out.
PERMISSIVE = re.compile(
    r"\b(MIT|MIT-0|MIT-CMU|BSD|0BSD|BSD-2-Clause|BSD-3-Clause|Apache|Apache-2\.0|PSF|PSF-2\.0|PSFL|Python Software"
    r"|Python-2\.0|CNRI-Python|ISC|ISCL|Unlicense|CC0|CC0-1\.0|Zlib|HPND|BSL-1\.0)\b", re.I)
NOT_PERMISSIVE = re.compile(r"GPL|MPL|Mozilla|Proprietary|NVIDIA|LicenseRef|Commercial|EUPL|CDDL|SSPL", re.I)
GENERATED = re.compile(r"do not edit|auto-?generated|generated (by|from)|@generated", re.I)


@dataclass
class PackageSource:
    name: str
    version: str
    licence: str  # as the metadata states it (SPDX expression, license field or classifiers)
    files: list[SourceFile] = field(default_factory=list)

    def entry(self) -> dict:
        return {"name": self.name, "version": self.version, "licence": self.licence, "files": len(self.files),
                "bytes": sum(len(f.text.encode()) for f in self.files)}


# ---------------------------------------------------------------------------
# Which distributions, which files
# ---------------------------------------------------------------------------


def licence_of(dist: metadata.Distribution) -> str:
    """A distribution's licence in words: the SPDX expression, else the licence field's first line,
    else its trove classifiers; "" when the metadata states none."""
    meta = dist.metadata
    if meta.get("License-Expression"):
        return meta["License-Expression"].strip()
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    field_ = (meta.get("License") or "").strip().splitlines()
    first = field_[0].strip() if field_ else ""
    if first and first.upper() != "UNKNOWN" and PERMISSIVE.search(first) or NOT_PERMISSIVE.search(first):
        return first
    return " AND ".join(c for c in classifiers if c != "OSI Approved") or first


def is_permissive(licence: str) -> bool:
    return bool(licence) and bool(PERMISSIVE.search(licence)) and not NOT_PERMISSIVE.search(licence)


def looks_generated(relpath: str, text: str) -> bool:
    """Generated code or data dressed as code: protobuf stubs, "do not edit" headers, very long lines."""
    if relpath.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")):
        return True
    if GENERATED.search(text[:1000]):
        return True
    lines = text.splitlines() or [""]
    return sum(map(len, lines)) / len(lines) > 100 or max(map(len, lines)) > 2000


def _read_source(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) > corpus.MAX_FILE_BYTES or not data.strip():
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _order_key(relpath: str) -> str:
    """A fixed pseudo-random file order (so a byte cap takes a spread of the package, not its first folder)."""
    return hashlib.sha256(relpath.encode()).hexdigest()


def package_sources(site_packages, *, max_bytes_per_package: int = 2_000_000,
                    skip: tuple = ("dflash_lab",)) -> tuple[list[PackageSource], list[dict]]:
    """The permissively licensed distributions under ``site_packages`` with their usable ``.py`` files.

    Returns (taken, left_out): left_out entries say why (licence, no files).
    """
    site = Path(site_packages)
    if not site.is_dir():
        raise FileNotFoundError(f"`site_packages` {site} is not a directory")
    taken, left_out = [], []
    for dist in sorted(metadata.distributions(path=[str(site)]), key=lambda d: d.metadata["Name"].lower()):
        name, version = dist.metadata["Name"], dist.version
        licence = licence_of(dist)
        if name in skip:
            continue
        if not is_permissive(licence):
            left_out.append({"name": name, "version": version, "licence": licence or "not stated",
                             "why": "licence not permissive" if licence else "no licence stated"})
            continue
        pkg = PackageSource(name, version, licence)
        rels = sorted({str(f) for f in dist.files or [] if str(f).endswith(".py") and not str(f).startswith("..")},
                      key=_order_key)
        used = 0
        for rel in rels:
            if "__pycache__" in rel or ".dist-info/" in rel:
                continue
            text = _read_source(site / rel)
            if text is None or looks_generated(rel, text):
                continue
            size = len(text.encode())
            if used + size > max_bytes_per_package:
                continue
            used += size
            pkg.files.append(SourceFile(rel, text))
        if pkg.files:
            pkg.files.sort(key=lambda f: f.relpath)
            taken.append(pkg)
        else:
            left_out.append({"name": name, "version": version, "licence": licence, "why": "no usable .py files"})
    return taken, left_out


# ---------------------------------------------------------------------------
# Keeping held-out text out of training
# ---------------------------------------------------------------------------


def deduplicate(files: list[SourceFile]) -> list[SourceFile]:
    """One copy of each distinct text; when any copy is held out, only held-out copies remain."""
    by_text: dict[str, list[SourceFile]] = {}
    for f in files:
        by_text.setdefault(hashlib.sha256(f.text.encode()).hexdigest(), []).append(f)
    keep = []
    for copies in by_text.values():
        held = [f for f in copies if f.split == "heldout"]
        keep.append(held[0] if held else copies[0])
    order = {id(f): i for i, f in enumerate(files)}
    return sorted(keep, key=lambda f: order[id(f)])


def _line_windows(text: str, width: int = 3, min_chars: int = 40) -> set[int]:
    """Hashes of every ``width`` consecutive non-blank stripped lines holding >= min_chars characters."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    out = set()
    for i in range(len(lines) - width + 1):
        window = "\n".join(lines[i:i + width])
        if len(window) >= min_chars:
            out.add(hash(window))
    return out


def drop_prompt_overlap(files: list[SourceFile], prompts: list[dict]) -> list[SourceFile]:
    """Drop every file that repeats three consecutive lines of a held-out prompt (whitespace aside)."""
    probe = set().union(*(_line_windows(p["text"]) for p in prompts)) if prompts else set()
    return [f for f in files if not (_line_windows(f.text) & probe)]


# ---------------------------------------------------------------------------
# The corpus and its pack file
# ---------------------------------------------------------------------------


def default_site_packages() -> Path:
    """This interpreter's ``site-packages`` (the lab's environment when run from its venv)."""
    return Path(sysconfig.get_paths()["purelib"])


def build_code_corpus(stdlib_root=None, site_packages=None, *, max_bytes_per_package: int = 2_000_000):
    """(files, package of each file, manifest): the stdlib's files then the packages', each distinct text once."""
    # Library code only, as the held-out prompts are: the stdlib's test suites are left out.
    stdlib = [f for f in corpus.gather(stdlib_root) if not corpus.is_test_path(f.relpath)]
    packages, left_out = package_sources(site_packages or default_site_packages(),
                                         max_bytes_per_package=max_bytes_per_package)
    files = deduplicate(stdlib + [f for p in packages for f in p.files])
    kept = {id(f) for f in files}
    std_entry = {"name": STDLIB_PACKAGE, "version": ".".join(map(str, sys.version_info[:3])),
                 "licence": "PSF-2.0", "files": sum(id(f) in kept for f in stdlib),
                 "bytes": sum(len(f.text.encode()) for f in stdlib if id(f) in kept)}
    entries = [std_entry]
    for p in packages:
        p.files = [f for f in p.files if id(f) in kept]
        if p.files:
            entries.append(p.entry())
    owner = {id(f): STDLIB_PACKAGE for f in stdlib} | {id(f): p.name for p in packages for f in p.files}
    manifest = {"packages": entries, "left_out": left_out, "files": len(files),
                "bytes": sum(e["bytes"] for e in entries), "max_bytes_per_package": max_bytes_per_package,
                "splits": {name: sum(f.split == name for f in files) for name in corpus.SPLITS}}
    return files, [owner[id(f)] for f in files], manifest


def save_corpus_pack(files: list[SourceFile], packages: list[str], manifest: dict, path) -> None:
    """The files as xz-compressed JSON lines ({"package", "relpath", "text"}); the manifest beside it (.json)."""
    path = Path(path)
    if not path.name.endswith(PACK_SUFFIX):
        raise ValueError(f"a corpus pack's name ends with {PACK_SUFFIX!r}, got {path.name!r}")
    if len(packages) != len(files):
        raise ValueError(f"`packages` names {len(packages)} files, `files` holds {len(files)}")
    lines = "".join(json.dumps({"package": p, "relpath": f.relpath, "text": f.text}, ensure_ascii=False) + "\n"
                    for f, p in zip(files, packages))
    atomic_file(path, lambda tmp: tmp.write_bytes(lzma.compress(lines.encode(), preset=6)))
    write_json(manifest_path(path), manifest, indent=1)


def manifest_path(pack) -> Path:
    pack = Path(pack)
    return pack.with_name(pack.name.removesuffix(PACK_SUFFIX) + ".manifest.json")


def is_corpus_pack(path) -> bool:
    return path is not None and str(path).endswith(PACK_SUFFIX) and Path(path).is_file()


def load_corpus_pack(path) -> tuple[list[SourceFile], list[str]]:
    """What save_corpus_pack wrote: (SourceFiles in the saved order, each file's package name)."""
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    return [SourceFile(d["relpath"], d["text"]) for d in rows], [d["package"] for d in rows]


def run_corpus(args) -> None:
    """`python -m dflash_lab.train corpus`: choose the files, record the licences, write the pack."""
    clock = Clock()
    files, packages, manifest = build_code_corpus(args.corpus, args.site_packages,
                                                  max_bytes_per_package=args.max_bytes_per_package)
    save_corpus_pack(files, packages, manifest, args.out)
    print(f"corpus pack {args.out}: {manifest['files']} files, {manifest['bytes'] / 1e6:.1f} MB of Python from "
          f"{len(manifest['packages'])} packages ({len(manifest['left_out'])} left out: see "
          f"{manifest_path(args.out).name}); files per split {manifest['splits']}; {clock.elapsed():.0f}s")
