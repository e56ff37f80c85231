"""Tiny randomly initialised encoders with a locally built tokenizer, for fast offline tests and examples."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import BertTokenizerFast

_WORDS = tuple(
    (
    "the a an is was are be not no very good bad great awful movie film plot actor story fun boring "
    "he she it they we you i who what guess left just somebody and or but of to in on for with this that "
    "love hate like best worst ever never really quite so too much more less happy sad funny dull . , ! ?"
    ).split()
)

# One small config per architecture family: all share hidden size 32 / 4 layers so tests stay fast.
TINY_CONFIGS: dict[str, dict] = {
    "bert": dict(model_type="bert", hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64),
    "roberta": dict(model_type="roberta", hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                    intermediate_size=64, pad_token_id=0, bos_token_id=2, eos_token_id=3),
    "electra": dict(model_type="electra", embedding_size=16, hidden_size=32, num_hidden_layers=4,
                    num_attention_heads=2, intermediate_size=64),
    "distilbert": dict(model_type="distilbert", dim=32, n_layers=4, n_heads=2, hidden_dim=64),
    "deberta-v2": dict(model_type="deberta-v2", hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                       intermediate_size=64, relative_attention=True, pos_att_type=["p2c", "c2p"],
                       max_relative_positions=-1, position_buckets=16, norm_rel_ebd="layer_norm",
                       share_att_key=True, position_biased_input=False),
    "mpnet": dict(model_type="mpnet", hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                  intermediate_size=64),
    "xlm-roberta": dict(model_type="xlm-roberta", hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                        intermediate_size=64, pad_token_id=0, bos_token_id=2, eos_token_id=3),
}


def build_tokenizer(directory: str | Path, extra_words: tuple[str, ...] = ()) -> BertTokenizerFast:
    """A WordPiece tokenizer over a small fixed vocabulary, saved to ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(_WORDS + tuple(extra_words))]
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz")
    (directory / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(directory / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(directory)
    return tokenizer


def make_tiny_model(directory: str | Path, architecture: str = "bert", seed: int = 0, *,
                    extra_words: tuple[str, ...] = (), **overrides) -> Path:
    """Save a tiny random ``architecture`` encoder plus tokenizer to ``directory``; load it by that path.

    ``extra_words`` grow the vocabulary, e.g. to give two test encoders different vocabularies.
    """
    directory = Path(directory)
    tokenizer = build_tokenizer(directory, extra_words)
    settings = {**TINY_CONFIGS[architecture], **overrides}
    config = transformers.AutoConfig.for_model(
        **settings, vocab_size=len(tokenizer), max_position_embeddings=128, type_vocab_size=2
    )
    torch.manual_seed(seed)
    transformers.AutoModel.from_config(config).save_pretrained(directory)
    return directory
