"""Make a tiny random-weight llama model that the real ``mlx_lm.server`` loads in seconds.

Run with the *server's* interpreter (it needs ``mlx``, ``mlx_lm`` and ``tokenizers``), never
imported by mlxwatch itself::

    python tiny_model.py OUT_DIR

The model is useless for text and perfect for liveness: it loads offline, generates at CPU speed
and exercises the same batch loop, prompt cache and streaming code as a 26B model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "mlxwatch sends a short probe and counts delivered tokens",
    "a server that answers models but never generates is not healthy",
    "prompt processing progress keeps the connection alive",
    "reply with ok if you can read this message",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]


def make_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return tok.get_vocab_size()


def make_model(out: Path, vocab_size: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    mx.random.seed(7)  # deterministic weights: the same probe text every run
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=1))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: tiny_model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    make_model(out, make_tokenizer(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
