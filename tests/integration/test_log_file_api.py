"""The logging API may not choose where the server writes (issue #20; Triton's CVE-2024-0087).

By default ``log_file`` cannot be changed through ``POST /v2/logging`` or gRPC ``LogSettings``
(Triton refuses it too) while the other settings can. With ``--allow-log-file-api`` and
``--log-file-dir DIR`` a client may name a file inside DIR, and nothing outside it: no ``..``,
no absolute path elsewhere, no symbolic link followed, no NUL byte.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from support.server import QuiverServer, run_quiver


def _refused(call: Any, status: str) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == status, info.value
    message = str(info.value.message())
    assert "'log_file'" in message
    return message


def _grpc_log_file(client: grpcclient.InferenceServerClient, **kwargs: Any) -> str:
    settings = client.update_log_settings(kwargs, as_json=True)["settings"] if kwargs else (
        client.get_log_settings(as_json=True)["settings"]
    )
    return str(settings["log_file"].get("string_param", ""))


def test_log_file_is_refused_by_default(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    target = tmp_path / "owned.log"
    with QuiverServer(repo) as server:
        http = httpclient.InferenceServerClient(server.url)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        for value in (str(target), "relative.log", ""):
            message = _refused(lambda v=value: http.update_log_settings({"log_file": v}), "400")
            assert "--allow-log-file-api" in message and "--log-file-dir" in message
            message = _refused(
                lambda v=value: grpc.update_log_settings({"log_file": v}), "StatusCode.INVALID_ARGUMENT"
            )
            assert "--allow-log-file-api" in message
        # Refused as a whole: the other settings of the same request are not applied.
        _refused(lambda: http.update_log_settings({"log_verbose_level": 3, "log_file": str(target)}), "400")
        assert not target.exists()
        assert not (Path.cwd() / "relative.log").exists()
        settings = http.get_log_settings()
        assert settings["log_file"] == "" and settings["log_verbose_level"] == 0

        # Every other setting still changes, over both protocols; GET reports log_file.
        updated = http.update_log_settings(
            {"log_verbose_level": 1, "log_format": "ISO8601", "log_info": False, "log_warning": False}
        )
        assert updated == {
            "log_file": "",
            "log_info": False,
            "log_warning": False,
            "log_error": True,
            "log_verbose_level": 1,
            "log_format": "ISO8601",
        }
        settings = grpc.update_log_settings(
            {"log_verbose_level": 0, "log_format": "default", "log_info": True, "log_warning": True, "log_error": True},
            as_json=True,
        )["settings"]
        assert settings["log_verbose_level"] == {"uint32_param": 0}
        assert settings["log_format"] == {"string_param": "default"}
        assert settings["log_info"] == {"bool_param": True}
        assert _grpc_log_file(grpc) == ""
        # ``null`` means "leave it": accepted, as Triton accepts it.
        assert http.update_log_settings({"log_file": None})["log_file"] == ""
        # A verbose level is a uint32 on gRPC: past it is the client's mistake over HTTP too
        # (it used to be accepted there and then broke every gRPC LogSettings call).
        with pytest.raises(InferenceServerException) as info:
            http.update_log_settings({"log_verbose_level": 1 << 32})
        assert info.value.status() == "400" and "log_verbose_level" in str(info.value.message())
        assert grpc.get_log_settings(as_json=True)["settings"]["log_verbose_level"] == {"uint32_param": 0}


def test_log_file_only_inside_the_log_folder(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    logs = tmp_path / "logs"
    (logs / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.log"
    secret.write_text("keep\n")
    (logs / "out").symlink_to(outside)  # a folder link pointing out
    (logs / "secret.log").symlink_to(secret)  # a file link pointing out
    (logs / "dangling.log").symlink_to(outside / "created-through-a-link.log")
    real = logs.resolve()
    args = ("--allow-log-file-api", "--log-file-dir", str(logs))
    with QuiverServer(repo, args=args) as server:
        http = httpclient.InferenceServerClient(server.url)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)

        assert http.update_log_settings({"log_file": "quiver.log"})["log_file"] == str(real / "quiver.log")
        assert (logs / "quiver.log").is_file()
        assert http.get_log_settings()["log_file"] == str(real / "quiver.log")
        inside = str(real / "sub" / "absolute.log")
        assert http.update_log_settings({"log_file": inside})["log_file"] == str(real / "sub" / "absolute.log")
        assert _grpc_log_file(grpc, log_file="sub/grpc.log") == str(real / "sub" / "grpc.log")
        assert (logs / "sub" / "absolute.log").is_file() and (logs / "sub" / "grpc.log").is_file()

        hostile = {
            str(outside / "abs.log"): "outside the log folder",
            "../outside/dotdot.log": "'..' is not allowed",
            "sub/../../outside/dotdot.log": "'..' is not allowed",
            str(real / ".." / "outside" / "dotdot.log"): "'..' is not allowed",
            "out/through-link.log": "symbolic link",
            "secret.log": "symbolic link",
            "dangling.log": "symbolic link",
            "nul\x00.log": "NUL byte",
            "sub/": "names a folder",
            "sub": "cannot open it",
        }
        for value, why in hostile.items():
            assert why in _refused(lambda v=value: http.update_log_settings({"log_file": v}), "400"), value
            assert why in _refused(
                lambda v=value: grpc.update_log_settings({"log_file": v}), "StatusCode.INVALID_ARGUMENT"
            ), value
        # Nothing was created or written outside, and the last good file is still the one in use.
        assert sorted(os.listdir(outside)) == ["secret.log"] and secret.read_text() == "keep\n"
        assert not (tmp_path / "dotdot.log").exists()
        assert http.get_log_settings()["log_file"] == str(real / "sub" / "grpc.log")

        # The other settings change without reopening the file.
        assert http.update_log_settings({"log_verbose_level": 1})["log_file"] == str(real / "sub" / "grpc.log")
        http.update_log_settings({"log_verbose_level": 0})
    # The server's last lines went to the file the API chose.
    assert "stopping" in (logs / "sub" / "grpc.log").read_text()
    assert "stopping" not in server.log


def test_allowing_the_api_needs_a_log_folder(tmp_path: Path) -> None:
    result = run_quiver("serve", "--model-repository", str(tmp_path), "--allow-log-file-api")
    assert result.returncode == 2 and "--log-file-dir" in result.stderr
    result = run_quiver(
        "serve", "--model-repository", str(tmp_path), "--allow-log-file-api", "--log-file-dir", str(tmp_path / "nope")
    )
    assert result.returncode == 2 and "--log-file-dir" in result.stderr
