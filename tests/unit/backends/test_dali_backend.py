"""The DALI backend's rewrite of a GPU pipeline for the CPU, and what a server without DALI
says when a DALI model loads."""

from __future__ import annotations

import sys

import pytest

from quiver.backends import base
from quiver.errors import InvalidArgumentError, QuiverError, UnavailableError


def test_without_dali_the_load_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    monkeypatch.delitem(sys.modules, "quiver.backends.dali", raising=False)
    monkeypatch.setattr(base, "_registry", base._Registry())
    with pytest.raises(QuiverError) as caught:
        base.get_backend("dali")
    assert "pip install 'quiver[dali]'" in str(caught.value)


qd = pytest.importorskip("quiver.backends.dali", reason="needs quiver[dali]")
dm = pytest.importorskip("support.dali_models", reason="needs quiver[dali]")


def test_the_rewrite_turns_gpu_operators_into_cpu_ones_and_keeps_the_rest() -> None:
    seed = qd.parse_pipeline(dm.seed_model_dali(), "m", "model.dali")
    assert qd.describe(seed).device_id == 0
    assert qd.describe(seed).devices == {
        "DALI_INPUT_0": "cpu", "__Image_0": "mixed", "__Resize_1": "gpu", "__CropMirrorNormalize_2": "gpu",
    }
    data, changed = qd.cpu_rewrite(seed, "m")
    assert changed == ["__Image_0 (mixed)", "__Resize_1 (gpu)", "__CropMirrorNormalize_2 (gpu)"]
    rewritten = qd.parse_pipeline(data, "m", "model.dali")
    info = qd.describe(rewritten)
    assert set(info.devices.values()) == {"cpu"}
    assert info.device_id == qd.CPU_ONLY_DEVICE_ID
    assert info.inputs == ("DALI_INPUT_0",) and info.outputs == qd.describe(seed).outputs
    # The same pipeline built for the CPU has the same operators, arguments and edges (the
    # fields the schema does not know, such as each argument's values, pass through).
    cpu = qd.parse_pipeline(dm.seed_pipeline("cpu").serialize(), "m", "model.dali")
    for mine, theirs in zip(rewritten.op, cpu.op, strict=True):
        assert (mine.name, mine.inst_name) == (theirs.name, theirs.inst_name)
        assert [(a.name, list(a.strings)) for a in mine.args if not a.name.startswith("_origin")] == [
            (a.name, list(a.strings)) for a in theirs.args if not a.name.startswith("_origin")
        ]
        assert [(e.name, e.device) for e in mine.output] == [(e.name, e.device) for e in theirs.output]


def test_an_operator_without_a_cpu_version_is_named() -> None:
    message = qd.parse_pipeline(dm.gpu_only_model_dali(), "g", "model.dali")
    with pytest.raises(UnavailableError) as caught:
        qd.cpu_rewrite(message, "g")
    assert "DALI operator 'experimental__Dilate'" in str(caught.value)
    assert "model 'g'" in str(caught.value)


@pytest.mark.parametrize("data", [b"", b"\xff\xff\xff", b"\x0a\x03abc"])
def test_what_is_not_a_pipeline_says_so(data: bytes) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a serialized DALI pipeline"):
        qd.parse_pipeline(data, "m", "model.dali")
