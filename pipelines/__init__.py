"""The Kedro project of layertune: nodes are thin functions over `layertune`; every path is in
``conf/base/catalog.yml``, every parameter in the root ``params.yaml``."""

# The stages, in order: each is a DVC stage and a Kedro pipeline of the same name (pipelines/<stage>/).
STAGES = ("plan", "download", "prepare", "tokenize", "train", "evaluate", "aggregate")
