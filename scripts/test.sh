#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (unit, parity and structure tests, README example, and the
# notebooks, which tests/test_notebooks.py executes). Extra arguments go to pytest, e.g.  bash scripts/test.sh -k parity
# Tests marked slow are skipped unless asked for:  bash scripts/test.sh -m slow  (.ci/run runs both).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec .venv/bin/python -m pytest tests -q --durations=10 -m "not slow" "$@"
