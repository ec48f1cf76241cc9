# Sourced by main.sh and test.sh: create .venv (once) and install jaxpar with its test extras (experiments, hf, data
# and the references). JAXPAR_EXTRAS=test,gpu adds the GPU compiler plugin (.ci/run does; see README "GPU targets").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
extras="${JAXPAR_EXTRAS:-test}"
stamp=".venv/.installed"   # holds the extras installed; a newer pyproject.toml or other extras install again
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$extras" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[$extras]"
  echo "$extras" > "$stamp"
fi
