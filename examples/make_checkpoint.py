"""Make a small Hugging Face MoE checkpoint of your own: a tokenizer trained on your data and a Qwen3-MoE
model of the sizes you choose (random weights), in one folder train.py starts from.

    python examples/make_checkpoint.py out/my-moe --data=examples/arithmetic/train.jsonl
    python train.py --task=jsonl --init_from=out/my-moe --tokenizer=out/my-moe/tokenizer.json \
        --data=examples/arithmetic/train.jsonl --reward_fn=examples/arithmetic/reward.py:reward \
        --max_new_tokens=4 --out_dir=out/my-run

The tokenizer: BPE of --vocab_size tokens (the `tokenizers` package), trained on the JSONL's prompts and
answers, spaces kept SentencePiece-style; <|endoftext|> is the one special token, and config.json's
eos_token_id names it, so responses stop there. The model: any config.ModelConfig field by name
(--hidden_size=64 --num_hidden_layers=2 --num_experts=4 ...; DEFAULTS below), drawn with --seed and written
by model.save_pretrained in the layout transformers' Qwen3MoeForCausalLM reads.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from config import ConfigError, ModelConfig, apply_overrides, parse_args  # noqa: E402
from support import hf  # noqa: E402
from model import Transformer  # noqa: E402

EOS = "<|endoftext|>"
DEFAULTS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
                mlp_only_layers=[], max_position_embeddings=128)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()   # spaces survive a round trip
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False))
    return tok


def make(out: str, data: str, vocab_size: int = 32, seed: int = 0, **fields) -> str:
    """The folder `out`: config.json, model.safetensors, generation_config.json, tokenizer.json."""
    rows = [json.loads(line) for line in open(data, encoding="utf-8") if line.strip()]
    tok = train_tokenizer([r["prompt"] for r in rows] + [str(r.get("answer", "")) for r in rows], vocab_size)
    cfg = ModelConfig(**{**DEFAULTS, "vocab_size": tok.get_vocab_size()})
    apply_overrides({k: str(v) for k, v in fields.items()}, cfg)        # checked by name and type
    torch.manual_seed(seed)
    Transformer(cfg).save_pretrained(out)
    tok.save(os.path.join(out, "tokenizer.json"))
    hf.write_identity(out, hf.Identity(token_ids={"eos_token_id": tok.token_to_id(EOS)}))
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    try:
        opts = parse_args([a for a in sys.argv[1:] if a.startswith("--")])
        if len(args) != 1 or "data" not in opts:
            raise ConfigError("usage: python examples/make_checkpoint.py OUT_DIR --data=FILE.jsonl [--vocab_size=N] "
                              "[--seed=N] [--<ModelConfig field>=VALUE ...]")
        data, vocab, seed = opts.pop("data"), int(opts.pop("vocab_size", 32)), int(opts.pop("seed", 0))
        path = make(args[0], data, vocab, seed, **opts)
    except (ConfigError, OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    m = Transformer.from_pretrained(path)
    print(f"wrote {path}: {sum(p.numel() for p in m.parameters()):,} parameters, vocab {m.config.vocab_size}; "
          f"--init_from={path} --tokenizer={path}/tokenizer.json")
