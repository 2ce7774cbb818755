#!/usr/bin/env bash
# Runs vLLM 0.32.0's generic scheduler/KV-connector unit tests with
# RadixkvConnector substituted (see radixkv_vllm_unit.py).
#   bash tests/engines/vllm_unit/run.sh            # the default selection
#   bash tests/engines/vllm_unit/run.sh -k abort   # extra pytest args
#   RADIXKV_VLLM_SUBSTITUTE=0 bash ...run.sh       # baseline: vLLM's own connectors
# PYTHON: the vLLM 0.32.0 CPU venv's python (radixkv installed in it).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# PYTHON, else $RADIXKV_VLLM_VENV's, else the newest venv .ci/engines built.
PYTHON=${PYTHON:-${RADIXKV_VLLM_VENV:+$RADIXKV_VLLM_VENV/bin/python}}
PYTHON=${PYTHON:-$(ls -td "${RADIXKV_ENGINE_VENVS:-$HOME/.cache/radixkv-engines}"/vllm-*/bin/python | head -1)}
export RADIXKV_VLLM_TESTS_DIR=$(bash "$HERE/fetch_vllm_tests.sh")
# tblib (vLLM's tests/conftest.py imports it) comes with the venv: vllm-requirements.txt
cd "$RADIXKV_VLLM_TESTS_DIR"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
U=tests/v1/kv_connector/unit
# tests/v1/core: the plugin keeps the tests that build a scheduler with vLLM's
# generic ExampleConnector (RADIXKV_VLLM_SELECT=0 keeps all).
if [ $# -eq 0 ] || [[ "$1" == -* ]]; then
  set -- tests/v1/core/test_scheduler.py tests/v1/core/test_async_scheduler.py \
    $U/test_kv_load_failure_recovery.py $U/test_invalid_blocks_correctness.py \
    $U/test_error_propagation.py $U/test_cache_pollution_prevention.py \
    "$HERE/connector_steps.py" "$@"
fi
exec nice "$PYTHON" -m pytest -q -p radixkv_vllm_unit -p no:cacheprovider "$@"
