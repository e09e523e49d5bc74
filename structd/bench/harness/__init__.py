"""The benchmark harness: what every `structd bench` subcommand shares, and the launchers tests use.

- benchmark.py: the `Benchmark` protocol and the driver (--out, the result
  header, JSON + PNG + markdown, usage errors);
- output.py: the header (machine, commit, load average), matplotlib, progress;
- services.py: the services as child processes or threads of this process,
  and the grammar + inference pair;
- children.py: one forked process per schema, with a deadline;
- old_new.py: an old git revision of a module against the working tree's.
"""

from structd.bench.harness.benchmark import Benchmark, UsageError, add_arguments, run
from structd.bench.harness.output import machine, progress, pyplot, save_figure
from structd.bench.harness.services import (ChildService, ServiceThread, free_port, grammar_and_inference,
                                            process_and_children)

__all__ = ["Benchmark", "ChildService", "ServiceThread", "UsageError", "add_arguments", "free_port",
           "grammar_and_inference", "machine", "process_and_children", "progress", "pyplot", "run",
           "save_figure"]
