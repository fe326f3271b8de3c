"""The server raises its soft open-file limit to the hard one at start; a Python model's worker
gets the soft limit the server was started with back (as Go's os/exec restores it for what it
starts), and the variable that carried it is not left in the model's environment."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from support.models import write_python
from support.server import QuiverServer

SOFT = 512

REPORTER = """
import os
import resource

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        carried = 1 if "QUIVER_NOFILE_SOFT" in os.environ else 0
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array([soft, carried], dtype=np.int64))])
            for _ in requests
        ]
"""

CONFIG = """
name: "limits"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_INT64, dims: [ 1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_INT64, dims: [ 2 ] } ]
"""


class LowSoftLimitServer(QuiverServer):
    """``quiver serve`` started with a soft open-file limit of :data:`SOFT` (hard unchanged)."""

    def command(self) -> list[str]:
        python, flag, module, *args = super().command()
        assert (flag, module) == ("-m", "quiver")
        launch = (
            "import resource, runpy; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT}, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
            "runpy.run_module('quiver', run_name='__main__', alter_sys=True)"
        )
        return [python, "-c", launch, *args]


def _soft_limit_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no open-file limit in /proc/{pid}/limits")


def test_the_server_raises_its_limit_and_a_python_model_gets_the_original(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert hard > SOFT, "the test needs a hard limit above its soft one"
    write_python(tmp_path, "limits", REPORTER, CONFIG)
    with LowSoftLimitServer(tmp_path) as server:
        assert server.process is not None
        if sys.platform.startswith("linux"):
            assert _soft_limit_of(server.process.pid) == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
        client = httpclient.InferenceServerClient(server.url)
        request = httpclient.InferInput("INPUT0", [1], "INT64")
        request.set_data_from_numpy(np.array([0], dtype=np.int64))
        soft, carried = client.infer("limits", [request]).as_numpy("OUTPUT0").tolist()
        client.close()
    assert soft == SOFT
    assert carried == 0
