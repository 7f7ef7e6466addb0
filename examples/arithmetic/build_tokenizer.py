"""Build the char-level tokenizer.json of the arithmetic example with the `tokenizers` package.

    python examples/arithmetic/build_tokenizer.py      # -> examples/arithmetic/tokenizer.json

One token per character of "0123456789+=", <|endoftext|> (id 0) as the special token that ends a
response (train.py finds it by name and stops there: support/tasks.py, "Stop tokens"), and <unk> (the last id)
for a character outside those: a token of its own, never a stop token, so train.py can tell it apart
and refuse a prompt that holds one (tasks.check_known_text).
"""
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

CHARS = "0123456789+="


def build(chars: str = CHARS) -> Tokenizer:
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(chars)}, "<unk>": len(chars) + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")   # every character a word
    tok.decoder = decoders.Fuse()                                               # joined without spaces
    tok.add_special_tokens(["<|endoftext|>", "<unk>"])
    return tok


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer.json")
    tok = build()
    tok.save(path)
    ids = tok.encode("12+34=").ids
    print(f"wrote {path}: {tok.get_vocab_size()} tokens; '12+34=' -> {ids} -> {tok.decode(ids)!r}")
