"""The SageMaker entrypoint's decisions (``quiver sagemaker-serve``): the ``quiver serve``
flags each SAGEMAKER_* variable produces, as Triton's ``serve`` script produces tritonserver's,
the settings those flags parse into, and the message naming the variable of an invalid value."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from quiver import logs
from quiver.cli import build_parser
from quiver.sagemaker_serve import EntrypointError, parse_serve_args, plan
from quiver.settings import SettingsError, from_args


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A single-model endpoint's /opt/ml/model with one model folder."""
    (tmp_path / "model" / "resnet").mkdir(parents=True)
    return tmp_path / "model"


def args_of(env: dict[str, str], root: Path) -> list[str]:
    return plan(env, model_root=root, multi_model_repository=root.parent / "sm").args


def settings_of(env: dict[str, str], root: Path, environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    entry = plan(env, model_root=root, multi_model_repository=root)
    return from_args(parse_serve_args(build_parser, entry), {**env, **entry.environ, **(environ or {})})


def test_defaults_are_tritons_image(root: Path) -> None:
    entry = plan({}, model_root=root)
    assert entry.args[:4] == [
        "--allow-sagemaker=true",
        "--allow-http=false",
        "--model-control-mode=explicit",
        f"--model-repository={root}",
    ]
    for flag in (
        "--allow-grpc=false",
        "--allow-metrics=false",
        "--log-verbose=true",
        "--model-namespacing=true",
        "--backend-config=python,shm-default-byte-size=16777216",
        "--backend-config=python,shm-growth-byte-size=1048576",
        "--load-model=resnet",
    ):
        assert flag in entry.args
    assert entry.environ == {"SAGEMAKER_TRITON_PING_MODE": "ready", "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "resnet"}
    assert any("No SAGEMAKER_TRITON_DEFAULT_MODEL_NAME provided" in n for n in entry.notes)
    settings = settings_of({}, root)
    assert settings.allow_sagemaker and not settings.allow_http and not settings.allow_grpc
    assert not settings.allow_metrics and settings.model_control_mode == "explicit"
    assert settings.load_models == ("resnet",) and settings.log_verbose == 1
    assert settings.sagemaker is not None and settings.sagemaker.default_model == "resnet"
    assert settings.sagemaker_address == "0.0.0.0" and settings.sagemaker_port == 8080
    assert settings.backend_config == {
        "python": {"shm-default-byte-size": "16777216", "shm-growth-byte-size": "1048576"}
    }


def test_multi_model_mode(root: Path, tmp_path: Path) -> None:
    entry = plan({"SAGEMAKER_MULTI_MODEL": "true"}, model_root=root, multi_model_repository=tmp_path / "sm")
    assert f"--model-repository={tmp_path / 'sm'}" in entry.args
    assert "--model-eviction-policy=none" in entry.args
    limit = next(int(a.split("=")[1]) for a in entry.args if a.startswith("--model-memory-limit="))
    assert limit > 0
    assert settings_of({"SAGEMAKER_MULTI_MODEL": "true"}, root).model_memory_limit == limit
    later = {"SAGEMAKER_MULTI_MODEL": "true", "SAGEMAKER_TRITON_ADDITIONAL_ARGS": "--model-memory-limit=3G"}
    assert settings_of(later, root).model_memory_limit == 3 << 30
    cache = next(int(a.split("=")[1]) for a in entry.args if a.startswith("--model-cache-size="))
    assert 0 < cache < shutil.disk_usage(tmp_path).free + 1
    assert not any(a.startswith("--load-model") for a in entry.args)
    assert entry.environ["SAGEMAKER_TRITON_PING_MODE"] == "live" and entry.multi_model
    # in multi-model mode /opt/ml/model is not looked at (a stray config.pbtxt is fine)
    (root / "config.pbtxt").write_text("")
    assert plan({"SAGEMAKER_MULTI_MODEL": "true"}, model_root=root).multi_model


@pytest.mark.parametrize(
    ("env", "flag"),
    [
        # passed through as Triton's script does (and AWS documents): false turns it off
        ({"SAGEMAKER_TRITON_DISABLE_MODEL_NAMESPACING": "false"}, "--model-namespacing=false"),
        ({"SAGEMAKER_TRITON_DISABLE_MODEL_NAMESPACING": "true"}, "--model-namespacing=true"),
        ({"SAGEMAKER_BIND_TO_PORT": "8081"}, "--sagemaker-port=8081"),
        ({"SAGEMAKER_SAFE_PORT_RANGE": "8000-9000"}, "--sagemaker-safe-port-range=8000-9000"),
        ({"SAGEMAKER_TRITON_ALLOW_GRPC": "true"}, "--allow-grpc=true"),
        ({"SAGEMAKER_TRITON_GRPC_PORT": "9001"}, "--grpc-port=9001"),
        ({"SAGEMAKER_TRITON_ALLOW_METRICS": "true"}, "--allow-metrics=true"),
        ({"SAGEMAKER_TRITON_METRICS_PORT": "9002"}, "--metrics-port=9002"),
        ({"SAGEMAKER_TRITON_THREAD_COUNT": "16"}, "--sagemaker-thread-count=16"),
        ({"SAGEMAKER_TRITON_BUFFER_MANAGER_THREAD_COUNT": "2"}, "--buffer-manager-thread-count=2"),
        ({"SAGEMAKER_TRITON_LOG_VERBOSE": "false"}, "--log-verbose=false"),
        ({"SAGEMAKER_TRITON_LOG_VERBOSE": "2"}, "--log-verbose=2"),
        ({"SAGEMAKER_TRITON_LOG_INFO": "false"}, "--log-info=false"),
        ({"SAGEMAKER_TRITON_LOG_WARNING": "false"}, "--log-warning=false"),
        ({"SAGEMAKER_TRITON_LOG_ERROR": "false"}, "--log-error=false"),
        ({"SAGEMAKER_TRITON_SHM_DEFAULT_BYTE_SIZE": "33554432"}, "--backend-config=python,shm-default-byte-size=33554432"),
        ({"SAGEMAKER_TRITON_SHM_GROWTH_BYTE_SIZE": "2097152"}, "--backend-config=python,shm-growth-byte-size=2097152"),
        ({"SAGEMAKER_TRITON_TENSORFLOW_VERSION": "2"}, "--backend-config=tensorflow,version=2"),
        ({"SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT": "0.8"}, "--model-load-gpu-limit=0.8"),
        ({"SAGEMAKER_TRITON_INFERENCE_TYPE": "generate"}, "--sagemaker-inference-type=generate"),
        ({"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "resnet"}, "--load-model=resnet"),
    ],
)
def test_each_variable_becomes_its_flag(root: Path, env: dict[str, str], flag: str) -> None:
    assert flag in args_of(env, root)
    settings_of(env, root)  # and quiver serve's parser takes it


def test_the_flags_become_settings(root: Path) -> None:
    env = {
        "SAGEMAKER_TRITON_DISABLE_MODEL_NAMESPACING": "false",
        "SAGEMAKER_BIND_TO_PORT": "8085",
        "SAGEMAKER_SAFE_PORT_RANGE": "8000-9000",
        "SAGEMAKER_TRITON_ALLOW_GRPC": "true",
        "SAGEMAKER_TRITON_GRPC_PORT": "9001",
        "SAGEMAKER_TRITON_ALLOW_METRICS": "true",
        "SAGEMAKER_TRITON_METRICS_PORT": "9002",
        "SAGEMAKER_TRITON_THREAD_COUNT": "6",
        "SAGEMAKER_TRITON_BUFFER_MANAGER_THREAD_COUNT": "2",
        "SAGEMAKER_TRITON_LOG_VERBOSE": "false",
        "SAGEMAKER_TRITON_LOG_WARNING": "false",
        "SAGEMAKER_TRITON_LOG_ERROR": "true",
        "SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT": "0.5",
        "SAGEMAKER_TRITON_INFERENCE_TYPE": "generate_stream",
        "SAGEMAKER_TRITON_OVERRIDE_PING_MODE": "live",
    }
    s = settings_of(env, root)
    assert not s.model_namespacing and s.sagemaker_port == 8085
    assert s.sagemaker_safe_port_range == (8000, 9000)
    assert s.allow_grpc and s.grpc_port == 9001 and s.grpc_address == "0.0.0.0"
    assert s.allow_metrics and s.metrics_port == 9002 and s.metrics_address == "0.0.0.0"
    assert s.sagemaker_thread_count == 6
    assert any(n.startswith("--buffer-manager-thread-count has no effect") for n in s.flag_notes)
    assert s.log_verbose == 0 and not s.log_warning and s.log_error
    assert s.model_load_gpu_limit == 0.5
    assert s.sagemaker is not None
    assert s.sagemaker.inference_type == "generate_stream" and s.sagemaker.ping_mode == "live"


def test_ping_mode_override_wins(root: Path) -> None:
    entry = plan(
        {"SAGEMAKER_TRITON_OVERRIDE_PING_MODE": "live", "SAGEMAKER_TRITON_PING_MODE": "ready"}, model_root=root
    )
    assert entry.environ["SAGEMAKER_TRITON_PING_MODE"] == "live"
    multi = plan({"SAGEMAKER_MULTI_MODEL": "true", "SAGEMAKER_TRITON_OVERRIDE_PING_MODE": "ready"}, model_root=root)
    assert multi.environ["SAGEMAKER_TRITON_PING_MODE"] == "ready"
    assert plan({"SAGEMAKER_TRITON_PING_MODE": "live"}, model_root=root).environ["SAGEMAKER_TRITON_PING_MODE"] == "live"


def test_additional_args_are_parsed_as_serve_parses_them(root: Path) -> None:
    env = {"SAGEMAKER_TRITON_ADDITIONAL_ARGS": "--model-memory-limit=2G --log-info false --strict-model-config"}
    entry = plan(env, model_root=root)
    assert entry.args[-4:] == ["--model-memory-limit=2G", "--log-info", "false", "--strict-model-config"]
    settings = settings_of(env, root)
    assert settings.model_memory_limit == 2 << 30 and not settings.log_info and settings.strict_model_config
    # They come last: they win over the generated flags.
    later = settings_of({"SAGEMAKER_TRITON_ADDITIONAL_ARGS": "--allow-grpc=true --model-namespacing=false"}, root)
    assert later.allow_grpc and not later.model_namespacing
    with pytest.raises(EntrypointError, match=r"SAGEMAKER_TRITON_ADDITIONAL_ARGS.*--no-such-flag"):
        parse_serve_args(build_parser, plan({"SAGEMAKER_TRITON_ADDITIONAL_ARGS": "--no-such-flag"}, model_root=root))
    with pytest.raises(EntrypointError, match="SAGEMAKER_TRITON_ADDITIONAL_ARGS cannot be split"):
        plan({"SAGEMAKER_TRITON_ADDITIONAL_ARGS": "--log-file 'unclosed"}, model_root=root)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SAGEMAKER_MULTI_MODEL", "maybe"),
        ("SAGEMAKER_TRITON_PING_MODE", "sometimes"),
        ("SAGEMAKER_TRITON_OVERRIDE_PING_MODE", "healthy"),
        ("SAGEMAKER_TRITON_DISABLE_MODEL_NAMESPACING", "yes please"),
        ("SAGEMAKER_BIND_TO_PORT", "eighty"),
        ("SAGEMAKER_BIND_TO_PORT", "70000"),
        ("SAGEMAKER_SAFE_PORT_RANGE", "9000-8000"),
        ("SAGEMAKER_TRITON_ALLOW_GRPC", "sure"),
        ("SAGEMAKER_TRITON_GRPC_PORT", "-1"),
        ("SAGEMAKER_TRITON_ALLOW_METRICS", "2"),
        ("SAGEMAKER_TRITON_METRICS_PORT", "x"),
        ("SAGEMAKER_TRITON_THREAD_COUNT", "0"),
        ("SAGEMAKER_TRITON_BUFFER_MANAGER_THREAD_COUNT", "-3"),
        ("SAGEMAKER_TRITON_LOG_VERBOSE", "loud"),
        ("SAGEMAKER_TRITON_LOG_INFO", "perhaps"),
        ("SAGEMAKER_TRITON_LOG_WARNING", "x"),
        ("SAGEMAKER_TRITON_LOG_ERROR", "x"),
        ("SAGEMAKER_TRITON_SHM_DEFAULT_BYTE_SIZE", "16MB"),
        ("SAGEMAKER_TRITON_SHM_GROWTH_BYTE_SIZE", "0"),
        ("SAGEMAKER_TRITON_TENSORFLOW_VERSION", "3"),
        ("SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT", "80"),
        ("SAGEMAKER_TRITON_INFERENCE_TYPE", "predict"),
        ("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME", "../etc"),
        ("SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH", "x"),
    ],
)
def test_an_invalid_value_fails_naming_its_variable(root: Path, variable: str, value: str) -> None:
    with pytest.raises(EntrypointError, match=variable):
        plan({variable: value}, model_root=root)


def test_single_model_checks(tmp_path: Path) -> None:
    root = tmp_path / "model"
    root.mkdir()
    with pytest.raises(EntrypointError, match="No model found in model repository"):
        plan({}, model_root=root)
    (root / "a").mkdir()
    (root / "b").mkdir()
    with pytest.raises(EntrypointError, match=r"More than 1 model directory(.|\n)*SAGEMAKER_TRITON_DEFAULT_MODEL_NAME(.|\n)*a b"):
        plan({}, model_root=root)
    assert "--load-model=b" in plan({"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "b"}, model_root=root).args
    with pytest.raises(EntrypointError, match="SAGEMAKER_TRITON_DEFAULT_MODEL_NAME c does not exist"):
        plan({"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "c"}, model_root=root)
    (root / "link").symlink_to(root / "a")
    with pytest.raises(EntrypointError, match="SAGEMAKER_TRITON_DEFAULT_MODEL_NAME link does not exist"):
        plan({"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "link"}, model_root=root)
    (root / "config.pbtxt").write_text('name: "a"')
    with pytest.raises(EntrypointError, match="Model directory needs to contain the top level folder"):
        plan({"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "a"}, model_root=root)


def test_cloudwatch_variables(root: Path) -> None:
    publish = {
        "SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH": "true",
        "SAGEMAKER_TRITON_ALLOW_METRICS": "true",
        "SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP": "/aws/SageMaker/Endpoints/TritonMetrics/x",
        "SAGEMAKER_TRITON_CLOUDWATCH_METRIC_NAMESPACE": "/aws/SageMaker/Endpoints/TritonMetrics/ns",
    }
    args = args_of(publish, root)
    assert "--cloudwatch-log-group=/aws/SageMaker/Endpoints/TritonMetrics/x" in args
    assert "--cloudwatch-metric-namespace=/aws/SageMaker/Endpoints/TritonMetrics/ns" in args
    cloudwatch = settings_of(publish, root).cloudwatch
    assert cloudwatch is not None and cloudwatch.namespace.endswith("/ns") and cloudwatch.interval == 60
    for missing in ("SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP", "SAGEMAKER_TRITON_CLOUDWATCH_METRIC_NAMESPACE"):
        with pytest.raises(EntrypointError, match=missing):
            plan({k: v for k, v in publish.items() if k != missing}, model_root=root)
    with pytest.raises(EntrypointError, match="SAGEMAKER_TRITON_ALLOW_METRICS=true"):
        plan({**publish, "SAGEMAKER_TRITON_ALLOW_METRICS": "false"}, model_root=root)
    assert not any(a.startswith("--cloudwatch") for a in args_of({**publish, "SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH": "false"}, root))


def test_log_levels_reach_the_logger() -> None:
    """--log-warning / --log-error reach the logging set-up (root logger and module restored)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    saved = dict(logs._settings), logs._handler, logs._file_dir
    try:
        logs.configure(info=False, warning=False, error=True)
        assert logs.settings()["log_warning"] is False and logs.settings()["log_error"] is True
        assert logging.getLogger("quiver").getEffectiveLevel() == logging.ERROR
    finally:
        if logs._handler is not None and logs._handler is not saved[1]:
            root.removeHandler(logs._handler)
            logs._handler.close()
        logs._settings.clear()
        logs._settings.update(saved[0])
        logs._handler, logs._file_dir = saved[1], saved[2]
        root.handlers[:] = handlers
        root.setLevel(level)

def test_quiver_serve_reads_the_cloudwatch_variables_and_flags(tmp_path: Path) -> None:
    parser = build_parser()
    serve = ["serve", "--model-repository", str(tmp_path)]
    env = {
        "SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH": "true",
        "SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP": "g",
        "SAGEMAKER_TRITON_CLOUDWATCH_METRIC_NAMESPACE": "ns",
    }
    cloudwatch = from_args(parser.parse_args(serve), env).cloudwatch
    assert cloudwatch is not None and (cloudwatch.log_group, cloudwatch.namespace) == ("g", "ns")
    flags = [*serve, "--cloudwatch-log-group", "g2", "--cloudwatch-metric-namespace", "n2", "--cloudwatch-interval", "5"]
    cloudwatch = from_args(parser.parse_args(flags), env).cloudwatch
    assert cloudwatch is not None and (cloudwatch.log_group, cloudwatch.interval) == ("g2", 5.0)
    assert from_args(parser.parse_args(serve), {}).cloudwatch is None
    for args, environ, message in (
        ([*serve, "--cloudwatch-log-group", "g"], {}, "go together"),
        ([*serve, "--allow-metrics=false"], env, "--allow-metrics=true"),
        (serve, {**env, "SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP": ""}, "SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP"),
        (serve, {**env, "SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH": "sometimes"}, "must be true or false"),
        ([*serve, "--ray"], env, "--ray"),
    ):
        with pytest.raises(SettingsError, match=message):
            from_args(parser.parse_args(args), environ)
