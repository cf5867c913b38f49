"""A word-level tokenizer built offline (the `tokenizers` package): <pad>, <s>, </s>, "abcdef"
(the probe transformers' stop-string matching tokenizes), then words w4 .. w{n-1}; text is the
words joined by spaces."""

from __future__ import annotations


def tiny_tokenizer(vocab: int = 128):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "abcdef"] + [f"w{i}" for i in range(4, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
