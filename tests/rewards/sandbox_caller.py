"""Run ``rewards.sandbox.run_python`` on programs described in JSON (stdin) and print the results as JSON.

``tests/rewards/test_sandbox_unprivileged.py`` starts this script as another, unprivileged user with the system
interpreter (the venv's lives under a 0700 ``/root``), from a copy of ``rewards/sandbox`` that user can read: the
sandbox is then built the way a non-root caller builds it (bubblewrap in a user namespace, no cgroups). Standard
library and ``rewards.sandbox`` only.

Input: a list of jobs ``{"code", "tests"?, "timeout_s"?, "limits"?, "isolation"?}``. Output:
``{"isolation": {...}, "uid": N, "results": [{"status", "stdout", "stderr", "tests_passed", "isolation",
"protections"}, ...]}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from rewards.sandbox import Limits, run_python, sandbox_isolation


def main() -> None:
    jobs = json.load(sys.stdin)
    results = []
    for job in jobs:
        result = run_python(
            job["code"],
            tests=job.get("tests"),
            timeout_s=job.get("timeout_s", 20.0),
            limits=Limits(**job.get("limits", {})),
            isolation=job.get("isolation", "namespaces"),
        )
        results.append(
            {
                "status": result.status,
                "stdout": result.stdout,
                "stderr": result.stderr[-3000:],
                "tests_passed": None if result.tests_passed is None else list(result.tests_passed),
                "isolation": result.isolation,
                "protections": sorted(result.protections),
            }
        )
    isolation = dataclasses.asdict(sandbox_isolation())
    json.dump({"isolation": isolation, "uid": os.getuid(), "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
