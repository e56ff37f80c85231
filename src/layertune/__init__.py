"""layertune: how many layers of a pretrained language model do you need to fine-tune?"""

import importlib

# Public names → defining module. Loaded on first use, so `import layertune` stays cheap (no torch import).
_EXPORTS = {
    "GLUE_COLA": "corpora", "GLUE_MRPC": "corpora", "GLUE_RTE": "corpora", "GLUE_SST2": "corpora",
    "GLUE_STSB": "corpora", "IMDB": "corpora", "CONLL_03": "corpora", "load_corpus": "corpora", "TASKS": "corpora",
    "Corpus": "corpus",
    "LanguageModel": "language_model", "encoder_layers": "layer_stack", "MultiEncoder": "multi_encoder",
    "Encoder": "encoder",
    "TaskModel": "heads", "TextClassifier": "heads", "TextRegressor": "heads", "TokenClassifier": "heads",
    "ModelTrainer": "trainer", "TrainingResult": "trainer", "TrainingConfig": "training_config",
    "CellSpec": "specs", "train_cell": "cell",
    "TopK": "tuning_methods", "Lora": "tuning_methods", "IA3": "tuning_methods", "BitFit": "tuning_methods",
    "TuningMethod": "tuning_methods",
    "parameter_drift": "drift", "layer_drift": "drift",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'layertune' has no attribute {name!r}")
    return getattr(importlib.import_module(f"layertune.{_EXPORTS[name]}"), name)
