#!/usr/bin/env bash
# Set up .venv if needed, then run the main job: a char-level GPT on an 8-device mesh (see README.md).
# Extra arguments go to experiments/charlm.py, e.g.  bash scripts/main.sh --steps 200
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec .venv/bin/python experiments/charlm.py "$@"
