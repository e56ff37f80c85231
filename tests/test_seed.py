"""`train(seed=s)` reproduces in any process: every new, untrained part of a model is drawn from the training seed
(`TaskModel.begin_training`, `layertune.initialization`), whatever the global generator held when it was built."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from layertune import IA3, LanguageModel, Lora, ModelTrainer, MultiEncoder, TextClassifier
from layertune.specs import CellSpec


def classifier(path, global_seed, **options):
    """A classifier built after seeding the global generator with ``global_seed`` (what a process drew before)."""
    torch.manual_seed(global_seed)
    return TextClassifier(LanguageModel(path, **{"tunable_layers": 2, **options}), 2, head="mlp")


def checkpoint(path):
    return LanguageModel(path, tunable_layers=0).model.state_dict()


def test_the_new_parts_are_drawn_from_the_training_seed_alone(tiny_bert):
    """The pooler (missing from the checkpoint), LoRA's A and B and the MLP head come out the same whatever the
    global generator held; another seed draws them otherwise; the checkpoint's weights are untouched."""
    models = [classifier(tiny_bert, global_seed, method=Lora(r=2)) for global_seed in (0, 1, 2)]
    assert not torch.equal(models[0].head[1].weight, models[1].head[1].weight)  # built from the global state
    for model, seed in zip(models, (5, 5, 6)):
        model.begin_training(seed)
    first, second, other = (m.state_dict() for m in models)
    assert all(torch.equal(first[name], second[name]) for name in first)
    drawn = [name for name in first if not torch.equal(first[name], other[name])]
    assert any("lora_A" in n for n in drawn) and any("head." in n for n in drawn), drawn
    assert all("lora_A" in n or "head." in n or "pooler" in n for n in drawn), drawn
    lora_b = [v for n, v in first.items() if "lora_B" in n]
    assert lora_b and all(not v.any() for v in lora_b)  # LoRA's update starts at zero
    base = checkpoint(tiny_bert)
    plain = {n.removeprefix("encoder.model.").replace(".base_layer.", "."): v for n, v in first.items()}
    assert all(torch.equal(plain[name], value) for name, value in base.items() if "pooler" not in name)


def test_ia3_starts_at_ones_and_dme_is_drawn_from_the_seed(tiny_model_dirs):
    def build(global_seed):
        torch.manual_seed(global_seed)
        lms = [LanguageModel(tiny_model_dirs["bert"], tunable_layers=1, method=IA3(), pooling="mean"),
               LanguageModel(tiny_model_dirs["roberta"], tunable_layers=1)]
        model = TextClassifier(MultiEncoder(lms, "dme"), 2)
        model.begin_training(11)
        return model.state_dict()

    first, second = build(0), build(1)
    assert all(torch.equal(first[name], second[name]) for name in first)
    ia3 = [v for n, v in first.items() if "ia3_l" in n]
    assert ia3 and all(torch.equal(v, torch.ones_like(v)) for v in ia3)
    assert any(n.startswith("encoder.combine.") for n in first)
    assert not torch.equal(first["head.1.weight"], build_dme_head(tiny_model_dirs, 0))  # drawn anew, not as built


def build_dme_head(tiny_model_dirs, global_seed):
    torch.manual_seed(global_seed)
    lms = [LanguageModel(tiny_model_dirs["bert"], tunable_layers=1, method=IA3(), pooling="mean"),
           LanguageModel(tiny_model_dirs["roberta"], tunable_layers=1)]
    return TextClassifier(MultiEncoder(lms, "dme"), 2).head[1].weight


def test_a_trained_or_loaded_model_keeps_its_weights(tiny_bert, toy_corpus, tmp_path):
    """A second `train` continues from the first; a saved model trains on from its saved weights."""
    model = classifier(tiny_bert, 0)
    trainer = ModelTrainer(model, toy_corpus, cache_dir=tmp_path / "cache")
    trainer.train(epochs=1, batch_size=16, seed=1, progress=False)
    model.save(tmp_path / "saved")
    trained = {n: v.clone() for n, v in model.state_dict().items()}
    model.begin_training(2)
    assert all(torch.equal(trained[n], v) for n, v in model.state_dict().items())
    loaded = TextClassifier.from_pretrained(tmp_path / "saved")
    loaded.begin_training(3)
    assert all(torch.equal(trained[n], v) for n, v in loaded.state_dict().items())


def test_a_refused_train_leaves_the_parts_untrained_and_changed_parts_are_kept(tiny_bert, toy_corpus, tmp_path):
    """A `train` refused before its first step has trained nothing: the next, with another seed, draws from that
    seed as a fresh process would. Parts changed after building (a loop of one's own) are the model's own."""
    model, fresh = classifier(tiny_bert, 0), classifier(tiny_bert, 1)
    with pytest.raises(ValueError, match="max_length"):
        ModelTrainer(model, toy_corpus, cache_dir=tmp_path).train(seed=1, max_length=10**6, progress=False)
    assert not model.trained
    model.begin_training(2)
    fresh.begin_training(2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    with torch.no_grad():
        fresh.head[1].weight.add_(1.0)
    assert fresh.trained
    fresh.begin_training(3)
    assert torch.equal(fresh.head[1].weight, model.head[1].weight + 1.0)


def test_a_cell_draws_its_parts_as_building_it_right_after_seeding_did(tiny_model_dirs, toy_corpus):
    """A cell's new parts are drawn from ``training.seed`` when training begins, like any model's; the draws are those
    a model built right after seeding had (how cells were built before: their numbers stand), LoRA's and IA3's
    adapters, a checkpoint's gaps, dme's layers and an MLP head included."""
    lora = {"model": str(tiny_model_dirs["bert"]), "tunable_layers": 2, "method": "lora"}
    ia3 = {"model": str(tiny_model_dirs["roberta"]), "tunable_layers": 1, "method": "ia3", "pooling": "mean"}
    for cell in ({"encoders": [lora], "head": {"head": "mlp"}},
                 {"encoders": [ia3, lora], "combine": {"method": "dme"}}):
        spec = CellSpec.model_validate({"corpus": {"task": "sst2"}, **cell, "training": {"seed": 4}})
        transformers.set_seed(4)
        seeded = spec.build_model(toy_corpus).state_dict()
        torch.manual_seed(0), torch.rand(7)  # whatever the process drew before
        model = spec.build_model(toy_corpus)
        model.begin_training(4)
        assert seeded.keys() == model.state_dict().keys()
        assert all(torch.equal(seeded[n], v) for n, v in model.state_dict().items())


# One process's runs, printed as JSON: the library's `train` with the cache as ``caches`` says (cold or warm) and
# off, and a `train_cell`; ``dirty`` first builds and trains another model and draws random numbers.
WORKER = r"""
import json, random, sys
import numpy, torch
from layertune import LanguageModel, ModelTrainer, TextClassifier, load_corpus
from layertune.cell import train_cell
from layertune.specs import CellSpec

model_path, data_mirror, dirty, caches, cell_cache, precision = sys.argv[1], sys.argv[2], sys.argv[3] == "dirty", \
    json.loads(sys.argv[4]), sys.argv[5], sys.argv[6]
corpus = load_corpus("sst2", data_mirror=data_mirror, train_size=128, dev_size=64, seed=0)
steps = []
train_epoch = ModelTrainer._train_epoch
def record_steps(self, *args, **kwargs):
    steps.append(train_epoch(self, *args, **kwargs))
    return steps[-1]
ModelTrainer._train_epoch = record_steps
recipe = {"epochs": 1, "batch_size": 16, "seed": 3, "learning_rate": 1e-4, "max_length": 48,
          "mixed_precision": precision}

def run(cache_dir, cached):
    model = TextClassifier(LanguageModel(model_path, tunable_layers=2, pooling="mean"), 2)
    result = ModelTrainer(model, corpus, cache_dir=cache_dir).train(frozen_prefix_cache=cached, progress=False,
                                                                    **recipe)
    return {"steps": steps.pop(), "dev": result.predictions["dev"]["predictions"],
            "cached": result.frozen_prefix_cache["used"]}

if dirty:
    other = TextClassifier(LanguageModel(model_path, tunable_layers=1, method="lora"), 2, head="mlp")
    ModelTrainer(other, corpus, cache_dir=cell_cache).train(epochs=1, batch_size=32, seed=7, progress=False)
    random.random(), numpy.random.rand(), torch.rand(1000)
runs = {name: run(cache_dir, True) for name, cache_dir in caches.items()}
runs["off"] = run(cell_cache, False)
spec = CellSpec.model_validate({"corpus": {"task": "sst2", "train_size": 128, "dev_size": 64},
                                "encoders": [{"model": model_path, "tunable_layers": 2, "pooling": "mean"}],
                                "training": recipe})
cell = train_cell(spec, data_mirror=data_mirror, cache_dir=cell_cache, progress=False)
runs["cell"] = {"steps": steps.pop(), "dev": cell.result.predictions["dev"]["predictions"]}
print(json.dumps(runs))
"""


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_train_reproduces_in_any_process_whatever_the_cache(minilm_l3, data_mirror, tmp_path, precision):
    """Two fresh processes and one that trained another model and drew random numbers first: identical step losses
    and dev predictions, with the frozen-prefix cache cold (an empty folder), warm (filled by another run) and off;
    in float32 and in bfloat16 autocast alike (a bf16 rebuild on one machine is the build before it, bit for bit).
    On a CPU without native bfloat16, bf16 is refused with its one line instead."""
    from layertune.training_config import cpu_has_native_bf16

    def process(state, caches):
        done = subprocess.run([sys.executable, "-c", WORKER, str(minilm_l3), str(data_mirror), state,
                               json.dumps({k: str(v) for k, v in caches.items()}), str(tmp_path / f"cell-{state}"),
                               precision], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    if precision == "bf16" and not torch.cuda.is_available() and not cpu_has_native_bf16():
        with pytest.raises(AssertionError, match="this CPU has no native bfloat16"):
            process("fresh", {"cold": tmp_path / "a"})
        return

    first = process("fresh", {"cold": tmp_path / "a"})
    assert any((tmp_path / "a" / "frozen_prefix").iterdir())  # the next process finds it warm
    second = process("fresh", {"warm": tmp_path / "a"})
    third = process("dirty", {"cold": tmp_path / "b", "warm": tmp_path / "b"})
    cached = [first["cold"], second["warm"], third["cold"], third["warm"]]
    assert all(run["cached"] for run in cached)
    assert all(run == cached[0] for run in cached), [run["steps"] for run in cached]
    assert first["off"] == second["off"] == third["off"] and not first["off"]["cached"]
    assert first["cell"] == second["cell"] == third["cell"]
    # Uncached, the frozen layers run in other batch shapes: the same up to float rounding (docs/library.md).
    assert first["off"]["dev"] == first["cold"]["dev"]
    assert first["off"]["steps"] == pytest.approx(first["cold"]["steps"], abs=1e-6 if precision == "no" else 5e-4)
