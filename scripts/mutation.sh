#!/usr/bin/env bash
# Mutation testing (mutmut 3.8.1) of the safety modules: coalesce, semaphores, wire, layout, checks and the
# receive-side checks of manager.py and receiving.py (stage "core"), and the vLLM connector (stage "scheduler": its
# scheduler side, producer, consumer, pushplan, pusher, worker and sidechannel, against their unit tests). Report and every survivor explained: docs/mutation.md.
#
#   bash scripts/mutation.sh                        # both stages (a few hours on one core)
#   bash scripts/mutation.sh core [NAME_PATTERN...] # the core only, or only the mutants named (fnmatch)
#   bash scripts/mutation.sh scheduler [NAME_PATTERN...]
#   bash scripts/mutation.sh report                 # the counts of the last runs, per module
#   (cd DIR && $VENV/bin/mutmut show NAME)          # one mutant's diff; DIR: . or build/mutation-vllm
#   $VENV/bin/python scripts/mutation_kill.py NAMES TEST_FILE...  # new tests against a run's survivors (no re-run)
#
# Both stages run in the vLLM venv (integration/vllm/ci_setup.sh builds it; MUTATION_VENV names another), since
# the scheduler's tests need vLLM. The core's configuration is [tool.mutmut] in pyproject.toml (work dir
# ./mutants); the scheduler's is written below into build/mutation-vllm, where the connector package sits at
# the top so that mutmut's module names match the imported ones. Both git-ignored.
# MUTMUT_CHILDREN (default 1): mutants tested at once.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${MUTATION_VENV:-$ROOT/.vllm-venv}
[ -x "$VENV/bin/python" ] || VENV=$ROOT/.venv
if ! "$VENV/bin/python" -c "import mutmut" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "mutmut==3.8.1"  # pyproject.toml's `mutation` extra
fi
# every property test capped at 200 examples, deterministic (tests/conftest.py): a survivor costs the full run
# of every test that covers it, and the structured fuzz tests ask for up to 2,500 examples each
export KVT_HYPOTHESIS_MAX_EXAMPLES=${KVT_HYPOTHESIS_MAX_EXAMPLES:-200} HYPOTHESIS_PROFILE=ci
# mutmut forks each mutant's test run from a process that has run tests already; torch's OpenMP pool does not
# survive a fork (the child hangs in its first torch.zeros, at no CPU, until mutmut's timeout): one thread, no pool
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
CHILDREN=${MUTMUT_CHILDREN:-1}

# Of manager.py, receiving.py and sidecontext.py (the receiving side and the context split out of it), the receiver's checks of what a peer
# sends: admission (the secret), the handshake (compatibility, one link per sender, our proof of the secret),
# the bounds of SIGNAL, PUT, CHECKSUM and CANCEL frames, the doorbell's layer filter and the checksum
# verification. The sender side (sending.py, parking.py) is left out.
MANAGER_RECEIVE_CHECKS=(
  'kvtransport.sidecontext.xǁSideContextǁcheck_compatible__mutmut_*'
  'kvtransport.receiving.xǁReceiverǁon_hello__mutmut_*'
  'kvtransport.receiving.x_hello_length__mutmut_*'
  'kvtransport.receiving.xǁInboundǁserve__mutmut_*'
  'kvtransport.receiving.xǁInboundǁ_handshake__mutmut_*'
  'kvtransport.receiving.xǁInboundǁ_on_frame__mutmut_*'
  'kvtransport.receiving.xǁInboundǁ_on_put__mutmut_*'
  'kvtransport.receiving.xǁInboundǁ_verify__mutmut_*'
  'kvtransport.receiving.xǁInboundǁpoll_bell__mutmut_*'
)
CORE=('kvtransport.coalesce.*' 'kvtransport.semaphores.*' 'kvtransport.wire.*' 'kvtransport.layout.*'
      'kvtransport.checks.*' "${MANAGER_RECEIVE_CHECKS[@]}")
SCHED_DIR=$ROOT/build/mutation-vllm

core() {
  "$VENV/bin/mutmut" run --max-children "$CHILDREN" "${@:-${CORE[@]}}"
}

scheduler() {
  mkdir -p "$SCHED_DIR"
  # copies keep their times, so mutmut regenerates only what changed since the last run
  rm -rf "$SCHED_DIR/kvtransport_vllm" "$SCHED_DIR/tests" "$SCHED_DIR/benchmarks"
  cp -rp integration/vllm/kvtransport_vllm benchmarks "$SCHED_DIR/"
  mkdir -p "$SCHED_DIR/tests"
  cp -rp tests/conftest.py tests/integration "$SCHED_DIR/tests/"
  "$VENV/bin/python" - "$SCHED_DIR/pyproject.toml" <<'PY'
import sys, tomllib
ini = tomllib.load(open("pyproject.toml", "rb"))["tool"]["pytest"]["ini_options"]
def toml(v):
    return "[" + ", ".join(toml(x) for x in v) + "]" if isinstance(v, list) else repr(v).replace("'", '"')
lines = ["# written by scripts/mutation.sh: the scheduler stage of the mutation run", "[tool.pytest.ini_options]"]
lines += [f"{k} = {toml(v)}" for k, v in ini.items()]
lines += ["", "[tool.mutmut]",
          'source_paths = ["kvtransport_vllm/scheduler.py", "kvtransport_vllm/producer.py", '
          '"kvtransport_vllm/consumer.py", "kvtransport_vllm/pushplan.py", "kvtransport_vllm/pusher.py", '
          '"kvtransport_vllm/worker.py", "kvtransport_vllm/sidechannel.py"]',
          'also_copy = ["kvtransport_vllm/", "tests/", "benchmarks/"]',
          'pytest_add_cli_args_test_selection = ["tests/integration/test_scheduler_connector.py", '
          '"tests/integration/test_pushplan.py", "tests/integration/test_worker_connector.py", '
          '"tests/integration/test_worker_hostile.py", "tests/integration/test_worker_reshard.py", '
          '"tests/integration/test_dst_channel.py", "tests/integration/test_sidechannel_auth.py", '
          '"tests/integration/test_sidechannel_bounds.py", "tests/integration/test_sidechannel_retry.py", '
          '"tests/integration/test_producer_orphans.py", "tests/integration/test_bootstrap_dp.py", '
          '"tests/integration/test_transfer_params.py", "tests/integration/test_mooncake_shape.py", '
          '"tests/integration/test_scheduler_side.py", "tests/integration/test_pusher.py", '
          '"tests/integration/test_worker_books.py", "tests/integration/test_producer_messages.py", '
          '"tests/integration/test_producer_requests.py", "tests/integration/test_producer_events.py"]',
          "do_not_mutate_patterns = ['\\blog\\.(debug|info|warning|error|exception)\\(', '^\\s*raise \\w+(\\.\\w+)?\\(']",
          # (test_transfer_params.py's parametrized ids are kept to [A-Za-z0-9_=.-]: mutmut hands them back to
          # pytest, which failed the clean run on ids with '\\n' or 300-character hosts in them)
          # a mutant that spins is stopped after 6x (its tests' measured time + 10 s of set-up: threads, torch)
          # of CPU time (mutmut's default, 30x (time + 1 s), cost 2-3 minutes per such mutant); one that waits,
          # by pytest-timeout: both count as detected
          'timeout_multiplier = 3.0', 'timeout_constant = 10.0',
          'pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q", "--timeout=30"]']
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
PY
  (cd "$SCHED_DIR" && "$VENV/bin/mutmut" run --max-children "$CHILDREN" "$@")
}

report() {
  "$VENV/bin/python" scripts/mutation_report.py --core . --scheduler "$SCHED_DIR" "${MANAGER_RECEIVE_CHECKS[@]}"
}

stage=${1:-all}
[ $# -gt 0 ] && shift
rc=0
case $stage in
  core) core "$@" || rc=$? ;;
  scheduler) scheduler "$@" || rc=$? ;;
  all) core || rc=$?; scheduler || rc=$? ;;
  report) ;;
  *) echo "usage: $0 [all|core|scheduler|report] [MUTANT_NAME_PATTERN...]" >&2; exit 2 ;;
esac
report
exit $rc
