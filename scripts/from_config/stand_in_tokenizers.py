"""Stand-in tokenizers for pipelines run from configs: the real ones are downloads, and a step's memory
does not depend on which tokens a prompt becomes, only on how many (padded to the model's length).

    python scripts/from_config/stand_in_tokenizers.py clip FOLDER        # CLIP's, a token per byte
    python scripts/from_config/stand_in_tokenizers.py t5 FOLDER WORD...  # T5's, a unigram of the words
"""

import json
import sys
from pathlib import Path


def clip_bytes(folder: Path, max_length: int = 77) -> object:
    """CLIP's byte-level tokenizer with no merges (each printable byte a token, as a vocabulary of any size allows), saved in ``folder``."""
    from transformers import CLIPTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for b in range(33, 127):
        vocab[chr(b)] = len(vocab)
        vocab[chr(b) + "</w>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=max_length)
    tokenizer.save_pretrained(folder)
    return tokenizer


def t5_words(folder: Path, words: list[str], max_length: int = 512) -> object:
    """T5's fast tokenizer as a unigram of ``words`` (with its pad, end and unknown pieces), saved in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import T5TokenizerFast

    pieces = ["<pad>", "</s>", "<unk>", *dict.fromkeys(words)]
    model = Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=2))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = T5TokenizerFast(
        tokenizer_object=model, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0, model_max_length=max_length
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


if __name__ == "__main__":
    kind, where = sys.argv[1], Path(sys.argv[2])
    if kind == "clip":
        clip_bytes(where)
    elif kind == "t5":
        t5_words(where, sys.argv[3:])
    else:
        sys.exit(f"stand_in_tokenizers: {kind!r} is not a kind this makes (clip, t5)")
