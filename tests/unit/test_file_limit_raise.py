"""The server raises its soft open-file limit to the hard one at start; the Python models it runs get the original back (quiver.limits)."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap


def _run_with_soft_limit(soft: int, code: str) -> str:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        preexec_fn=lower,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def test_soft_limit_is_raised_to_the_hard_limit() -> None:
    out = _run_with_soft_limit(
        256,
        """
        import resource
        from quiver.limits import raise_open_file_limit
        before = resource.getrlimit(resource.RLIMIT_NOFILE)
        returned = raise_open_file_limit()
        after = resource.getrlimit(resource.RLIMIT_NOFILE)
        print(before[0], returned, after[0], after[1])
        """,
    )
    before, returned, after, hard = (int(each) for each in out.split())
    assert before == 256
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    assert after == returned == wanted
    assert after > before


def test_grpc_connection_cap_follows_the_raised_limit() -> None:
    """The gRPC cap is computed from the limit in force once the runner raised it, not from
    the 256 the process was started with."""
    out = _run_with_soft_limit(
        256,
        """
        from quiver.frontends.grpc_server import connection_cap
        from quiver.limits import raise_open_file_limit
        print(connection_cap())
        raise_open_file_limit()
        print(connection_cap())
        """,
    )
    low, raised = (int(each) for each in out.split())
    assert low == 128
    assert raised > low
