"""jaxpar/launch.py (``python -m jaxpar.cli.launch``): one failing process stops the job; each process's environment.

The multi-process training runs through the launcher are tests/test_multihost.py.
"""

from __future__ import annotations

from helpers import launch

import jaxpar.cli.launch


def test_launcher_stops_everything_when_a_process_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['JAXPAR_PROCESS_ID'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(60)\n")
    job = launch(["-n", "2", str(script)], timeout=60)
    assert job.returncode == 3 and "process 1 exited with 3" in job.stdout
    env = jaxpar.cli.launch.process_env(1, 2, 1234, 4, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --x"})
    assert env["XLA_FLAGS"] == "--x --xla_force_host_platform_device_count=4"
    assert (env["JAXPAR_COORDINATOR_ADDRESS"], env["JAXPAR_NUM_PROCESSES"], env["JAXPAR_PROCESS_ID"]) == (
        "127.0.0.1:1234", "2", "1")
