"""structd's composition root: the `structd` command line, `structd up` and the benchmarks.

It may import anything (both services, shared/); nothing in grammar_svc/,
inference_svc/ or shared/ imports it (tests/test_import_rules.py).
"""
