"""The training corpus: the Python standard library's own ``.py`` sources.

Every machine with Python has this corpus, and it is PSF-licensed, so the lab
can train its tiny Laguna code model anywhere from the same recipe. Files are
split by a hash of their path relative to the stdlib root, so the split is the
same on every machine and Python version (a file keeps its bucket as long as
its path stays put):

    heldout  10%   never trained on; the held-out prompts are cut from here
    distill  10%   the target never sees these files; their prefixes seed the
                   self-distillation data of the drafter, so the drafter learns
                   how the target continues code it has NOT memorised, which is
                   exactly what happens on a held-out prompt
    train    80%   the target's training data

The held-out prompt set is cut once (from the interpreter that builds the
checkpoints) and saved as JSON next to them, so notebooks and tests read the
same prompts everywhere.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from .runtime import atomic_file

SPLITS = {"heldout": (0, 10), "distill": (10, 20), "train": (20, 100)}  # hash buckets [lo, hi) of 100
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "lib-dynload"}
MAX_FILE_BYTES = 512 * 1024  # a few generated tables (unicode data, ...) are bigger and teach nothing
NUM_PROMPTS = 48
PROMPT_START = re.compile(r"^\s*(def |class |async def |@)")  # prompts start where code starts


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """'train', 'distill' or 'heldout', from a hash of the POSIX relative path."""
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100
    for name, (lo, hi) in SPLITS.items():
        if lo <= bucket < hi:
            return name
    raise AssertionError(bucket)


def is_test_path(relpath: str) -> bool:
    parts = relpath.split("/")
    return any(p in {"test", "tests", "idle_test"} for p in parts[:-1]) or parts[-1].startswith("test_")


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # POSIX path relative to the stdlib root
    text: str

    @property
    def split(self) -> str:
        return split_of(self.relpath)


def gather(root: Path | str | None = None) -> list[SourceFile]:
    """Every UTF-8 ``.py`` file under ``root`` (default: the stdlib), sorted by path.

    Third-party packages, caches and files over MAX_FILE_BYTES are skipped, and
    so are files that are not valid UTF-8 (the stdlib's tests carry a few on
    purpose).
    """
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or not path.is_file():
            continue
        data = path.read_bytes()
        if len(data) > MAX_FILE_BYTES:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            files.append(SourceFile(rel.as_posix(), text))
    return files


def by_split(files: list[SourceFile]) -> dict[str, list[SourceFile]]:
    out: dict[str, list[SourceFile]] = {name: [] for name in SPLITS}
    for f in files:
        out[f.split].append(f)
    return out


def drop_files_containing(files: list[SourceFile], prompts: list[dict], probe_chars: int = 200) -> list[SourceFile]:
    """Drop every file that contains the opening of a held-out prompt.

    The path-hash split already keeps held-out files out of training; this
    guards against the same code living under another path (a file moved
    between Python versions, a copy in a test package).
    """
    probes = [p["text"][:probe_chars] for p in prompts]
    return [f for f in files if not any(probe in f.text for probe in probes)]


# ---------------------------------------------------------------------------
# The held-out prompt set
# ---------------------------------------------------------------------------


def cut_prompts(files: list[SourceFile], n: int = NUM_PROMPTS, *, seed: int = 0, min_chars: int = 300,
                max_chars: int = 900) -> list[dict]:
    """``n`` prompts from held-out library (non-test) files, one per file first.

    A prompt starts at a ``def``/``class``/decorator line and takes whole lines
    until it holds at least a random 300-900 characters (roughly 100-300
    tokens). The trailing newline is dropped, so the target's first new token
    is the line break and the next line's indentation, as in running text.
    """
    rng = random.Random(seed)
    pool = [f for f in files if f.split == "heldout" and not is_test_path(f.relpath)
            and not f.relpath.startswith(("encodings/", "pydoc_data/"))]  # codec tables and prose dumps
    # Deterministic order that does not favour any directory.
    pool.sort(key=lambda f: hashlib.sha256(f"{seed}:{f.relpath}".encode()).hexdigest())
    prompts, used = [], set()
    for _ in range(2):  # a second pass takes a second prompt from a file, if the first came short
        for f in pool:
            lines = f.text.splitlines()
            starts = [i for i, line in enumerate(lines) if PROMPT_START.match(line) and (f.relpath, i) not in used]
            rng.shuffle(starts)
            for start in starts:
                want = rng.randint(min_chars, max_chars)
                text, end = "", start
                while end < len(lines) and len(text) < want:
                    text += lines[end] + "\n"
                    end += 1
                text = text.rstrip()
                if min_chars <= len(text) <= max_chars + 200:
                    used.update((f.relpath, i) for i in range(start, end))
                    prompts.append({"id": len(prompts), "source": f.relpath, "first_line": start + 1, "text": text})
                    break
            if len(prompts) == n:
                return prompts
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} prompts could be cut from {len(pool)} held-out files (wanted {n})")
    return prompts


def cut_docstring_prompts(files: list[SourceFile], n: int = NUM_PROMPTS, *, seed: int = 1, avoid: list[dict] = (),
                          context_chars: int = 400) -> list[dict]:
    """``n`` docstring-first prompts from held-out library files: a function's signature and docstring, no body.

    A prompt is up to ``context_chars`` of whole lines before a documented ``def`` (the code above
    it, from a ``def``/``class``/decorator line on), then the ``def`` line through the docstring's
    closing quotes, and stops there: the target's continuation is the function body, new code the
    prompt does not contain (where the held-out set's continuations often repeat their prompt). The
    text parses on its own when the
    context does: its last statement is that function, with only the docstring as body. No prompt
    overlaps the lines of a prompt in ``avoid`` (e.g. the held-out set, cut from the same files);
    a file gives a second (third) prompt only once every file has given one (two). A method's prompt
    sits inside its class, so it parses only with the class line in its context.
    """
    import ast

    rng = random.Random(seed)
    taken: dict[str, list[range]] = {}
    for q in avoid:
        taken.setdefault(q["source"], []).append(range(q["first_line"], q["first_line"] + q["text"].count("\n") + 1))
    pool = [f for f in files if f.split == "heldout" and not is_test_path(f.relpath)
            and not f.relpath.startswith(("encodings/", "pydoc_data/"))]
    pool.sort(key=lambda f: hashlib.sha256(f"{seed}:{f.relpath}".encode()).hexdigest())
    candidates = {}
    for f in pool:
        try:
            tree = ast.parse(f.text)
        except (SyntaxError, ValueError):
            continue
        nodes = [node for node in ast.walk(tree)  # documented functions and methods with a real body
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and len(node.body) > 1 and not node.decorator_list and len(ast.get_docstring(node) or "") >= 40]
        rng.shuffle(nodes)
        candidates[f.relpath] = (f.text.splitlines(), nodes)
    prompts = []
    for _ in range(3):
        for relpath, (lines, nodes) in candidates.items():
            while nodes:
                node = nodes.pop()
                first, last = node.lineno - 1, node.body[0].end_lineno  # the def line .. the docstring's last line
                start = first
                while start > 0 and sum(len(line) + 1 for line in lines[start - 1:first]) <= context_chars:
                    start -= 1
                while start < first and not PROMPT_START.match(lines[start]):
                    start += 1  # the context starts where code starts, as the held-out prompts do
                span = range(start + 1, last + 1)  # 1-based lines
                if any(span.start < r.stop and r.start < span.stop for r in taken.get(relpath, [])):
                    continue
                taken.setdefault(relpath, []).append(span)
                prompts.append({"id": len(prompts), "source": relpath, "first_line": start + 1,
                                "def_line": first + 1, "text": "\n".join(lines[start:last]).rstrip()})
                break
            if len(prompts) == n:
                return prompts
    raise ValueError(f"only {len(prompts)} docstring-first prompts could be cut from {len(pool)} held-out files "
                     f"(wanted {n})")


HELDOUT_DESCRIPTION = ("Held-out prompts cut from Python standard-library files whose path hashes to the "
                       "held-out split (dflash_lab.corpus); neither the target nor the drafter trains on them.")
DOCSTRING_DESCRIPTION = ("Docstring-first prompts (corpus.cut_docstring_prompts): a function's signature and "
                         "docstring with the code above it, cut from the same held-out standard-library files as "
                         "the held-out set without overlapping its prompts; the continuation is the function body.")


def save_prompts(prompts: list[dict], path, *, description: str = HELDOUT_DESCRIPTION) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "description": description,
        "python": ".".join(map(str, sys.version_info[:3])),
        "prompts": prompts,
    }

    text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
    atomic_file(path, lambda tmp: tmp.write_text(text))


def load_prompts(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no held-out prompt file at {path}")
    try:
        doc = json.loads(path.read_text())
        prompts = doc["prompts"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a held-out prompt file ({type(e).__name__}: {e})") from None
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, dict) or not isinstance(p.get("text"), str)]
    if bad:
        raise ValueError(f"{path}: prompts {bad[:5]} have no `text` string")
    return prompts
