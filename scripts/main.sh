#!/usr/bin/env bash
# Set up .venv if needed, then run the main job: a char-level GPT on an 8-device mesh (see README.md).
# Extra arguments go to experiments/charlm.py, e.g.  bash scripts/main.sh --steps 200
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
# The main job runs on simulated CPU devices; pinning the platform also keeps the GPU compiler plugin (the gpu extra,
# when installed) from trying CUDA on a machine without it and printing the failure.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec .venv/bin/python experiments/charlm.py "$@"
