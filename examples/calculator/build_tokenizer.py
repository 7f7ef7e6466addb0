"""Build the calculator example's char-level tokenizer.json: the arithmetic example's, with "?" (a tool
call ends there) and ";" (the tool's answer ends there).

    python examples/calculator/build_tokenizer.py      # -> examples/calculator/tokenizer.json

Ids: <|endoftext|> 0, then one per character of "0123456789+=?;" from 1: "?" is id 13, the stop token
of a tool call (--stop_tokens=0,13: a turn ends at <|endoftext|> or at "?"); <unk> 15.
"""
import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
CHARS = "0123456789+=?;"

if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("build_tokenizer", os.path.join(HERE, "..", "arithmetic", "build_tokenizer.py"))
    arithmetic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arithmetic)
    tok = arithmetic.build(CHARS)
    path = os.path.join(HERE, "tokenizer.json")
    tok.save(path)
    ids = tok.encode("14+19?").ids
    print(f"wrote {path}: {tok.get_vocab_size()} tokens; '14+19?' -> {ids} -> {tok.decode(ids)!r}")
