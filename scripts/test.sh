#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (unit, parity and structure tests, README example, and the
# notebooks, which tests/test_notebooks.py executes). Extra arguments go to pytest, e.g.  bash scripts/test.sh -k parity
# or  bash scripts/test.sh tests/test_mesh.py  (only that file)
# Tests marked slow are skipped unless asked for:  bash scripts/test.sh -m slow  (.ci/run runs both).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
# Two worker processes (pytest-xdist, one test file per worker at a time so module fixtures are built once): the
# 2-core machine is otherwise only ~65% busy, as compiles are single-threaded. Files go out in collection order
# (--no-loadscope-reorder): tests/conftest.py puts the long ones first. JAXPAR_TEST_WORKERS=0 runs in-process.
# Test files or directories among the arguments (tests/test_mesh.py, tests/models, a::node id) replace the default tests/.
where=tests
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then where=; break; fi
done
exec .venv/bin/python -m pytest $where -q --durations=10 -m "not slow" -n "${JAXPAR_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
