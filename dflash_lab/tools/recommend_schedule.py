"""Print the per-batch speculation schedule a benchmark record recommends, as ``vllm serve``'s JSON.

    python -m dflash_lab.tools.recommend_schedule --record benchmarks/spec_decode.json --method dflash

The rows come from ``measure.decoding.measurements_from_record``; the choice and the JSON from
``spec_decode.schedule`` (vLLM 0.33's ``num_speculative_tokens_per_batch_size``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..assets import DRAFTERS
from ..measure.decoding import (BATCHINGS, LOOKUP, drafter_methods, measurements_from_record, record_batching,
                                records_of)
from ..runtime import DEFAULT_TARGET, REPO_ROOT
from ..spec_decode.proposers import PromptLookupDrafter
from ..spec_decode.schedule import BASES, SWITCHES, format_recommendation, recommend_schedule, speculative_config_json


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_lab.tools.recommend_schedule", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, required=True, help="a spec-decode benchmark record (JSON)")
    parser.add_argument("--method", required=True, help="dflash, dflash_<drafter>, prompt_lookup or prompt_lookup_gpu")
    parser.add_argument("--prompt-set", default="heldout", help="whose rows to use (default: heldout)")
    parser.add_argument("--basis", choices=BASES, default="auto",
                        help="measured tokens/s, or batch * tau / step time (auto: measured when present)")
    parser.add_argument("--switch", choices=SWITCHES, default="log_midpoint",
                        help="where K changes between measured batch sizes")
    parser.add_argument("--batching", choices=BATCHINGS,
                        help="whose rows to use where a record holds both (default: continuous where present)")
    parser.add_argument("--max-batch", type=int, help="the server's max_num_seqs (default: largest measured)")
    parser.add_argument("--model", help="the drafter path to write (default: the shipped drafter of --method)")
    args = parser.parse_args(argv)

    record = json.loads(args.record.read_text())
    try:
        batching = record_batching(record, args.batching)
        rows = measurements_from_record(record, args.method, prompt_set=args.prompt_set, batching=batching)
        rec = recommend_schedule(rows, max_batch=args.max_batch, basis=args.basis, switch=args.switch)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    used = [r for r in records_of(record["records"], args.prompt_set)
            if r["method"] in (args.method, "target_only") and r.get("cuda_graphs")
            and (batching is None or r.get("batching") == batching)]
    def when(rows) -> str:
        return "; ".join(f"{d}, {t}" for d, t in sorted({(r.get("device", "?"), r.get("measured", "?")) for r in rows}))

    sets = sorted({r.get("prompt_set") or "heldout" for r in record["records"]} - {args.prompt_set})
    print(f"{args.method} on the {args.prompt_set} prompts of {args.record}, CUDA graphs on"
          + (f", {batching} batching" if batching else "") + f"; switch: {rec.switch}")
    print(f"measured on {when(used)}" + "".join(f"; the record's {s} rows on {when(records_of(record['records'], s))}"
                                             for s in sets))
    print(format_recommendation(rec) + "\n")
    if rec.num_speculative_tokens == 0:
        print("target-only wins at every measured batch size: serve without --speculative-config")
        return

    def shown(path) -> str:
        path = Path(path).resolve()
        return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)

    if args.method in LOOKUP:
        text = speculative_config_json(LOOKUP[args.method], None, None, rec.schedule,
                                       prompt_lookup_min=PromptLookupDrafter.prompt_lookup_min,
                                       prompt_lookup_max=PromptLookupDrafter.prompt_lookup_max)
    else:
        model = args.model or drafter_methods(DRAFTERS).get(args.method)
        if model is None:
            raise SystemExit(f"no shipped drafter for {args.method!r}: pass --model")
        text = speculative_config_json("dflash", shown(model), None, rec.schedule)
    print(f"--speculative-config '{text}'")
    print(f"e.g. (from the repository root): vllm serve {shown(DEFAULT_TARGET)} --speculative-config '{text}'")


if __name__ == "__main__":
    main()
