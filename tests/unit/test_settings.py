"""quiver.settings: flags and variables merged once into a frozen Settings (no server started)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from quiver.cli import build_parser
from quiver.repository.storage import RetryPolicy
from quiver.settings import Settings, SettingsError, from_args


def settings(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> Settings:
    args = build_parser().parse_args(["serve", "--model-repository", str(tmp_path), *flags])
    return from_args(args, env or {})


def test_settings_are_frozen(tmp_path: Path) -> None:
    built = settings(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.http_port = 1  # type: ignore[misc]
    assert built.model_repositories == (tmp_path.resolve(),)
    assert dataclasses.replace(built, http_port=1).http_port == 1 and built.http_port == 8000


def test_defaults_without_flags_or_variables(tmp_path: Path) -> None:
    built = settings(tmp_path)
    assert (built.allow_sagemaker, built.sagemaker, built.sagemaker_port) == (False, None, 8080)
    assert built.model_load_gpu_limit == 0.0
    assert built.s3_endpoint_url is None and built.s3_options == {}
    assert built.model_cache_dir is None and built.ray is None
    assert built.model_control_mode == "none" and built.log_file_dir is None


def test_sagemaker_variables_turn_the_listener_on_and_pick_its_port(tmp_path: Path) -> None:
    env = {"SAGEMAKER_MULTI_MODEL": "true", "SAGEMAKER_BIND_TO_PORT": "9090"}
    built = settings(tmp_path, env=env)
    assert built.allow_sagemaker and built.sagemaker_port == 9090
    assert built.sagemaker is not None and built.sagemaker.multi_model
    assert settings(tmp_path, env={"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "m"}).allow_sagemaker


def test_flags_beat_sagemaker_variables(tmp_path: Path) -> None:
    env = {
        "SAGEMAKER_MULTI_MODEL": "true",
        "SAGEMAKER_BIND_TO_PORT": "9090",
        "SAGEMAKER_SAFE_PORT_RANGE": "9000-9100",
        "SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT": "0.5",
    }
    built = settings(
        tmp_path,
        "--sagemaker-port", "7070", "--sagemaker-safe-port-range", "7000-7100", "--model-load-gpu-limit", "0.25",
        env=env,
    )  # fmt: skip
    assert (built.sagemaker_port, built.sagemaker_safe_port_range) == (7070, (7000, 7100))
    assert built.model_load_gpu_limit == 0.25
    off = settings(tmp_path, "--allow-sagemaker=false", env=env)
    assert not off.allow_sagemaker and off.sagemaker is None


def test_gpu_limit_from_the_sagemaker_variable(tmp_path: Path) -> None:
    assert settings(tmp_path, env={"SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT": "0.5"}).model_load_gpu_limit == 0.5
    with pytest.raises(SettingsError, match="SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT"):
        settings(tmp_path, env={"SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT": "2"})


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({"SAGEMAKER_BIND_TO_PORT": "http"}, ("--allow-sagemaker",), "SAGEMAKER_BIND_TO_PORT"),
        ({"SAGEMAKER_SAFE_PORT_RANGE": "9000-9100"}, ("--allow-sagemaker", "--sagemaker-port", "80"), "9000-9100"),
        ({"SAGEMAKER_TRITON_PING_MODE": "sometimes"}, ("--allow-sagemaker",), "SAGEMAKER_TRITON_PING_MODE"),
        ({}, ("--s3-retries", "0"), "--s3-retries"),
        ({}, ("--http-restricted-api", "nonsense"), "--http-restricted-api"),
        ({}, ("--allow-log-file-api",), "--log-file-dir"),
        ({}, ("--ray", "--ray-min-replicas", "3", "--ray-max-replicas", "2"), "--ray-min-replicas"),
        ({}, ("--ray", "--ray-request-timeout", "-1"), "--ray-request-timeout"),
    ],
)
def test_nonsense_names_the_flag_or_variable(
    tmp_path: Path, env: dict[str, str], flags: tuple[str, ...], message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        settings(tmp_path, *flags, env=env)


def test_sagemaker_variables_are_not_checked_while_the_listener_is_off(tmp_path: Path) -> None:
    built = settings(tmp_path, "--allow-sagemaker=false", env={"SAGEMAKER_SAFE_PORT_RANGE": "junk"})
    assert not built.allow_sagemaker


def test_ray_always_has_the_sagemaker_routes_but_no_listener_of_their_own(tmp_path: Path) -> None:
    built = settings(tmp_path, "--ray", env={"SAGEMAKER_TRITON_PING_MODE": "live"})
    assert built.ray is not None and built.model_control_mode == "on_demand"
    assert built.sagemaker is not None and built.sagemaker.ping_mode == "live"
    plain = settings(tmp_path, "--ray")
    assert not plain.allow_sagemaker and plain.sagemaker is not None
    assert settings(tmp_path, "--ray", "--model-control-mode", "explicit").model_control_mode == "explicit"


def test_frontend_workers_default_auto_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import quiver.settings

    for cores, expected in ((1, 0), (2, 0), (3, 0), (4, 2), (5, 3), (64, 3)):
        monkeypatch.setattr(quiver.settings, "usable_cores", lambda cores=cores: cores)
        assert settings(tmp_path).frontend_workers == expected, cores
        assert settings(tmp_path, "--frontend-workers", "auto").frontend_workers == expected, cores
        assert settings(tmp_path, "--ray").frontend_workers == 0  # Ray Serve's replicas serve
    assert settings(tmp_path, "--frontend-workers", "0").frontend_workers == 0
    assert settings(tmp_path, "--http-workers", "3").frontend_workers == 3
    # Triton's flag: accepted, the worker count stays auto's
    assert settings(tmp_path, "--http-thread-count", "8").frontend_workers == settings(tmp_path).frontend_workers
    with pytest.raises(SettingsError, match="--frontend-workers must be 0 or more, got -2"):
        settings(tmp_path, "--http-workers", "-2")
    with pytest.raises(SettingsError, match="with --ray, Ray Serve's replicas serve"):
        settings(tmp_path, "--http-workers", "2", "--ray")


def test_s3_endpoint_flag_then_variables(tmp_path: Path) -> None:
    both = {"AWS_ENDPOINT_URL_S3": "http://s3-only", "AWS_ENDPOINT_URL": "http://all"}
    assert settings(tmp_path, "--s3-endpoint-url", "http://flag", env=both).s3_endpoint_url == "http://flag"
    assert settings(tmp_path, env=both).s3_endpoint_url == "http://s3-only"
    assert settings(tmp_path, env={"AWS_ENDPOINT_URL": "http://all"}).s3_endpoint_url == "http://all"
    built = settings(tmp_path, "--s3-region", "eu-west-1", "--s3-retries", "3", "--s3-timeout", "2", env=both)
    assert built.s3_options == {
        "endpoint_url": "http://s3-only",
        "region": "eu-west-1",
        "retry": RetryPolicy(attempts=3, connect_timeout=2.0, read_timeout=2.0),
    }


def test_repositories_split_into_local_and_s3(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--model-repository", f"file://{tmp_path}", "--model-repository", "s3://bucket/models"]
    )
    built = from_args(args, {})
    assert built.model_repositories == (tmp_path.resolve(),) and built.s3_repositories == ("s3://bucket/models",)
    for location, message in ((str(tmp_path / "nope"), "is not a directory"), ("gs://b/p", "unsupported")):
        with pytest.raises(SettingsError, match=message):
            from_args(build_parser().parse_args(["serve", "--model-repository", location]), {})


def test_cache_dir_flag_is_resolved_and_the_variable_is_left_to_the_manager(tmp_path: Path) -> None:
    assert settings(tmp_path, "--model-cache-dir", str(tmp_path / "c")).model_cache_dir == (tmp_path / "c").resolve()
    assert settings(tmp_path, env={"QUIVER_CACHE_DIR": str(tmp_path)}).model_cache_dir is None


def test_trace_and_cache_flags(tmp_path: Path) -> None:
    built = settings(
        tmp_path, "--trace-config", "triton,file=t.json", "--trace-level", "TIMESTAMPS",
        "--cache-config", "local,size=4096",
    )  # fmt: skip
    assert (built.trace.file, built.trace.level, built.response_cache_size) == ("t.json", 1, 4096)
    assert settings(tmp_path).trace.level == 0 and settings(tmp_path).response_cache_size == 0
    with pytest.raises(SettingsError, match="not available with --ray"):
        settings(tmp_path, "--ray", "--trace-config", "level=TIMESTAMPS")
    with pytest.raises(SettingsError, match="Incompatible flags"):
        settings(tmp_path, "--cache-config", "local,size=1", "--response-cache-byte-size", "1")


def test_tritonserver_flags(tmp_path: Path) -> None:
    built = settings(tmp_path)
    assert (built.server_id, built.strict_readiness, built.allow_client_shm) == ("quiver", True, False)
    assert built.flag_notes == () and built.grpc_options == () and built.grpc_tls is None
    built = settings(
        tmp_path,
        "--id=a",
        "--strict-readiness=false",
        "--allow-client-shm",
        "--disable-auto-complete-config",
        "--model-load-retry-count=2",
        "--exit-timeout-secs=7",
        "--log-warning=false",
        "--http-header-forward-pattern=^x-",
        "--grpc-keepalive-time=1000",
        "--grpc-http2-max-ping-strikes=0",
        "--grpc-infer-response-compression-level=high",
        "--model-load-gpu-limit=1:0.5",
        "--host-policy=a,b=c",
        "--host-policy=d,e=f",
        "--rate-limit=off",
    )
    assert (built.server_id, built.strict_readiness, built.allow_client_shm) == ("a", False, True)
    assert built.strict_model_config and built.model_load_retry_count == 2 and built.exit_timeout_secs == 7
    assert built.log_warning is False and built.http_header_forward_pattern == "^x-"
    assert built.grpc_options == (("grpc.keepalive_time_ms", 1000), ("grpc.http2.max_ping_strikes", 0))
    assert built.grpc_compression_level == 3 and built.model_load_gpu_limit == 0.5
    assert [note.split(" has no effect")[0] for note in built.flag_notes] == ["--rate-limit", "--host-policy"]


def test_bad_tritonserver_flag_values(tmp_path: Path) -> None:
    for flags, message in (
        (["--grpc-header-forward-pattern=[a"], "--grpc-header-forward-pattern: '[a' is not a regular expression"),
        (["--grpc-use-ssl-mutual", "--grpc-server-cert=/x", "--grpc-server-key=/y"], "--grpc-server-cert: cannot read '/x'"),
        (["--grpc-keepalive-timeout=-5"], "--grpc-keepalive-timeout must be at least 0"),
    ):
        with pytest.raises(SettingsError, match=re.escape(message)):
            settings(tmp_path, *flags)
def test_backend_config_in_tritons_syntax(tmp_path: Path) -> None:
    built = settings(
        tmp_path,
        "--backend-config=python,shm-default-byte-size=2097152",
        "--backend-config", "python,shm-region-prefix-name=mine_",
        "--backend-config=onnxruntime,enable-global-threadpool=1",
        "--backend-config=backend-directory=/opt/x",
        "--backend-config=python,shm-default-byte-size=4194304",  # a later one wins
    )  # fmt: skip
    assert built.backend_config == {
        "python": {"shm-default-byte-size": "4194304", "shm-region-prefix-name": "mine_"},
        "onnxruntime": {"enable-global-threadpool": "1"},
        "": {"backend-directory": "/opt/x"},
    }
    assert settings(tmp_path).backend_config == {}


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--backend-config=python", "--backend-config: 'python' is not"),
        ("--backend-config=,x=1", "--backend-config: ',x=1' is not"),
        ("--backend-config=python,shm-default-byte-size=lots", "shm-default-byte-size"),
        ("--backend-config=python,shm-growth-byte-size=0", "shm-growth-byte-size"),
        ("--backend-config=python,stub-timeout-seconds=-1", "stub-timeout-seconds"),
        ("--backend-config=python,shm-region-prefix-name=a/b", "shm-region-prefix-name"),
        ("--backend-config=python,in-process=maybe", "in-process"),
    ],
)
def test_backend_config_nonsense_names_the_setting(tmp_path: Path, flag: str, named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        settings(tmp_path, flag)


def test_sagemaker_shm_variables_reach_the_python_backend_and_flags_win(tmp_path: Path) -> None:
    env = {"SAGEMAKER_TRITON_SHM_DEFAULT_BYTE_SIZE": "16777216", "SAGEMAKER_TRITON_SHM_GROWTH_BYTE_SIZE": "1048576"}
    built = settings(tmp_path, env=env)
    assert built.backend_config["python"] == {
        "shm-default-byte-size": "16777216",
        "shm-growth-byte-size": "1048576",
    }
    flagged = settings(tmp_path, "--backend-config=python,shm-default-byte-size=8388608", env=env)
    assert flagged.backend_config["python"]["shm-default-byte-size"] == "8388608"
    with pytest.raises(SettingsError, match="SAGEMAKER_TRITON_SHM_GROWTH_BYTE_SIZE"):
        settings(tmp_path, env={"SAGEMAKER_TRITON_SHM_GROWTH_BYTE_SIZE": "1M"})


def test_backend_config_for_other_backends_is_noted_as_without_effect(tmp_path: Path) -> None:
    built = settings(
        tmp_path,
        "--backend-config=onnxruntime,default-max-batch-size=4",
        "--backend-config=tensorflow,version=2",
        "--backend-config=python,shm-growth-byte-size=1048576",
    )
    assert built.backend_config["onnxruntime"] == {"default-max-batch-size": "4"}
    assert [n for n in built.flag_notes if "backend-config" in n] == [
        "--backend-config=onnxruntime,default-max-batch-size=... has no effect: "
        "Quiver reads no such onnxruntime backend setting"
    ]


def test_onnxruntime_thread_pool_settings_are_read_and_checked(tmp_path: Path) -> None:
    """Triton's global thread pool keys are read (not noted as without effect); the
    multi-model endpoint (on_demand) shares the pools unless told otherwise."""
    built = settings(
        tmp_path,
        "--backend-config=onnxruntime,enable-global-threadpool=1",
        "--backend-config=onnxruntime,intra_op_thread_count=2",
        "--backend-config=onnxruntime,inter_op_thread_count=0",
    )
    assert built.backend_config["onnxruntime"] == {
        "enable-global-threadpool": "1",
        "intra_op_thread_count": "2",
        "inter_op_thread_count": "0",
    }
    assert not [n for n in built.flag_notes if "backend-config" in n]
    assert "onnxruntime" not in settings(tmp_path).backend_config  # none mode: Triton's default
    on_demand = settings(tmp_path, "--model-control-mode=on_demand")
    assert on_demand.backend_config["onnxruntime"] == {"enable-global-threadpool": "1", "optimized-model-cache": "1"}
    told = settings(
        tmp_path, "--model-control-mode=on_demand", "--backend-config=onnxruntime,enable-global-threadpool=0",
        "--backend-config=onnxruntime,optimized-model-cache=0",
    )  # fmt: skip
    assert told.backend_config["onnxruntime"] == {"enable-global-threadpool": "0", "optimized-model-cache": "0"}
    for flag, named in (
        ("onnxruntime,enable-global-threadpool=maybe", "enable-global-threadpool=maybe"),
        ("onnxruntime,intra_op_thread_count=-1", "intra_op_thread_count=-1"),
        ("onnxruntime,inter_op_thread_count=many", "inter_op_thread_count=many"),
        ("onnxruntime,optimized-model-cache=sometimes", "optimized-model-cache=sometimes"),
        ("onnxruntime,optimized-model-cache-size=4G", "optimized-model-cache-size=4G"),
    ):
        with pytest.raises(SettingsError, match=re.escape(named)):
            settings(tmp_path, f"--backend-config={flag}")
