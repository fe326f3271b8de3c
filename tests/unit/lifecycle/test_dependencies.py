"""The dependency graph and the questions it answers: model folder or repository, ensemble
steps, which model a repository serves (Triton's rule), what loads and unloads together."""

from __future__ import annotations

from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as pb

from quiver.errors import InvalidArgumentError
from quiver.lifecycle.dependencies import (
    DependencyGraph,
    Namespace,
    composing_of,
    ensemble_steps,
    folder_steps,
    is_model_folder,
    model_folders,
    served_folder,
    served_model,
)
from quiver.repository.local import ModelSource

ENSEMBLE = """
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
ensemble_scheduling {{ step [ {steps} ] }}
"""
STEP = '{{ model_name: "{model}" model_version: -1 input_map {{ key: "INPUT0" value: "IN" }} output_map {{ key: "OUTPUT0" value: "OUT" }} }}'


def ensemble(folder: Path, *steps: str) -> None:
    folder.mkdir(parents=True)
    (folder / "1").mkdir()
    text = ENSEMBLE.format(name=folder.name, steps=", ".join(STEP.format(model=s) for s in steps))
    (folder / "config.pbtxt").write_text(text)


def test_model_folder_or_repository(tmp_path: Path) -> None:
    (tmp_path / "a" / "1").mkdir(parents=True)  # a version folder: a model, config or not
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.pbtxt").write_text('backend: "identity"')
    (tmp_path / "repo" / "m").mkdir(parents=True)
    assert is_model_folder(tmp_path / "a") and is_model_folder(tmp_path / "b")
    assert not is_model_folder(tmp_path / "repo")


def test_ensemble_steps_from_a_config_a_folder_and_a_source(tmp_path: Path) -> None:
    proto = pb.ModelConfig(platform="ensemble")
    proto.ensemble_scheduling.step.add(model_name="pre")
    proto.ensemble_scheduling.step.add(model_name="net")
    assert ensemble_steps(proto) == {"pre", "net"}
    assert ensemble_steps(pb.ModelConfig(backend="onnxruntime")) is None
    ensemble(tmp_path / "pipe", "pre", "net")
    assert folder_steps(tmp_path / "pipe") == {"pre", "net"}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.pbtxt").write_text("garbage {")
    assert folder_steps(tmp_path / "bad") is None  # left for the load to report
    source = ModelSource("pipe", tmp_path, tmp_path / "pipe", archive="k.tar.gz", aliases=(("pre", "k.tar.gz::pre"),))
    assert composing_of(source, strict=False) == ["k.tar.gz::pre", "net"]  # served names
    assert composing_of(ModelSource("bad", tmp_path, tmp_path / "bad"), strict=False) is None


def test_which_model_a_repository_serves() -> None:
    assert served_model("archive 'k'", {"only": None}) == "only"
    assert served_model("x", {"pre": None, "net": None, "pipe": {"pre", "net"}}) == "pipe"
    # An ensemble used by another is not the top one.
    assert served_model("x", {"pre": None, "inner": {"pre"}, "outer": {"inner"}}) == "outer"
    with pytest.raises(InvalidArgumentError, match=r"archive 'k' holds several models \(a, b\) and no ensemble"):
        served_model("archive 'k'", {"a": None, "b": None})
    with pytest.raises(InvalidArgumentError, match=r"several ensembles that no other model uses \(e1, e2\)"):
        served_model("x", {"m": None, "e1": {"m"}, "e2": {"m"}})


def test_the_graph_of_ensembles() -> None:
    graph = DependencyGraph()
    graph.set_composing("outer", ["inner", "post"])
    graph.set_composing("inner", ["pre"])
    graph.set_composing("other", ["pre"])
    serving = {"outer", "inner"}.__contains__
    assert graph.closure("outer") == {"inner", "post", "pre"}
    assert graph.dependents("pre", serving) == ["inner"]  # "other" is not loaded
    with graph.loading("new", ["post", "x"]):
        assert graph.requires("new") == {"post", "x"}
    assert graph.requires("new") == set()
    assert graph.forget_ensemble("inner") == {"pre"} and graph.closure("outer") == {"inner", "post"}


def test_archive_namespaces() -> None:
    graph = DependencyGraph()
    released: list[str] = []
    member = ModelSource("k::pre", Path("/x"), Path("/x/pre"), archive="k")
    graph.add_namespace(Namespace("k", "k", {"k::pre": member}, lambda: released.append("k")))
    assert graph.has_namespace("k") and graph.namespace_of("k::pre") == "k"
    assert graph.member("k::pre") is member and graph.member("pre") is None
    namespace = graph.pop_namespace("k")
    assert namespace is not None and graph.namespace_of("k::pre") is None and not graph.has_namespace("k")
    assert graph.pop_namespace("k") is None


def test_the_folder_a_repository_folder_serves(tmp_path: Path) -> None:
    single = tmp_path / "single"
    (single / "1").mkdir(parents=True)
    (single / "config.pbtxt").write_text('backend: "identity"')
    assert served_folder(single, "url 'single'") == single
    (tmp_path / "bare" / "1").mkdir(parents=True)
    with pytest.raises(InvalidArgumentError, match=r"url 'bare' holds no config\.pbtxt"):
        served_folder(tmp_path / "bare", "url 'bare'")
    repo = tmp_path / "repo"
    ensemble(repo / "pipe", "pre")
    (repo / "pre" / "1").mkdir(parents=True)
    (repo / "pre" / "config.pbtxt").write_text('backend: "identity"')
    (repo / ".hidden").mkdir()
    (repo / "notes").mkdir()  # no config.pbtxt: not a model
    (repo / "link").symlink_to(repo / "pre")
    assert [p.name for p in model_folders(repo)] == ["pipe", "pre"]
    assert served_folder(repo, "archive 'r'") == repo / "pipe"
    (tmp_path / "empty" / "stuff").mkdir(parents=True)
    with pytest.raises(InvalidArgumentError, match=r"holds no model: .* \(it holds 'stuff/'\)"):
        served_folder(tmp_path / "empty", "archive 'e'")
