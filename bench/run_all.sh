#!/bin/sh
# Run every benchmark, one after the other (they pin themselves to cores; never run two at once).
#   sh bench/run_all.sh            # the full runs, about 20 minutes on 2 cores
#   sh bench/run_all.sh --quick    # the quick runs, about 3 minutes
# Tables go to stdout; JSON to bench/results/.
set -eu
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python}"
echo "== $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc 2>/dev/null || echo '?') CPUs, load:$(uptime | sed 's/.*load average://')"
for script in token_counting.py client_overhead.py ledger_server.py admission_strategies.py kv_timeline.py retry_storm.py gateway_overhead.py tenant_fairness.py loadgen_capacity.py soak.py; do
    echo
    echo "== $PYTHON bench/$script $*   ($(date -u '+%H:%M:%S'), load:$(uptime | sed 's/.*load average://'))"
    "$PYTHON" "$script" "$@"
done
echo
echo "== done $(date -u '+%H:%M:%S'), load:$(uptime | sed 's/.*load average://')"
