"""`structd bench grammar` (being written)."""


def add_arguments(parser):
    parser.add_argument("--out", default="bench-results/grammar")


def run_bench(args) -> int:
    raise SystemExit("structd bench grammar: not written yet")
