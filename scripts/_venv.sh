# Sourced by main.sh and test.sh: create .venv (once) and install jaxpar with the given extra.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extra="$1"
python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
stamp=".venv/.installed-$extra"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[$extra]"
  touch "$stamp"
fi
