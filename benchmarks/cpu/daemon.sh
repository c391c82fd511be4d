#!/usr/bin/env bash
# Runs the hostile-client tests of the capture daemon and serve-sql at full size instead of CI's
# bounded one: 20,000 half-open connections held for 30 s (two flood processes of 10,000, each
# under its own open-file limit), and six concurrent submissions of 500 MB inputs against
# --max-job-bytes 200MB. Prints each test's figures (the `flood:` and `submissions:` lines).
# The HSLAKE_FLOOD_CONNECTIONS, HSLAKE_FLOOD_SECONDS and HSLAKE_SUBMISSION_MB variables size it.
# Needs the binary scripts/setup.sh builds and ~6 GB free in /tmp.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH" OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
export HSLAKE_FLOOD_CONNECTIONS=${HSLAKE_FLOOD_CONNECTIONS:-20000}
export HSLAKE_FLOOD_SECONDS=${HSLAKE_FLOOD_SECONDS:-30}
export HSLAKE_SUBMISSION_MB=${HSLAKE_SUBMISSION_MB:-500}
python -m pytest -q -s -p no:cacheprovider \
  "tests/python/test_capture_daemon.py::test_a_flood_of_half_open_connections_leaves_the_api_answering_within_a_second" \
  "tests/python/test_capture_daemon.py::test_concurrent_large_submissions_are_refused_or_spooled_within_a_memory_bound" \
  "tests/python/test_serve_sql_connections.py" 2>&1 | grep -E "(flood|submissions):|passed|failed|Error"
