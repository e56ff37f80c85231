"""layertune: how many layers of a pretrained language model do you need to fine-tune?"""

from layertune.corpora import (
    GLUE_COLA,
    GLUE_MRPC,
    GLUE_RTE,
    GLUE_SST2,
    GLUE_STSB,
    IMDB,
    TASKS,
    load_corpus,
)
from layertune.corpus import Corpus
from layertune.drift import layer_drift, parameter_drift
from layertune.heads import TaskModel, TextClassifier, TextRegressor
from layertune.language_model import LanguageModel, encoder_layers
from layertune.trainer import ModelTrainer, TrainingResult

__all__ = [
    "GLUE_COLA", "GLUE_MRPC", "GLUE_RTE", "GLUE_SST2", "GLUE_STSB", "IMDB", "TASKS", "load_corpus",
    "Corpus", "LanguageModel", "encoder_layers", "TaskModel", "TextClassifier", "TextRegressor",
    "ModelTrainer", "TrainingResult", "parameter_drift", "layer_drift",
]
