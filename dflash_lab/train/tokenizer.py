"""Stage 1: a byte-level BPE tokenizer for Python code, and the held-out prompt set.

Loading a trained tokenizer is ``dflash_lab.runtime.load_tokenizer`` (the one
way every module and chapter tokenizes); this module only trains and saves.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .. import corpus
from ..runtime import write_json
from .common import Clock

# The tokenizer's special tokens, in id order: the tiny target's config names
# pad=0, bos=1, eos=2, and DFlash's mask token is 3.
PAD, BOS, EOS, MASK = "<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, MASK]
PAD_ID, BOS_ID, EOS_ID, MASK_ID = range(4)


def train_tokenizer(texts, vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenisation) with our four specials first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, BOS_ID, EOS_ID, MASK_ID]
    return tok


def save_tokenizer(tok: Tokenizer, out_dir) -> None:
    """tokenizer.json + tokenizer_config.json, loadable by transformers' AutoTokenizer offline."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, mask_token=MASK,
        model_max_length=2048, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    # Name the class every transformers version knows (v5 writes its internal backend name).
    cfg_file = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    write_json(cfg_file, cfg, indent=1)


def run_tokenizer(args) -> None:
    """`python -m dflash_lab.train tokenizer`: cut the held-out prompts, then train the BPE on the rest."""
    clock = Clock()
    files = corpus.gather(args.corpus)
    prompts = corpus.cut_prompts(files, n=args.num_prompts, seed=args.seed)
    corpus.save_prompts(prompts, args.prompts)
    docstring_first = corpus.cut_docstring_prompts(files, n=args.num_prompts, avoid=prompts)  # the second set
    corpus.save_prompts(docstring_first, Path(args.prompts).with_name("docstring_prompts.json"),
                        description=corpus.DOCSTRING_DESCRIPTION)
    train_files = corpus.drop_files_containing(corpus.by_split(files)["train"], prompts)
    tok = train_tokenizer((f.text for f in train_files), args.vocab_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, out)
    sample = "".join(f.text for f in train_files[:50])
    n_tok = len(tok.encode(sample).ids)
    prompt_lens = [len(tok.encode(p["text"]).ids) for p in prompts]
    print(f"tokenizer: {tok.get_vocab_size()} tokens, {len(sample) / n_tok:.2f} chars/token on train text; "
          f"{len(prompts)} held-out prompts of {min(prompt_lens)}-{max(prompt_lens)} tokens -> {args.prompts}; "
          f"{clock.elapsed():.0f}s")
