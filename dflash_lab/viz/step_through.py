"""One speculative-decoding step, drawn as a table: draft -> verify -> accept.

``step_through_html`` takes a ``SpecDecodeResult`` (its ``steps`` record what each step
proposed and what the target preferred) and the index of one step, and draws:

    the block the drafter read       x_t, then a mask token at every other block position
    the drafter's guess              d_1 .. d_K, all from ONE drafter forward
    the target's choice              its top token at each position, from ONE target forward
                                     over [x_t, d_1 .. d_K]
    the verdict                      accepted up to the first disagreement, which is rejected;
                                     later guesses are never checked (their target's choice: —)
    what the step emitted            the accepted drafts + one token of the target's own
                                     (the correction after a rejection, the bonus when all were kept)

and, beside it, which block keys each block query could see (the drafter's attention mask:
full attention sees the whole block, a causal layer only the keys up to its own position).
Every token cell carries ``data-kind`` (input, mask, accepted, rejected, unchecked,
correction, bonus) so a test can read what is highlighted.
"""

from __future__ import annotations

import html

from dflash_lab.viz.acceptance import TOKEN_COLORS, _token_text
from dflash_lab.viz.common import PALETTE, _array

# data-kind -> (text colour, background); the accepted / rejected / target colours are chapter 3's.
_KIND_STYLE = {
    "input": ("#000000", "#e8e8e8"),
    "mask": (PALETTE["grey"], "#f4f4f4"),
    "accepted": (TOKEN_COLORS["accepted"], TOKEN_COLORS["accepted"] + "22"),
    "rejected": (TOKEN_COLORS["rejected"], TOKEN_COLORS["rejected"] + "22"),
    "unchecked": ("#9a9a9a", "#ffffff"),
    "correction": (TOKEN_COLORS["bonus"], TOKEN_COLORS["bonus"] + "22"),
    "bonus": (TOKEN_COLORS["bonus"], TOKEN_COLORS["bonus"] + "22"),
    "target": ("#333333", "#ffffff"),
    "empty": ("#bbbbbb", "#ffffff"),
}

_CSS = """
<style>
.dflash-st table.dflash-st-table {border-collapse:collapse;font-size:12px;margin:4px 0;}
.dflash-st .dflash-st-table th, .dflash-st .dflash-st-table td {border:1px solid #d0d0d0;padding:2px 5px;
  text-align:center;vertical-align:middle;}
.dflash-st .dflash-st-table th {background:#f0f0f0;font-weight:normal;white-space:nowrap;}
.dflash-st .dflash-st-table th.row {text-align:right;}
.dflash-st .tok {font-family:monospace;white-space:pre;border-radius:3px;padding:0 2px;}
.dflash-st .mask td {width:14px;height:14px;padding:0;border:1px solid #fff;}
.dflash-st .note {font-size:12px;color:#333;margin:2px 0;}
.dflash-st pre {white-space:pre-wrap;font-family:monospace;font-size:12px;line-height:1.5;margin:4px 0;}
</style>
"""


def _decode(tokenizer, token_id: int) -> str:
    return _token_text(tokenizer, token_id) if tokenizer is not None else str(token_id)


def _cell_text(tokenizer, token_id: int) -> str:
    """A token on one line for a table cell: ↵ for a newline, · for a space."""
    return _decode(tokenizer, token_id).replace("\n", "").replace(" ", "·")


def _tok(tokenizer, token_id: int | None, kind: str, hover: str = "", *, mask_label: str = "[MASK]",
         inline: bool = False) -> str:
    """One token as a coloured span (``inline``: as it reads in running text); ``data-kind`` says what it is."""
    fg, bg = _KIND_STYLE[kind]
    text = _decode if inline else _cell_text
    text = mask_label if kind == "mask" else ("" if token_id is None else text(tokenizer, token_id))
    strike = "text-decoration:line-through;" if kind == "rejected" else ""
    title = f' title="{html.escape(hover, quote=True)}"' if hover else ""
    return (f'<span class="tok" data-kind="{kind}" style="color:{fg};background:{bg};{strike}"{title}>'
            f"{text or '∅'}</span>")


def step_verdicts(step) -> list[str]:
    """Per drafted position j = 1 .. K: 'accepted', 'rejected' (the first disagreement) or 'unchecked'."""
    n, k = step.num_accepted, len(step.draft_ids)
    return ["accepted" if j < n else "rejected" if j == n else "unchecked" for j in range(k)]


def _mask_grid(mask, context_len: int, block_len: int, *, causal: bool, window) -> str:
    """The block part of the attention mask as a small grid, and what each query sees of the context."""
    m = _array(mask) > 0.5  # (Q, N+Q)
    rows = []
    for q in range(block_len):
        seen_ctx = int(m[q, :context_len].sum())
        cells = "".join(
            f'<td style="background:{PALETTE["orange"] if m[q, context_len + k] else "#eeeeee"}" '
            f'title="query {q} {"sees" if m[q, context_len + k] else "does not see"} block key {k}"></td>'
            for k in range(block_len))
        label = "x_t" if q == 0 else f"m{q}"
        rows.append(f'<tr><th class="row" style="font-size:11px">{label}</th>{cells}'
                    f'<td style="width:auto;padding-left:6px;font-size:11px;border:none;white-space:nowrap">'
                    f"+ {seen_ctx} context keys</td></tr>")
    head = "".join(f'<th style="font-size:10px;width:14px;padding:0">{k}</th>' for k in range(block_len))
    kind = "causal: query j sees block keys 0..j" if causal else "not causal: every query sees the whole block"
    win = (f"window {window} ({'last' if causal else '±'}{window} positions)" if window is not None
           else "no window")
    return (f'<div class="note"><b>Drafter attention inside the block</b>: {kind}; {win}.</div>'
            f'<table class="dflash-st-table mask"><tr><th></th>{head}<th style="border:none"></th></tr>'
            f'{"".join(rows)}</table>'
            f'<div class="note" style="color:{PALETTE["orange"]}">■ block key visible</div>')


def step_through_html(result, step_index: int, tokenizer=None, *, mask=None, causal: bool | None = None,
                      window: int | None = None, context_tail: int = 24, title: str | None = None) -> str:
    """HTML for step ``step_index`` of ``result`` (a ``SpecDecodeResult``); step 0 is the prefill.

    ``mask`` (optional, (Q, N+Q) bool, ``block_attention.dflash_attention_mask`` for this block without
    the batch axis) draws the drafter's attention inside the block; ``causal`` and ``window``
    label it. ``tokenizer`` decodes tokens (``decode(ids)``); without one, ids are shown.
    """
    steps = result.steps
    if not 0 <= step_index < len(steps):
        raise ValueError(f"step_index must be in 0..{len(steps) - 1}, got {step_index}")
    step = steps[step_index]
    t = step.position - 1  # position of x_t
    n, k = step.num_accepted, len(step.draft_ids)
    verdicts = step_verdicts(step)
    produced = sum(len(s.token_ids) for s in steps[:step_index + 1])
    forwards = step_index + 1  # the prefill, then one verification per step

    sequence = result.output_ids[0].tolist()
    x_t = sequence[t] if t < len(sequence) else None
    # Columns: block position j = 0 (x_t) .. K, then K+1 (the bonus slot, past the block).
    cols = list(range(k + 2)) if k else [0, 1]
    header = "".join(f"<th>j={j}<br><small>pos {t + j}</small></th>" for j in cols)

    def row(label: str, cells: list[str]) -> str:
        return f'<tr><th class="row">{label}</th>{"".join(f"<td>{c}</td>" for c in cells)}</tr>'

    block_ids = step.block_ids or ([x_t] if x_t is not None else [])
    drafter_in = []
    for j in cols:
        if j == 0:
            drafter_in.append(_tok(tokenizer, x_t, "input", "x_t: the newest token, the block's only real one"))
        elif step.block_ids and j < len(block_ids):
            drafter_in.append(_tok(tokenizer, None, "mask", f"mask token {block_ids[j]}"))
        else:
            drafter_in.append("")
    guesses = [""] * len(cols)  # filled below: accepted, the first rejected, then unchecked
    choice = []
    for j in cols[1:]:
        c = step.target_argmax[j - 1] if j - 1 < len(step.target_argmax) else None
        if c is None:
            choice.append("")
        elif j <= n:
            choice.append(_tok(tokenizer, c, "target", f"the target's top token at position {t + j}"))
        elif j == n + 1:
            kind = "bonus" if n == k else "correction"
            choice.append(_tok(tokenizer, c, kind, f"the target's top token at position {t + j}: its {kind}"))
        else:  # read after a rejected guess: the target saw a prefix that is thrown away, so nothing is shown
            choice.append(f'<span style="color:{_KIND_STYLE["unchecked"][0]}" title="never checked: the target '
                          f'read this position after the rejected guess, so its choice here is discarded">—</span>')
    verdict_cells = []
    for j in cols[1:]:
        if j <= k:
            v = verdicts[j - 1]
            mark = {"accepted": "✓ accepted", "rejected": "✗ first rejection", "unchecked": "· never checked"}[v]
            color = {"accepted": TOKEN_COLORS["accepted"], "rejected": TOKEN_COLORS["rejected"],
                     "unchecked": "#9a9a9a"}[v]
            verdict_cells.append(f'<span style="color:{color};white-space:nowrap">{mark}</span>')
        else:
            verdict_cells.append('<span style="white-space:nowrap">bonus slot</span>' if k and n == k else "")
    emitted = []
    for j in cols[1:]:
        i = j - 1
        if i < len(step.token_ids):
            if i < n:
                emitted.append(_tok(tokenizer, step.token_ids[i], "accepted", f"d_{j} kept"))
            else:
                kind = "bonus" if n == k else "correction"
                hover = ("the target's bonus token: every draft was kept" if kind == "bonus" and k else
                         "the target's own token (no draft this step)" if not k else
                         f"the target's correction at position {t + j}, replacing the rejected d_{j}")
                emitted.append(_tok(tokenizer, step.token_ids[i], kind if k else "bonus", hover))
        else:
            emitted.append("")
    # The rejected guess, struck through, in the guess row.
    if n < k:
        guesses[n + 1] = _tok(tokenizer, step.draft_ids[n], "rejected", f"d_{n + 1} rejected")
        for j in range(n + 1, k):
            guesses[j + 1] = _tok(tokenizer, step.draft_ids[j], "unchecked", f"d_{j + 1} discarded, never checked")
    for j in range(min(n, k)):
        guesses[j + 1] = _tok(tokenizer, step.draft_ids[j], "accepted", f"d_{j + 1} accepted")

    if step_index == 0:
        summary = (f"<b>Prefill</b>: the target reads the {result.prompt_length}-token prompt in one forward "
                   "and says the first new token; nothing is drafted yet.")
    elif not k:
        summary = (f"<b>Step {step_index}</b>: no draft (prompt lookup found no match), so the target decodes "
                   "one token, as plain decoding would.")
    else:
        kind = "bonus" if n == k else "correction"
        summary = (f"<b>Step {step_index}</b> of {len(steps) - 1}: the drafter proposed <b>{k}</b> tokens in one "
                   f"forward; the target checked them in <b>one</b> forward and kept <b>{n}</b>, then added its own "
                   f"{kind} token: <b>{len(step.token_ids)}</b> token{'s' if len(step.token_ids) != 1 else ''} for 1 "
                   "target forward, so "
                   f"<b>{len(step.token_ids) - 1}</b> target forward{'s' if len(step.token_ids) != 2 else ''} "
                   "saved against plain decoding.")
    running = (f"So far: {produced} tokens from {forwards} target forwards (plain greedy decoding: {produced}), "
               f"{produced - forwards} saved.")

    table = (f'<table class="dflash-st-table"><tr><th class="row">block position</th>{header}</tr>'
             + row("drafter reads (x_t + masks)", drafter_in)
             + row("drafter's guess d_j", guesses)
             + row("target's choice", [""] + choice)
             + row("verdict", [""] + verdict_cells)
             + row("emitted this step", [""] + emitted)
             + "</table>")

    before = sequence[max(0, t + 1 - context_tail):t + 1]
    story = (f'<span style="color:{PALETTE["grey"]}">{"".join(_decode(tokenizer, i) for i in before)}</span>'
             + "".join(_tok(tokenizer, tok, "accepted" if i < n else ("bonus" if n == k else "correction"),
                            "this step", inline=True)
                       for i, tok in enumerate(step.token_ids)))
    side = ""
    if mask is not None and step.block_ids:
        q = len(step.block_ids)
        side = _mask_grid(mask, _array(mask).shape[1] - q, q, causal=bool(causal), window=window)
    heading = f'<div style="font-weight:bold;margin-bottom:2px">{html.escape(title)}</div>' if title else ""
    return (f'{_CSS}<div class="dflash-st" data-step="{step_index}">{heading}'
            f'<div class="note">{summary}<br>{running}</div>'
            f'<div style="display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start">'
            f'<div style="overflow-x:auto;max-width:100%">{table}</div><div>{side}</div></div>'
            f'<div class="note">In the table, · is a space and ↵ a newline. The text up to x_t, then what this '
            f'step emitted:</div><pre>{story}</pre></div>')
