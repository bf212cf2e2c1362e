"""Code the benchmarks and probes share: bare driver calls, the stages of preparing host memory,
and the C timing programs. What they share with the tests (the workload shapes, the ledger's
reader) is the tests': this package reaches into tests/support/ too, so `support.workloads`
and `support.ledger` are tests/support/workloads.py and tests/support/ledger.py."""

from pathlib import Path

__path__.append(str(Path(__file__).resolve().parents[2] / "tests" / "support"))
