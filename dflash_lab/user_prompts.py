"""Your own prompts: a file named by $DFLASH_LAB_PROMPTS (or any path), read into a list of texts.

Two formats:
    prompts.json   a JSON list of strings (or of objects with a "text" key)
    prompts.txt    plain UTF-8 text; prompts are separated by lines that hold only ``---``

Chapter 3's explorer offers these prompts as a prompt set of their own, next to a text box.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PROMPTS_ENV = "DFLASH_LAB_PROMPTS"
SEPARATOR = "---"


def load_prompt_file(path) -> list[str]:
    """The prompts in ``path`` (format by suffix: .json, else text separated by ``---`` lines)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts file {path} is not UTF-8 text: {e.reason}") from None
    if path.suffix.lower() == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompts file {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
        if not isinstance(items, list):
            raise ValueError(f"prompts file {path} must hold a JSON list of strings, got {type(items).__name__}")
        prompts = []
        for i, item in enumerate(items):
            value = item.get("text") if isinstance(item, dict) else item
            if not isinstance(value, str):
                raise ValueError(f"prompts file {path}: item {i} must be a string or an object with a "
                                 f"string 'text', got {item!r}")
            prompts.append(value)
    else:
        blocks, current = [], []
        for line in text.splitlines():
            if line.strip() == SEPARATOR:
                blocks.append("\n".join(current))
                current = []
            else:
                current.append(line)
        blocks.append("\n".join(current))
        prompts = blocks
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompt (separate text prompts with lines of {SEPARATOR!r})")
    return prompts


def prompts_from_env() -> tuple[str, list[str]] | None:
    """(the file's path, its prompts) when $DFLASH_LAB_PROMPTS is set, else None."""
    value = os.environ.get(PROMPTS_ENV)
    if not value:
        return None
    return value, load_prompt_file(value)
